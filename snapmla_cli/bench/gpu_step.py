"""The real step runner of ``snapmla bench``: one decode step of an MLA attention stack on one GPU.

A step is ``L`` attention calls, each a real launch sequence:
- FP8 (SnapMLA): fused Q-quant (``quantize_q``), fused K-append of the step's new tokens into the
  656-byte cache (``append_kv``), FP8 decode (``decode_fp8``).
- BF16 baseline: the new tokens copied into the bf16 cache (``index_copy_``), then FlashMLA's
  ``flash_mla_with_kvcache`` when the ``flash_mla`` package is importable (``--bf16-impl auto``),
  else snapmla's BF16 kernel (``decode_bf16``).

What is shared and what is not (docs/DESIGN.md): every layer has its own q and new-token rows;
the KV cache tensors are shared between layers (the attention cost per layer is identical, and
memory stays bounded), with enough distinct caches that a small cache is never re-read from L2 by
the next layer (``plan.distinct_caches``). Requests keep a fixed length: each step rewrites the
last ``s_q`` positions, so repeated steps do the same work. The split-KV metadata is computed
once per case, outside the timed step (an engine computes it once per step for all layers).

The step is captured once in a CUDA graph and the replays are timed (CUDA events, median); if the
capture fails the step is timed as eager launches and the measurement says so.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType

import torch

from ..cache.layout import random_paged_layout
from ..errors import SnapmlaError
from ..numerics.formats import D_QK, D_V, FP8_TOKEN_BYTES, PAGE_SIZE
from .ceilings import measure_ceilings
from .plan import FP8, TOKEN_BYTES, distinct_caches
from .results import StepTiming
from .roofline import Ceilings, DecodeWork
from .timing import CLOCKS, STEADY, capture_graph, round_spread, time_cuda_rounds
from .worker import StepSpec

FILL_TOKENS = 1 << 20  # tokens per chunk when filling a cache with random data
# a timed round lasts at least this long (more steps than --steps asks where a step is short): on
# an H100 a 2-layer 1k step (35-40 us) read 48-99% apart between rounds of one step, 7.5-30% with
# four, 1-5% with twenty (docs/PERF.md, fifty-first session)
MIN_ROUND_S = 1e-3


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def flashmla_module() -> ModuleType | None:
    """FlashMLA's Python package, or None when it is not importable."""
    try:
        import flash_mla
    except Exception:  # noqa: BLE001 - absent or broken: the baseline falls back to snapmla's
        return None
    if not hasattr(flash_mla, "flash_mla_with_kvcache") or not hasattr(flash_mla, "get_mla_metadata"):
        return None
    return flash_mla


@dataclass
class _Inputs:
    """The step's tensors that do not depend on the cache format."""

    block_table: torch.Tensor  # int32 [b, pages]
    seqlens: torch.Tensor  # int32 [b]
    slots: torch.Tensor  # int32 [b * s_q]: where the new tokens go
    q: torch.Tensor  # bf16 [L, b, s_q, h, 576]: one q per layer
    kv_new: torch.Tensor  # bf16 [L, b * s_q, 576]: the new tokens of each layer
    num_blocks: int


def _inputs(spec: StepSpec, device: torch.device) -> _Inputs:
    cpu_gen = torch.Generator().manual_seed(spec.seed)
    layout = random_paged_layout([spec.context] * spec.batch, generator=cpu_gen, spare_blocks=0)
    pos = torch.arange(spec.context - spec.s_q, spec.context)
    pages = layout.block_table[:, pos // PAGE_SIZE].long()
    slots = (pages * PAGE_SIZE + pos % PAGE_SIZE).reshape(-1).to(torch.int32)
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    shape_q = (spec.layers, spec.batch, spec.s_q, spec.heads, D_QK)
    q = torch.randn(shape_q, generator=gen, device=device, dtype=torch.bfloat16)
    kv_new = torch.randn((spec.layers, spec.batch * spec.s_q, D_QK), generator=gen, device=device,
                         dtype=torch.bfloat16)
    return _Inputs(layout.block_table.to(device), layout.cache_seqlens.to(device),
                   slots.to(device), q, kv_new, layout.num_blocks)


def _fp8_cache(num_blocks: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A 656-byte cache holding random tokens, written by the K-append kernel (real scales)."""
    from ..ops.prep import append_kv

    cache = torch.empty((num_blocks, PAGE_SIZE, FP8_TOKEN_BYTES), dtype=torch.uint8, device=device)
    tokens = num_blocks * PAGE_SIZE
    for start in range(0, tokens, FILL_TOKENS):
        n = min(FILL_TOKENS, tokens - start)
        kv = torch.randn((n, D_QK), generator=gen, device=device, dtype=torch.bfloat16)
        append_kv(kv, torch.arange(start, start + n, device=device, dtype=torch.int32), cache)
    return cache


def _bf16_cache(num_blocks: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn((num_blocks, PAGE_SIZE, 1, D_QK), generator=gen, device=device,
                       dtype=torch.bfloat16)


class GpuStepRunner:
    """Times :class:`StepSpec` steps on ``cuda:local_rank``."""

    def __init__(self, local_rank: int, steps: int = 20, warmup: int = 3, graphs: bool = True,
                 bf16_impl: str = "auto", roofline: bool = True, clocks: str = STEADY.name) -> None:
        self.local_rank, self.steps, self.warmup = local_rank, steps, warmup
        self.clocks = CLOCKS[clocks]
        self.graphs, self.bf16_impl, self.roofline = graphs, bf16_impl, roofline
        self.device = torch.device("cuda", local_rank)
        self.device_name = ""
        self.ceilings: Ceilings | None = None
        self.flashmla: ModuleType | None = None

    def setup(self) -> dict:
        torch.cuda.set_device(self.device)
        props = torch.cuda.get_device_properties(self.device)
        self.device_name = props.name
        facts: dict = {"device": props.name, "sms": props.multi_processor_count,
                       "memory_bytes": props.total_memory}
        if self.bf16_impl in ("auto", "flashmla"):
            self.flashmla = flashmla_module()
            if self.flashmla is None and self.bf16_impl == "flashmla":
                raise SnapmlaError("--bf16-impl flashmla: the flash_mla package is not importable")
        facts["bf16_kernel"] = "flashmla" if self.flashmla is not None else "snapmla-bf16"
        if self.roofline:
            # in the steps' clock state (a step of 61 layers runs for tens of ms: by default the
            # steady, power-capped state)
            self.ceilings = measure_ceilings(self.device, self.clocks)
            facts["ceilings"] = asdict(self.ceilings)
            gc.collect()
            torch.cuda.empty_cache()
        return facts

    # ------------------------------------------------------------------ steps

    def _fp8_step(self, spec: StepSpec, x: _Inputs, caches: list[torch.Tensor]) -> tuple[Callable[[], None], str]:
        from ..ops.decode import decode_fp8, get_mla_metadata
        from ..ops.prep import append_kv, quantize_q

        meta, splits = get_mla_metadata(x.seqlens, spec.s_q * spec.heads, 1, fp8=True, s_q=spec.s_q)
        n = len(caches)

        def step() -> None:
            for layer in range(spec.layers):
                cache = caches[layer % n]
                qq = quantize_q(x.q[layer])
                append_kv(x.kv_new[layer], x.slots, cache)
                decode_fp8(qq, cache, x.block_table, x.seqlens, meta, splits, None, True)

        return step, "snapmla-fp8"

    def _flashmla_step(self, fm: ModuleType, spec: StepSpec, x: _Inputs, caches: list[torch.Tensor]) -> tuple[Callable[[], None], str]:
        n = len(caches)
        flat = [cache.view(-1, D_QK) for cache in caches]
        slots = x.slots.long()
        meta, splits = fm.get_mla_metadata(x.seqlens, spec.s_q * spec.heads, 1)

        def step() -> None:
            for layer in range(spec.layers):
                flat[layer % n].index_copy_(0, slots, x.kv_new[layer])
                fm.flash_mla_with_kvcache(x.q[layer], caches[layer % n], x.block_table,
                                          x.seqlens, D_V, meta, splits, causal=True)

        return step, "flashmla-bf16"

    def _bf16_step(self, spec: StepSpec, x: _Inputs, caches: list[torch.Tensor]) -> tuple[Callable[[], None], str]:
        from ..ops.decode import decode_bf16, get_mla_metadata

        n = len(caches)
        flat = [cache.view(-1, D_QK) for cache in caches]
        slots = x.slots.long()
        meta, splits = get_mla_metadata(x.seqlens, spec.s_q * spec.heads, 1, fp8=False, s_q=spec.s_q)

        def step() -> None:
            for layer in range(spec.layers):
                flat[layer % n].index_copy_(0, slots, x.kv_new[layer])
                decode_bf16(x.q[layer], caches[layer % n], x.block_table, x.seqlens, meta,
                            splits, None, True)

        return step, "snapmla-bf16"

    # ------------------------------------------------------------------ timing

    def _time(self, step: Callable[[], None], ready: Callable[[], None]) -> tuple[list[float], bool, str]:
        """Seconds per step of each timed round, graph replay or eager; ``ready()`` once, right
        before."""
        step()  # compiles and loads the kernels outside any capture
        torch.cuda.synchronize(self.device)
        note = ""
        if self.graphs:
            try:
                graph = capture_graph(step)
            except Exception as exc:  # noqa: BLE001 - any capture failure: time eagerly instead
                torch.cuda.synchronize(self.device)
                note = f"CUDA graph capture failed ({_one_line(exc)}); timed eager launches"
            else:
                try:
                    ready()
                    return self._rounds(graph.replay), True, ""
                finally:
                    del graph
        ready()
        return self._rounds(step), False, note

    def _rounds(self, fn: Callable[[], object]) -> list[float]:
        """The timed rounds of ``fn`` with this runner's steps, warm-up and clocks."""
        return time_cuda_rounds(fn, reps=self.steps, warmup=self.warmup, clocks=self.clocks,
                                min_round_s=MIN_ROUND_S)

    def run(self, spec: StepSpec, ready: Callable[[], None]) -> StepTiming:
        try:
            return self._run(spec, ready)
        finally:  # the case's tensors (and graph pool) are unreachable now: give them back
            gc.collect()
            torch.cuda.empty_cache()

    def _run(self, spec: StepSpec, ready: Callable[[], None]) -> StepTiming:
        fp8 = spec.impl == FP8
        x = _inputs(spec, self.device)
        gen = torch.Generator(device=self.device).manual_seed(spec.seed + 1)
        cache_bytes = x.num_blocks * PAGE_SIZE * TOKEN_BYTES[spec.impl]
        first = (_fp8_cache if fp8 else _bf16_cache)(x.num_blocks, self.device, gen)
        count = distinct_caches(cache_bytes, spec.layers)
        caches = [first] + [first.clone() for _ in range(count - 1)]
        notes = []
        built: tuple[Callable[[], None], str] | None = None  # the step and the kernel's name
        if fp8:
            built = self._fp8_step(spec, x, caches)
        elif self.flashmla is not None:
            try:
                built = self._flashmla_step(self.flashmla, spec, x, caches)
                built[0]()
            except Exception as exc:  # noqa: BLE001 - FlashMLA build or API mismatch
                if self.bf16_impl == "flashmla":
                    raise SnapmlaError(f"--bf16-impl flashmla: FlashMLA failed ({_one_line(exc)})") from None
                notes.append(f"FlashMLA failed ({_one_line(exc)}); BF16 baseline is snapmla-bf16")
                self.flashmla, built = None, None
        if built is None:
            built = self._bf16_step(spec, x, caches)
        step, kernel = built
        rounds, graphed, time_note = self._time(step, ready)
        notes.append(time_note)
        t_min = bf16_t_min = None
        if self.ceilings is not None:
            work = DecodeWork(spec.batch, spec.s_q, spec.heads, spec.context, causal=True)
            t_min = spec.layers * work.t_min(fp8, self.ceilings)
            bf16_t_min = spec.layers * work.t_min(False, self.ceilings) if fp8 else None
        return StepTiming(statistics.median(rounds), kernel, graphed, t_min, "; ".join(n for n in notes if n),
                          spread=round_spread(rounds), bf16_t_min_s=bf16_t_min)

    def close(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()
