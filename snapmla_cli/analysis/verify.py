"""``snapmla verify``: decode implementations checked against the float64 references (SPEC section 6).

A *case* is one (h_q, s_q) decode problem over ``batch`` requests of ``ctx`` tokens each. For every
case the references are computed once: ``ref64`` (float64 decode on the bf16 cache), ``floor``
(float64 decode on the dequantized FP8 Q and cache) and ``emul`` (the section-5 emulation). Each
*implementation* (a name, a kind and a callable ``DecodeProblem -> (out, lse)``) is then measured
against them and gated:

- kind ``fp8``: vs ``ref64`` ``rel_l2 <= floor_factor * rel_l2(floor, ref64) + floor_abs``; and,
  unless it is the emulation itself, vs ``emul`` ``rel_l2 <= emul_rel_l2``;
- kind ``bf16``: vs ``ref64`` ``cos_diff <= bf16_cos_diff``.

NaN or inf where the reference is finite makes a metric +inf and fails its gate. On a machine
without a GPU the only implementation is the emulation; :func:`default_implementations` is where
the GPU kernels join.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.dump_file import LayerDump
from ..cache.layout import dequantize_cache, random_paged_layout
from ..cache.synth import DEFAULT_SPEC, probe_queries, synth_layer_kv
from ..errors import NoGpuError, SnapmlaError
from ..numerics.decode_ref import decode_reference
from ..numerics.emulation import emulate_fp8_decode
from ..numerics.formats import default_softmax_scale
from ..numerics.metrics import ErrorMetrics, compare
from ..numerics.problem import DecodeProblem

EMULATION = "emul"
# gate names the table and the JSON report carry; the CLI picks columns by them
REL_L2_GATE = "rel_l2 vs ref64"
LSE_GATE_PREFIX = "lse max_abs vs "
DecodeFn = Callable[[DecodeProblem], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Implementation:
    """A decode implementation under test. ``kind`` selects its gates: ``"fp8"`` or ``"bf16"``."""

    name: str
    kind: str
    run: DecodeFn


def run_emulation(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """The SPEC section-5 emulation on the problem's quantized Q and FP8 cache (float64 results)."""
    layout = problem.layout
    return emulate_fp8_decode(problem.q_quantized(), problem.fp8_cache(), layout.block_table,
                              layout.cache_seqlens, problem.softmax_scale, problem.causal)


def resolve_device(device: str | None) -> torch.device:
    """``None``/"auto": CUDA when torch sees a GPU, else the CPU; "cuda" without one is an error."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise SnapmlaError(f"--device: expected cpu or cuda, got {device!r}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise NoGpuError("--device cuda: torch sees no CUDA GPU on this machine")
    return torch.device(device)


def _run_kernel(problem: DecodeProblem, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """snapmla's kernel through the FlashMLA-compatible entry point: the FP8 cache takes the
    fused Q-quant + FP8 decode, the bf16 cache the BF16 baseline; on the problem's device."""
    from ..ops.decode import flash_mla_with_kvcache, get_mla_metadata

    layout = problem.layout
    _b, s_q, h_q, _ = problem.q.shape
    meta, splits = get_mla_metadata(layout.cache_seqlens, s_q * h_q, 1, fp8=fp8, s_q=s_q)
    cache = problem.fp8_cache() if fp8 else problem.bf16_cache()
    return flash_mla_with_kvcache(problem.q, cache, layout.block_table, layout.cache_seqlens, 512,
                                  meta, splits, problem.softmax_scale, problem.causal)


def run_fp8_kernel(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_kernel(problem, fp8=True)


def run_bf16_kernel(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_kernel(problem, fp8=False)


def run_flash_mla(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's own BF16 kernel, when the ``flash_mla`` package is importable."""
    import flash_mla

    layout = problem.layout
    _b, s_q, h_q, _ = problem.q.shape
    meta, splits = flash_mla.get_mla_metadata(layout.cache_seqlens, s_q * h_q, 1)
    return flash_mla.flash_mla_with_kvcache(problem.q, problem.bf16_cache(), layout.block_table,
                                            layout.cache_seqlens, 512, meta, splits,
                                            softmax_scale=problem.softmax_scale,
                                            causal=problem.causal)


# name -> (kernel version, DecodeConfig overrides of the wgmma kernel's heuristic)
FP8_KERNEL_VARIANTS: dict[str, tuple[int, dict[str, int]]] = {
    "v2": (2, {}),
    "v3": (3, {}),
    "v3-dims": (3, {"wg_mode": 0}),
    "v3-rows": (3, {"wg_mode": 1}),
    "v3-pingpong": (3, {"wg_mode": 2}),
    "v3-alt": (3, {"wg_mode": 3}),
    "v3-rows-m": (3, {"wg_mode": 4, "row_groups": 4}),  # 64-row tiles only, padded below 64 rows
    "v3-vt": (3, {"wg_mode": 6, "row_groups": 4}),  # rows = M with V^T in shared memory, 64-row tiles
    "v3-unpromoted": (3, {"wg_mode": 0, "qk_promote": 0, "pv_promote": 0}),
    "v3-pq": (3, {"wg_mode": 0, "qk_promote": 1, "pv_promote": 0}),
    "v3-pv": (3, {"wg_mode": 0, "qk_promote": 0, "pv_promote": 1}),
}
FP8_KERNEL_SPECS = ("default", *FP8_KERNEL_VARIANTS)


def fp8_kernel_implementation(spec: str) -> Implementation:
    """The FP8 kernel named by ``spec``: ``default`` (what ``flash_mla_with_kvcache`` picks:
    tuning database, else heuristic), ``v2`` (mma.sync), ``v3`` (wgmma, at its heuristic),
    ``v3-dims`` / ``v3-rows`` / ``v3-pingpong`` / ``v3-alt`` / ``v3-rows-m`` / ``v3-vt`` (wgmma in one
    warpgroup mode, see ``DecodeConfig.wg_mode``), and the diagnostic wgmma
    kernels without float32 promotion of both accumulations: ``v3-unpromoted``, ``v3-pq`` (QK
    promoted only), ``v3-pv`` (PV only)."""
    if spec not in FP8_KERNEL_SPECS:
        raise SnapmlaError(f"--fp8-kernel: {spec!r} is not one of {', '.join(FP8_KERNEL_SPECS)}")
    if spec == "default":
        return Implementation("fp8-kernel", "fp8", run_fp8_kernel)
    version, overrides = FP8_KERNEL_VARIANTS[spec]

    def run(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
        from ..ops.decode import decode_fp8, get_mla_metadata
        from ..ops.decode_config import variant_config
        from ..ops.prep import quantize_q

        layout = problem.layout
        _b, s_q, h_q, _ = problem.q.shape
        cfg = variant_config(s_q * h_q, version, **overrides)
        cfg = cfg.with_sms(torch.cuda.get_device_properties(problem.q.device).multi_processor_count)
        meta, splits = get_mla_metadata(layout.cache_seqlens, s_q * h_q, 1, config=cfg)
        return decode_fp8(quantize_q(problem.q), problem.fp8_cache(), layout.block_table,
                          layout.cache_seqlens, meta, splits, problem.softmax_scale, problem.causal,
                          config=cfg)

    return Implementation(f"fp8-{spec}", "fp8", run)


def kernels_problem(device: torch.device) -> str | None:
    """Why no kernel can run on the CUDA ``device`` (a GPU they are not built for), or None;
    None on the CPU too, where verify checks the emulation by design."""
    if device.type != "cuda":
        return None
    from ..runtime.gpu_arch import kernels_gpu_problem

    return kernels_gpu_problem(torch.cuda.current_device() if device.index is None else device.index)


def default_implementations(device: torch.device, fp8_kernels: tuple[str, ...] = ("default",),
                            kernels: bool = True) -> list[Implementation]:
    """What ``verify`` checks on ``device``: the emulation always; on a CUDA GPU, unless
    ``kernels`` is False (a GPU they are not built for), also snapmla's FP8 kernel(s)
    (``fp8_kernels``, see :func:`fp8_kernel_implementation`) and BF16 kernel, and FlashMLA when
    it is installed."""
    fp8_impls = [fp8_kernel_implementation(spec) for spec in fp8_kernels]  # validated on any device
    impls = [Implementation(EMULATION, "fp8", run_emulation)]
    if device.type == "cuda" and kernels:
        impls += fp8_impls
        impls.append(Implementation("bf16-kernel", "bf16", run_bf16_kernel))
        try:
            import flash_mla  # noqa: F401
        except ImportError:
            pass
        else:
            impls.append(Implementation("flashmla-bf16", "bf16", run_flash_mla))
    return impls


@dataclass(frozen=True)
class Gates:
    emul_rel_l2: float = 5e-3
    floor_factor: float = 1.10
    floor_abs: float = 1e-3
    bf16_cos_diff: float = 5e-6
    # lse's largest absolute difference: an FP8 kernel's from the emulation's, a BF16 kernel's
    # from ref64's (the GPU tests' bound). SPEC section 6 gates ``out`` only; lse is what an
    # engine merges split partial results with, so a NaN or shifted lse must fail too.
    lse_max_abs: float = 1e-2


@dataclass(frozen=True)
class GateCheck:
    name: str  # e.g. "rel_l2 vs ref64"
    value: float
    limit: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.value) and self.value <= self.limit


@dataclass
class ImplResult:
    name: str
    kind: str
    vs_ref64: ErrorMetrics
    lse_vs_ref64: ErrorMetrics
    vs_emul: ErrorMetrics | None
    checks: list[GateCheck]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


@dataclass
class CaseResult:
    heads: int
    mtp: int
    batch: int
    ctx: int
    causal: bool
    floor: ErrorMetrics  # floor vs ref64 (out)
    impls: list[ImplResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.impls)


@dataclass(frozen=True)
class ImplErrors:
    """One implementation's output and lse against the references (``None``: the implementation
    is the emulation itself)."""

    vs_ref: ErrorMetrics
    lse_vs_ref: ErrorMetrics
    vs_emul: ErrorMetrics | None
    lse_vs_emul: ErrorMetrics | None


def _gate_checks(kind: str, name: str, errors: ImplErrors, floor: ErrorMetrics, gates: Gates) -> list[GateCheck]:
    if kind == "bf16":
        return [GateCheck("cos_diff vs ref64", errors.vs_ref.cos_diff, gates.bf16_cos_diff),
                GateCheck(f"{LSE_GATE_PREFIX}ref64", errors.lse_vs_ref.max_abs, gates.lse_max_abs)]
    if kind != "fp8":
        raise SnapmlaError(f"implementation {name}: unknown kind {kind!r} (expected fp8 or bf16)")
    checks = [GateCheck(REL_L2_GATE, errors.vs_ref.rel_l2, gates.floor_factor * floor.rel_l2 + gates.floor_abs)]
    if errors.vs_emul is not None:
        checks.append(GateCheck("rel_l2 vs emul", errors.vs_emul.rel_l2, gates.emul_rel_l2))
    if errors.lse_vs_emul is not None:
        checks.append(GateCheck(f"{LSE_GATE_PREFIX}emul", errors.lse_vs_emul.max_abs, gates.lse_max_abs))
    return checks


def _timed(fn: DecodeFn, problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor, float]:
    cuda = problem.q.is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out, lse = fn(problem)
    if cuda:
        torch.cuda.synchronize()
    return out, lse, time.perf_counter() - start


def run_case(problem: DecodeProblem, impls: list[Implementation], gates: Gates = Gates()) -> CaseResult:
    """Compute the references once, then run and gate every implementation."""
    layout = problem.layout
    args = (layout.block_table, layout.cache_seqlens, problem.softmax_scale, problem.causal)
    ref_out, ref_lse = decode_reference(problem.q, problem.bf16_cache().squeeze(2), *args)
    q_deq = problem.q_quantized().dequantize(torch.float64)
    floor_out, _ = decode_reference(q_deq, dequantize_cache(problem.fp8_cache(), torch.float64), *args)
    floor = compare(floor_out, ref_out)
    b, s_q, h_q, _ = problem.q.shape
    ctx = int(layout.cache_seqlens.max())
    result = CaseResult(h_q, s_q, b, ctx, problem.causal, floor)
    emul: tuple[torch.Tensor, torch.Tensor] | None = None
    for impl in impls:
        out, lse, seconds = _timed(impl.run, problem)
        if impl.name == EMULATION:
            emul = (out, lse)
            vs_emul = lse_vs_emul = None
        else:
            if emul is None:
                emul = run_emulation(problem)
            vs_emul, lse_vs_emul = compare(out, emul[0]), compare(lse, emul[1])
        errors = ImplErrors(compare(out, ref_out), compare(lse, ref_lse), vs_emul, lse_vs_emul)
        checks = _gate_checks(impl.kind, impl.name, errors, floor, gates)
        result.impls.append(ImplResult(impl.name, impl.kind, errors.vs_ref, errors.lse_vs_ref, vs_emul,
                                       checks, seconds))
    return result


# ---------------------------------------------------------------- problems


@dataclass(frozen=True)
class ProblemSource:
    """Where a verify run's KV and queries come from: the embedded synthetic model's layer
    ``layer`` (``dump is None``), or a layer of a KV dump (its own queries when it has some)."""

    layer: int
    seed: int = 0
    dump: LayerDump | None = None

    @property
    def label(self) -> str:
        return f"dump layer {self.layer}" if self.dump is not None else f"synthetic layer {self.layer}"


def synthetic_source(layer: int | None, seed: int = 0) -> ProblemSource:
    """A layer of the default synthetic model (the last, widest-RoPE one when ``layer`` is None)."""
    last = DEFAULT_SPEC.layers - 1
    layer = last if layer is None else layer
    if not 0 <= layer <= last:
        raise SnapmlaError(f"--layer {layer}: the synthetic model has layers 0..{last}")
    return ProblemSource(layer=layer, seed=seed)


# The synthetic requests' length when --ctx is not given.
DEFAULT_CONTEXT = 32 * 1024


def request_tokens(source: ProblemSource, batch: int, ctx: int | None) -> list[torch.Tensor]:
    """bf16 ``[ctx, 576]`` KV of each request. Synthetic: request ``i`` is the layer generated
    with seed ``seed + i``. Dump: every request holds the layer's first ``ctx`` tokens."""
    if batch < 1:
        raise SnapmlaError(f"--batch: expected at least 1, got {batch}")
    if source.dump is not None:
        kv = source.dump.kv
        ctx = kv.shape[0] if ctx is None else ctx
        check_dump_context(source, ctx)
        return [kv[:ctx].to(torch.bfloat16)] * batch
    ctx = DEFAULT_CONTEXT if ctx is None else ctx
    depth = DEFAULT_SPEC.depth(source.layer)
    return [synth_layer_kv(ctx, depth, source.seed + i, source.layer)[0] for i in range(batch)]


def check_dump_context(source: ProblemSource, ctx: int) -> None:
    """A dump's layer holds the ``--ctx`` tokens asked for; checked before the memory estimate,
    which for a context past the dump's end named ``--batch`` instead."""
    if source.dump is not None and ctx > source.dump.kv.shape[0]:
        raise SnapmlaError(f"--ctx {ctx}: dump layer {source.layer} has only {source.dump.kv.shape[0]} tokens")


def check_query_tokens(tokens: list[torch.Tensor], mtp: int) -> None:
    """``mtp`` query tokens fit in every request of ``tokens`` (each query token sits at one of the
    request's last ``mtp`` positions). Checked for the largest ``--mtp`` before the first case, so
    that a bad list fails at once instead of after the cases of the smaller values have run."""
    shortest = min(kv.shape[0] for kv in tokens)
    if mtp > shortest:
        raise SnapmlaError(f"--mtp {mtp} exceeds the context of {shortest} tokens")


def make_problem(source: ProblemSource, tokens: list[torch.Tensor], heads: int, mtp: int,
                 causal: bool, seed: int = 0) -> DecodeProblem:
    """Queries ``[b, mtp, heads, 576]`` for ``tokens`` and a random paged layout (NaN-poisoned
    unused rows, garbage unused block-table entries). Query token ``t`` of request ``i`` sits at
    position ``n_i - mtp + t``: the dump's own queries when it has some (cycled over rows and
    heads), else :func:`probe_queries` anchored there."""
    if heads < 1 or not 1 <= mtp:
        raise SnapmlaError(f"need heads >= 1 and mtp >= 1, got heads={heads}, mtp={mtp}")
    check_query_tokens(tokens, mtp)
    rows = []
    for i, kv in enumerate(tokens):
        n = kv.shape[0]
        dumped = source.dump.queries if source.dump is not None else None
        if dumped is not None:
            pick = torch.arange(i * mtp, (i + 1) * mtp) % dumped.shape[0]
            head = torch.arange(heads) % dumped.shape[1]
            rows.append(dumped[pick][:, head].to(torch.bfloat16))
        else:
            anchors = [n - mtp + t for t in range(mtp)]
            rows.append(probe_queries(kv, mtp, heads, seed * 7919 + i, anchors=anchors))
    q = torch.stack(rows)
    gen = torch.Generator().manual_seed(seed)
    layout = random_paged_layout([t.shape[0] for t in tokens], generator=gen)
    return DecodeProblem(q, tokens, layout, causal, default_softmax_scale())
