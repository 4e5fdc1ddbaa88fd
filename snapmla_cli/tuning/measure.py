"""The GPU side of ``snapmla tune``: compile the candidates, gate each against the reference
numerics, time it with CUDA events.

- **Correctness gate** (before any timing; a wrong-but-fast candidate is never stored): the
  candidate runs a small random problem (lengths 0, 1, 64, 777, 1500: empty requests, a partial
  page, several splits) and a long one from the synthetic default model (what ``snapmla
  verify`` uses: two requests of 32k tokens whose attention is spread over many keys, about 7x
  more sensitive to logit error than the random data), with NaN-poisoned outputs. FP8: ``rel_l2(out, emulation) <= 5e-3`` with
  the emulation run on the candidate's own split bounds, and ``max |lse - lse_emul| < 1e-2``
  (SPEC section 6, as ``tests/gpu/test_decode.py``). BF16: ``cos_diff(out, float64) <= 5e-6``.
- **Timing**: the bucket's timed shape (all requests at the timed context), KV pages in a random
  order; when one input set fits in twice the L2 cache, several copies of the cache are made and
  the calls rotate through them, so every call reads from HBM. Each candidate: one untimed
  rotation (loads the kernels), the rotation captured in a CUDA graph (as an engine replays its
  decode step, and as ``snapmla bench`` and ``scripts/bench_decode.py`` time it), one timed
  replay (a candidate already 1.5x slower than the best so far stops here), then
  :data:`TUNE_CLOCKS`: 0.1 s idle, 5 ms of warm-up, the median of 5 rounds within 20 ms.
  Why the idle and the short window (docs/PERF.md, fifteenth session): after 25-50 ms of
  continuous work the H200's power cap lowers the SM clock by 5-15%, and a tuner that times
  its candidates back to back (0.1 s each, as before) ranks close plans in a drifting,
  history-dependent state: its BF16 picks lost 1-2.4% to the heuristic at boost clocks, and
  the same pairs timed power-capped in alternation scattered from 0.81x to 1.04x.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..bench.timing import Clocks, capture_graph, time_cuda
from ..errors import SnapmlaError
from ..numerics.formats import (
    BF16_TOKEN_BYTES,
    D_CONTENT,
    D_QK,
    D_ROPE,
    D_V,
    FP8_TOKEN_BYTES,
    PAD_OFFSET,
    PAGE_SIZE,
    ROPE_OFFSET,
    SCALE_OFFSET,
)
from ..numerics.metrics import compare
from ..ops.decode_config import DecodeConfig
from .compile import Job, compile_jobs
from .space import Bucket, config_id, kernel_keys
from .tuner import CheckResult, FatalMeasureError

Result = TypeVar("Result")  # what a guarded GPU call returns

CHECK_SEQLENS = (1500, 64, 0, 777, 1)
CHECK_SYNTH_REQUESTS, CHECK_SYNTH_TOKENS = 2, 32768  # as `verify --ctx 32k`
EMUL_GATE = 5e-3
LSE_GATE = 1e-2
BF16_COS_GATE = 5e-6
L2_FACTOR = 2  # timed bytes per rotation >= this x the L2 size
MAX_COPIES = 256
# idle before each candidate's timing, then at most 20 ms of work: the clock stays at boost
TUNE_CLOCKS = Clocks("tune", cooldown_s=0.1, warmup_s=0.005, measure_s=0.02)
MAX_REPLAYS = 1000  # replays per timing at most (the 20 ms window binds first)
CHUNK_BLOCKS = 4096  # cache filled in chunks to bound temporaries


@dataclass
class _CheckProblem:
    q: torch.Tensor  # bf16 [b, s_q, h_q, 576]
    q_rows: Any  # QuantizedRows (FP8)
    cache: torch.Tensor
    table: torch.Tensor
    seqlens: torch.Tensor
    seqlens_host: list[int]
    scale: float
    causal: bool
    refs: dict[tuple[tuple[int, ...], ...], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _TimingInputs:
    bucket: Bucket
    q: Any  # QuantizedRows (FP8) or bf16 tensor
    cache: torch.Tensor
    tables: list[torch.Tensor]
    seqlens: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class GpuMeasurer:
    """Implements :class:`snapmla_cli.tuning.tuner.Measurer` on the current CUDA device."""

    def __init__(self, device: torch.device | None = None, *, clocks: Clocks = TUNE_CLOCKS,
                 compile_workers: int | None = None, seed: int = 0) -> None:
        from ..runtime.gpu_arch import device_arch, require_kernels_gpu
        from ..runtime.gpu_facts import nvml_uuid
        from ..runtime.launch import require_gpu

        require_gpu()
        index = device.index if device is not None else None
        if index is None:
            index = torch.cuda.current_device()
        require_kernels_gpu(index)  # before any candidate compiles for a target it cannot run on
        self.device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(self.device)
        self.uuid = nvml_uuid(props)  # the partial results' file is this GPU's own
        self.sm_count = int(props.multi_processor_count)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
        self.arch = device_arch((props.major, props.minor))
        self.clocks = clocks
        self.compile_workers = compile_workers
        self.seed = seed
        self.compile_errors: dict[Job, str | None] = {}
        self._problems: dict[tuple[str, int, int], list[_CheckProblem]] = {}
        self._synth_requests: tuple[Any, Any] | None = None  # the synthetic source and its requests
        self._checked: dict[tuple[str, int, int, str], CheckResult] = {}
        self._inputs: _TimingInputs | None = None

    # compile ---------------------------------------------------------------------------------
    def precompile(self, items: list[tuple[str, DecodeConfig]],
                   progress: Callable[[int, int], None] | None = None) -> dict[Job, str | None]:
        jobs = [job for fmt, cfg in items for job in kernel_keys(cfg, fmt)]
        self.compile_errors.update(compile_jobs(jobs, self.arch, self.compile_workers, progress))
        return self.compile_errors

    # guard -----------------------------------------------------------------------------------
    def _guard(self, fn: Callable[[], Result]) -> Result:
        try:
            return fn()
        except Exception as exc:
            try:
                torch.cuda.synchronize(self.device)
            except Exception as sticky:  # noqa: BLE001 - the context is gone
                raise FatalMeasureError(
                    f"CUDA context unusable after a candidate ({_first_line(sticky)}); run the "
                    "same command again to resume without it") from exc
            raise

    # correctness -----------------------------------------------------------------------------
    def _problems_for(self, bucket: Bucket) -> list[_CheckProblem]:
        key = (bucket.format, bucket.h_q, bucket.s_q)
        probs = self._problems.get(key)
        if probs is None:
            from ..analysis.verify import make_problem, request_tokens, synthetic_source
            from ..numerics.problem import random_problem

            rand = random_problem(list(CHECK_SEQLENS), bucket.s_q, bucket.h_q, causal=bucket.causal,
                                  seed=self.seed + 17 * bucket.h_q + bucket.s_q)
            if self._synth_requests is None:  # the same requests for every shape (1-2 s to build)
                source = synthetic_source(None, seed=self.seed)
                self._synth_requests = (source, request_tokens(source, CHECK_SYNTH_REQUESTS, CHECK_SYNTH_TOKENS))
            source, requests = self._synth_requests
            synth = make_problem(source, requests, bucket.h_q, bucket.s_q, bucket.causal, seed=self.seed)
            probs = [self._on_device(rand, bucket), self._on_device(synth, bucket)]
            self._problems[key] = probs
        return probs

    def _on_device(self, p: Any, bucket: Bucket) -> _CheckProblem:
        from ..numerics.quant import quantize_rows

        dev = self.device
        cache = p.fp8_cache() if bucket.fp8 else p.bf16_cache()
        q = p.q.to(dev)
        return _CheckProblem(q=q, q_rows=quantize_rows(q) if bucket.fp8 else None,
                             cache=cache.to(dev), table=p.layout.block_table.to(dev),
                             seqlens=p.layout.cache_seqlens.to(dev),
                             seqlens_host=[int(n) for n in p.layout.cache_seqlens.tolist()],
                             scale=p.softmax_scale, causal=p.causal, refs={})

    def _reference(self, bucket: Bucket, prob: _CheckProblem, bounds: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(tuple(b) for b in bounds) if bucket.fp8 else ()
        ref = prob.refs.get(key)
        if ref is None:
            if bucket.fp8:
                from ..numerics.emulation import emulate_fp8_decode

                ref = emulate_fp8_decode(prob.q_rows, prob.cache, prob.table, prob.seqlens,
                                         prob.scale, prob.causal, split_bounds=bounds)
            else:
                from ..numerics.decode_ref import decode_reference

                ref = decode_reference(prob.q, prob.cache.squeeze(2), prob.table, prob.seqlens,
                                       prob.scale, prob.causal)
            prob.refs[key] = ref
        return ref

    def check(self, bucket: Bucket, cfg: DecodeConfig) -> CheckResult:
        # every build a timing loads (the cluster-merge build too): a spilling one is never stored
        err = next((e for k in kernel_keys(cfg, bucket.format) if (e := self.compile_errors.get(k))), None)
        if err:
            return CheckResult(False, f"compile failed: {err}")
        key = (bucket.format, bucket.h_q, bucket.s_q, config_id(cfg, bucket.format))
        if key not in self._checked:
            self._checked[key] = self._guard(lambda: self._check(bucket, cfg))
        return self._checked[key]

    def _check(self, bucket: Bucket, cfg: DecodeConfig) -> CheckResult:
        details = []
        for name, prob in zip(("random", "synthetic"), self._problems_for(bucket)):
            ok, detail = self._check_one(bucket, cfg, prob)
            if not ok:
                return CheckResult(False, f"wrong result on the {name} problem: {detail}")
            details.append(f"{name}: {detail}")
        return CheckResult(True, "; ".join(details))

    def _check_one(self, bucket: Bucket, cfg: DecodeConfig, prob: _CheckProblem) -> tuple[bool, str]:
        from ..ops.decode import decode_bf16, decode_fp8, get_mla_metadata
        from ..ops.schedule import split_token_bounds

        b, s_q, h_q = len(prob.seqlens_host), bucket.s_q, bucket.h_q
        meta, splits = get_mla_metadata(prob.seqlens, bucket.rows, 1, fp8=bucket.fp8, config=cfg)
        out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=self.device)
        lse = torch.full((b, h_q, s_q), float("nan"), dtype=torch.float32, device=self.device)
        if bucket.fp8:
            decode_fp8(prob.q_rows, prob.cache, prob.table, prob.seqlens, meta, splits, prob.scale,
                       prob.causal, config=cfg, out=out, lse=lse)
        else:
            decode_bf16(prob.q, prob.cache, prob.table, prob.seqlens, meta, splits, prob.scale,
                        prob.causal, config=cfg, out=out, lse=lse)
        torch.cuda.synchronize(self.device)
        bounds = split_token_bounds(splits, meta, prob.seqlens_host) if bucket.fp8 else []
        ref_out, ref_lse = self._reference(bucket, prob, bounds)
        m_out, m_lse = compare(out, ref_out), compare(lse, ref_lse)
        if bucket.fp8:
            ok = m_out.rel_l2 <= EMUL_GATE and m_lse.max_abs < LSE_GATE
            detail = f"rel_l2 {m_out.rel_l2:.2e} vs emulation, lse max err {m_lse.max_abs:.1e}"
        else:
            ok = m_out.cos_diff <= BF16_COS_GATE and m_lse.max_abs < LSE_GATE
            detail = f"cos_diff {m_out.cos_diff:.2e} vs float64, lse max err {m_lse.max_abs:.1e}"
        return bool(ok), detail

    # timing ----------------------------------------------------------------------------------
    def prepare(self, bucket: Bucket) -> None:
        self._problems_for(bucket)  # built once per (format, h_q, s_q), outside the bucket's budget
        if self._inputs is not None and self._inputs.bucket == bucket:
            return
        self.release()
        self._inputs = self._guard(lambda: self._make_inputs(bucket))

    def release(self) -> None:
        self._inputs = None
        torch.cuda.empty_cache()

    def _make_inputs(self, bucket: Bucket) -> _TimingInputs:
        from ..numerics.quant import quantize_rows

        dev = self.device
        batch, ctx = bucket.timed_batch, bucket.timed_context
        pages = -(-ctx // PAGE_SIZE)
        set_blocks = batch * pages
        token_bytes = FP8_TOKEN_BYTES if bucket.fp8 else BF16_TOKEN_BYTES
        set_bytes = set_blocks * PAGE_SIZE * token_bytes
        copies = min(MAX_COPIES, max(1, math.ceil(L2_FACTOR * self.l2_bytes / set_bytes)))
        free, _ = torch.cuda.mem_get_info(dev)
        budget = int(free * 0.85) - (1 << 30)  # room for the split buffers and temporaries
        if set_bytes > budget:
            raise SnapmlaError(
                f"bucket {bucket.label()}: the timed cache needs {set_bytes / 2**30:.1f} GiB, "
                f"only {free / 2**30:.1f} GiB of GPU memory is free (use a smaller --batch/--ctx)")
        copies = max(1, min(copies, budget // set_bytes))
        gen = torch.Generator(device=dev).manual_seed(self.seed + 1)
        total = copies * set_blocks
        if bucket.fp8:
            cache = torch.empty(total, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8, device=dev)
            for a in range(0, total, CHUNK_BLOCKS):
                z = min(total, a + CHUNK_BLOCKS)
                view = cache[a:z]
                # E4M3 bytes 0x00..0x7E (0x7F is NaN), sane scales, small pre-scaled RoPE
                view[..., :SCALE_OFFSET] = torch.randint(0, 0x7F, (z - a, PAGE_SIZE, D_CONTENT), generator=gen,
                                                device=dev, dtype=torch.uint8)
                scale = torch.rand(z - a, PAGE_SIZE, 1, generator=gen, device=dev) * 1e-3 + 1e-3
                view[..., SCALE_OFFSET:PAD_OFFSET] = scale.view(torch.uint8)
                view[..., PAD_OFFSET:ROPE_OFFSET] = 0
                rope = (torch.randn(z - a, PAGE_SIZE, D_ROPE, generator=gen, device=dev) * 0.1).to(
                    torch.bfloat16)
                view[..., ROPE_OFFSET:] = rope.view(torch.uint8)
        else:
            cache = torch.empty(total, PAGE_SIZE, 1, D_QK, dtype=torch.bfloat16, device=dev)
            for a in range(0, total, CHUNK_BLOCKS):
                z = min(total, a + CHUNK_BLOCKS)
                cache[a:z] = (torch.randn(z - a, PAGE_SIZE, 1, D_QK, generator=gen, device=dev)
                              * 0.5).to(torch.bfloat16)
        tables = []
        for j in range(copies):
            perm = torch.randperm(set_blocks, generator=gen, device=dev) + j * set_blocks
            tables.append(perm.to(torch.int32).view(batch, pages).contiguous())
        q = (torch.randn(batch, bucket.s_q, bucket.h_q, D_QK, generator=gen, device=dev) * 0.5).to(
            torch.bfloat16)
        seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        out = torch.empty(batch, bucket.s_q, bucket.h_q, D_V, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(batch, bucket.h_q, bucket.s_q, dtype=torch.float32, device=dev)
        torch.cuda.synchronize(dev)
        return _TimingInputs(bucket, quantize_rows(q) if bucket.fp8 else q, cache, tables,
                             seqlens, out, lse)

    def time(self, bucket: Bucket, cfg: DecodeConfig, cutoff: float | None = None) -> float:
        self.prepare(bucket)
        return self._guard(lambda: self._time(bucket, cfg, cutoff))

    def _time(self, bucket: Bucket, cfg: DecodeConfig, cutoff: float | None) -> float:
        from ..ops.decode import decode_bf16, decode_fp8, get_mla_metadata

        inp = self._inputs
        assert inp is not None
        meta, splits = get_mla_metadata(inp.seqlens, bucket.rows, 1, fp8=bucket.fp8, config=cfg)
        decode = decode_fp8 if bucket.fp8 else decode_bf16
        tables = inp.tables

        def rotation() -> None:  # one call per cache copy, as an engine's step replays them
            for table in tables:
                decode(inp.q, inp.cache, table, inp.seqlens, meta, splits, None, bucket.causal,
                       config=cfg, out=inp.out, lse=inp.lse)

        rotation()  # loads the kernels outside the capture
        torch.cuda.synchronize(self.device)
        graph = capture_graph(rotation)  # its memory pool is freed with it, on return
        calls = len(tables)
        t1 = time_cuda(graph.replay, reps=1, warmup=1, rounds=1) / calls
        if cutoff is not None and t1 > cutoff:
            return t1  # clearly slower than the best so far: one replay tells enough
        return time_cuda(graph.replay, reps=MAX_REPLAYS, warmup=1, clocks=self.clocks) / calls
