"""Prep-kernel benchmark (issue 3): GB/s of Q-quant, K-append and the fetch-dequant variants at
large n, the decode-step cost of append + Q-quant (eager and in CUDA graphs), device-to-device
copy bandwidth measured in the same run (the ceiling these memory-bound kernels are judged
against), and NVRTC cold / warm compile times of every registered kernel. Prints tables;
``--json PATH`` saves the numbers.

Kernel times come from CUDA-graph replays of several back-to-back calls, with the GPU held busy
(``torch.cuda._sleep``) while the host submits, so they are GPU time only: timing one eager call
between two events also counts the Python argument checks and the launch whenever they take
longer than the GPU work before them (tens of microseconds per call before the host-path rewrite,
which made small and medium calls look slow).

    python scripts/bench_prep.py [--tokens 1048576] [--q-rows 65536,262144] [--sweep]
                                 [--json out/prep.json]
    python scripts/bench_prep.py --host-only    # no GPU needed: the Python path alone
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python scripts/bench_prep.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapmla_cli.bench.timing import time_cuda
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.formats import D_CONTENT, D_QK, D_ROPE, FP8_TOKEN_BYTES, PAGE_SIZE
from snapmla_cli.ops.prep import (
    append_kv,
    fetch_dequant,
    fetch_dequant_slots,
    fetch_dequant_soa,
    quantize_q,
)
from snapmla_cli.runtime import kernel_cache, launch, nvrtc
from snapmla_cli.runtime.registry import PREP_DEFINES, PREP_SOURCE, compile_all

COPY_BYTES = 2 << 30  # 2 GiB source, as in the decode benchmark's ceiling
BF16_ROW = D_QK * 2
Q_OUT_ROW = D_CONTENT + 4 + D_ROPE * 2  # content + scale + rope
SOA_ROW = D_CONTENT + 4 + D_ROPE * 2
SLOT = 4
DECODE_BATCH = 64
DECODE_HEADS = 128
SLEEP_CYCLES = 200_000  # ~100 us of GPU spin before each timed replay (hides the submission)
# (warps per CTA, rows per warp, content lane map) compiled and timed by --sweep; the first is
# the shipped default (PREP_DEFINES). Map 1 = strided loads + one 16-byte content store per lane.
SWEEP = ((8, 2, 0), (8, 2, 1), (4, 2, 0), (8, 1, 0), (4, 1, 0), (16, 2, 0), (8, 4, 0))


@dataclass
class Row:
    name: str
    n: int
    us: float
    bytes: int
    gbs: float
    copy_pct: float


# ---------------------------------------------------------------- timing


def graph_time(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Seconds per call of ``fn``: ``calls`` back-to-back calls captured in one CUDA graph, the
    median over ``replays`` replays, each started while the GPU is still busy with a spin kernel
    so that neither the replay's submission nor any host work is in the interval."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: compiles and loads the kernels
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    torch.cuda.synchronize()
    return statistics.median(times)


def calls_for(nbytes: int) -> int:
    """Calls per captured graph: ~0.5 GB of traffic per graph, at least 2, at most 50."""
    return max(2, min(50, (512 << 20) // max(nbytes, 1)))


def measure(
    name: str, n: int, nbytes: int, fn: Callable[[], object], copy_gbs: float, reps: int
) -> Row:
    t = graph_time(fn, calls_for(nbytes), reps)
    gbs = nbytes / t / 1e9
    return Row(name, n, t * 1e6, nbytes, gbs, 100.0 * gbs / copy_gbs)


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """GB/s of a 2 GiB device-to-device copy (``copy_``), counting bytes read + written, timed
    eagerly like :func:`snapmla_cli.bench.ceilings.measure_ceilings` (inside a CUDA graph the
    copy becomes a memcpy node that ran at 2.77 TB/s on the H200, against 4.24 TB/s eagerly)."""
    from snapmla_cli.bench.timing import time_cuda

    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), reps=max(reps, 4))
    return 2.0 * COPY_BYTES / t / 1e9


def compile_times() -> dict[str, float]:
    """Cold: empty disk cache, nothing in memory. Warm: the disk cache only (a new process)."""
    saved = os.environ.get(kernel_cache.CACHE_DIR_ENV)
    with tempfile.TemporaryDirectory() as folder:
        os.environ[kernel_cache.CACHE_DIR_ENV] = folder
        try:
            nvrtc.clear_memory_cache()
            t0 = time.perf_counter()
            modules = compile_all()
            cold = time.perf_counter() - t0
            nvrtc.clear_memory_cache()
            t0 = time.perf_counter()
            compile_all()
            warm = time.perf_counter() - t0
        finally:
            if saved is None:
                os.environ.pop(kernel_cache.CACHE_DIR_ENV, None)
            else:
                os.environ[kernel_cache.CACHE_DIR_ENV] = saved
            nvrtc.clear_memory_cache()
    return {"cold_s": cold, "warm_s": warm, "modules": len(modules)}


# ---------------------------------------------------------------- workloads


def bf16_rows(n: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, D_QK, device=device, generator=g).to(torch.bfloat16)


def paged_slots(tokens: int, blocks: int, device: torch.device, mode: str) -> torch.Tensor:
    """int32 slots: ``random`` (a random permutation of all slots: every token alone in its
    sectors), ``pages`` (random pages, 64 consecutive tokens each: prefill), ``sequential``."""
    g = torch.Generator(device=device).manual_seed(3)
    if mode == "random":
        return torch.randperm(blocks * PAGE_SIZE, device=device, generator=g)[:tokens].int()
    t = torch.arange(tokens, device=device, dtype=torch.int64)
    if mode == "pages":
        pages = torch.randperm(blocks, device=device, generator=g)
        return (pages[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE).int()
    return t.int()


def bench_quantize_q(device: torch.device, rows: int, copy_gbs: float, reps: int) -> Row:
    q = bf16_rows(rows, device, 0)
    return measure(
        "quantize_q", rows, rows * (BF16_ROW + Q_OUT_ROW), lambda: quantize_q(q), copy_gbs, reps
    )


def bench_paged(device: torch.device, tokens: int, copy_gbs: float, reps: int) -> list[Row]:
    """append_kv (random slots, random pages, sequential), then the paged and slot-list
    dequant of the same cache."""
    blocks = -(-tokens // PAGE_SIZE)
    kv = bf16_rows(tokens, device, 1)
    cache = torch.zeros(blocks, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8, device=device)
    append_bytes = tokens * (BF16_ROW + SLOT + FP8_TOKEN_BYTES)
    rows = []
    modes = (("random", "random slots"), ("pages", "random pages"), ("sequential", "sequential"))
    for mode, label in modes:
        slots = paged_slots(tokens, blocks, device, mode)
        rows.append(
            measure(
                f"append_kv ({label})",
                tokens,
                append_bytes,
                functools.partial(append_kv, kv, slots, cache),
                copy_gbs,
                reps,
            )
        )
    g = torch.Generator(device=device).manual_seed(1)
    batch = 16
    per_req = tokens // batch
    pages = -(-per_req // PAGE_SIZE)
    table = torch.randperm(blocks, device=device, generator=g)[: batch * pages].to(torch.int32)
    table = table.view(batch, pages)
    lens = torch.full((batch,), per_req, dtype=torch.int32, device=device)
    total = batch * per_req
    rows.append(
        measure(
            "fetch_dequant (paged)",
            total,
            total * (FP8_TOKEN_BYTES + BF16_ROW),
            lambda: fetch_dequant(cache, table, lens, total_tokens=total),
            copy_gbs,
            reps,
        )
    )
    perm = paged_slots(tokens, blocks, device, "random")
    rows.append(
        measure(
            "fetch_dequant_slots",
            tokens,
            tokens * (FP8_TOKEN_BYTES + SLOT + BF16_ROW),
            lambda: fetch_dequant_slots(cache, perm),
            copy_gbs,
            reps,
        )
    )
    return rows


def bench_soa(device: torch.device, tokens: int, copy_gbs: float, reps: int) -> Row:
    g = torch.Generator(device=device).manual_seed(2)
    content = torch.randint(
        0, 0x7E, (tokens, D_CONTENT), dtype=torch.uint8, device=device, generator=g
    )
    scale = torch.rand(tokens, device=device, generator=g)
    rope = torch.randn(tokens, D_ROPE, device=device, generator=g).to(torch.bfloat16)
    slots = torch.randperm(tokens, device=device, generator=g).to(torch.int32)
    return measure(
        "fetch_dequant_soa",
        tokens,
        tokens * (SOA_ROW + SLOT + BF16_ROW),
        lambda: fetch_dequant_soa(content, scale, rope, slots),
        copy_gbs,
        reps,
    )


def bench_decode_step(device: torch.device, reps: int) -> dict[str, float]:
    """One decode step of b=64, s_q=1, h_q=128: append the 64 new tokens, quantize the queries.

    - ``*_single_us``: one eager call between two events, synchronised each time (the method of
      the first measurement: host path + launch latency + kernel);
    - ``*_host_us``: wall time per call of 2000 back-to-back eager calls (host-bound: the Python
      path plus the CuPy launch);
    - ``graph_replay_us``: one step captured in a CUDA graph, replayed back to back (what an
      engine's per-step graph launch costs at most from these two ops);
    - ``graph_gpu_us``: GPU time per step, 20 steps captured in one graph.
    """
    g = torch.Generator(device=device).manual_seed(1)
    kv = torch.randn(DECODE_BATCH, D_QK, device=device, generator=g).to(torch.bfloat16)
    q = torch.randn(DECODE_BATCH, 1, DECODE_HEADS, D_QK, device=device, generator=g)
    q = q.to(torch.bfloat16)
    cache = torch.zeros(
        DECODE_BATCH * 4, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8, device=device
    )
    slots = (torch.arange(DECODE_BATCH, device=device, dtype=torch.int32) * 4 + 3) * PAGE_SIZE
    q_out = quantize_q(q)

    def step() -> None:
        append_kv(kv, slots, cache)
        quantize_q(q)

    calls = {
        "append_kv": lambda: append_kv(kv, slots, cache),
        "quantize_q": lambda: quantize_q(q),
        "quantize_q_out": lambda: quantize_q(q, out=q_out),
        "step": step,
    }
    result: dict[str, float] = {}
    for name, fn in calls.items():
        result[f"{name}_single_us"] = time_cuda(fn, reps=reps * 5, warmup=5) * 1e6
        result[f"{name}_host_us"] = host_time(fn, 2000) * 1e6
    result["graph_gpu_us"] = graph_time(step, 20, reps) * 1e6
    result["graph_gpu_append_us"] = graph_time(calls["append_kv"], 20, reps) * 1e6
    result["graph_gpu_quantize_q_us"] = graph_time(calls["quantize_q"], 20, reps) * 1e6
    result["graph_replay_us"] = graph_replay_time(step, 1000) * 1e6
    return result


def host_time(fn: Callable[[], object], calls: int) -> float:
    """Wall seconds per call of ``calls`` back-to-back eager calls (then one sync)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def graph_replay_time(fn: Callable[[], object], replays: int) -> float:
    """Seconds per replay of a graph holding one call of ``fn``, replayed back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


# ---------------------------------------------------------------- launch-geometry sweep


def bench_sweep(
    device: torch.device, tokens: int, q_rows: int, copy_gbs: float, reps: int
) -> list[dict[str, object]]:
    """Each (warps per CTA, rows per warp, content map) of SWEEP compiled and timed on the raw
    kernels: Q-quant, append (random slots and sequential), slot-list and paged dequant."""
    from snapmla_cli.runtime.launch import get_kernel, i32, i64
    from snapmla_cli.runtime.launch import launch as raw_launch

    q = bf16_rows(q_rows, device, 0)
    content = torch.empty(q_rows, D_CONTENT, dtype=torch.uint8, device=device)
    scale = torch.empty(q_rows, dtype=torch.float32, device=device)
    rope = torch.empty(q_rows, D_ROPE, dtype=torch.bfloat16, device=device)
    blocks = -(-tokens // PAGE_SIZE)
    kv = bf16_rows(tokens, device, 1)
    cache = torch.zeros(blocks, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8, device=device)
    rand = paged_slots(tokens, blocks, device, "random")
    seq = paged_slots(tokens, blocks, device, "sequential")
    out = torch.empty(tokens, D_QK, dtype=torch.bfloat16, device=device)
    table = torch.arange(blocks, dtype=torch.int32, device=device).view(1, blocks)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    append_bytes = tokens * (BF16_ROW + SLOT + FP8_TOKEN_BYTES)
    fetch_bytes = tokens * (FP8_TOKEN_BYTES + SLOT + BF16_ROW)
    results = []
    for warps, rows_per_warp, content_map in SWEEP:
        defines = {
            "PREP_WARPS_PER_CTA": warps,
            "PREP_ROWS_PER_WARP": rows_per_warp,
            "PREP_CONTENT_MAP": content_map,
        }
        per_cta = warps * rows_per_warp
        threads = 32 * warps

        def run(name: str, n: int, args: list[object], defines: dict[str, int] = defines,
                per_cta: int = per_cta, threads: int = threads) -> Callable[[], None]:
            kernel = get_kernel(PREP_SOURCE, name, defines, device=device)
            grid = max(1, min(-(-n // per_cta), 1 << 18))
            return lambda: raw_launch(kernel, grid, threads, args)

        cases = {
            "quantize_q": (
                q_rows * (BF16_ROW + Q_OUT_ROW),
                run("snapmla_quantize_q", q_rows, [q, content, scale, rope, i64(q_rows)]),
            ),
            "append_random": (
                append_bytes,
                run("snapmla_append_kv", tokens, [kv, rand, i64(tokens), cache, i64(blocks * 64)]),
            ),
            "append_sequential": (
                append_bytes,
                run("snapmla_append_kv", tokens, [kv, seq, i64(tokens), cache, i64(blocks * 64)]),
            ),
            "fetch_slots": (
                fetch_bytes,
                run("snapmla_fetch_dequant_slots", tokens,
                    [cache, i64(blocks * 64), rand, i64(tokens), out]),
            ),
            "fetch_paged": (
                tokens * (FP8_TOKEN_BYTES + BF16_ROW),
                run("snapmla_fetch_dequant_paged", tokens,
                    [cache, i64(blocks * 64), table, i32(blocks), cu, i32(1), out, i64(tokens)]),
            ),
        }
        entry: dict[str, object] = {
            "warps": warps,
            "rows_per_warp": rows_per_warp,
            "content_map": content_map,
        }
        for name, (nbytes, fn) in cases.items():
            t = graph_time(fn, calls_for(nbytes), reps)
            entry[name] = round(100.0 * nbytes / t / 1e9 / copy_gbs, 1)
        results.append(entry)
    return results


# ---------------------------------------------------------------- host path (no GPU)


def bench_host_only(calls: int) -> dict[str, float]:
    """The Python cost of append_kv / quantize_q on decode-step shapes, on this machine's CPU,
    without a GPU: the CUDA branches run on CPU tensors (argument checks, plan lookup, output
    allocation, launch-argument marshaling) and the launch stops before CuPy (the CuPy call and
    the driver's cuLaunchKernel, a few microseconds more on a GPU host, are not included)."""
    from snapmla_cli.ops import prep

    def noop(*args: object, **kwargs: object) -> None:  # the CuPy function stand-in
        return None

    for handle in prep._KERNELS.values():
        handle._functions[-1] = noop
    saved = launch.current_raw_stream, launch.current_device_index
    launch.current_raw_stream = lambda index: 0
    launch.current_device_index = lambda: -1
    try:
        q = torch.zeros(DECODE_BATCH, 1, DECODE_HEADS, D_QK, dtype=torch.bfloat16)
        kv = torch.zeros(DECODE_BATCH, D_QK, dtype=torch.bfloat16)
        slots = torch.arange(DECODE_BATCH, dtype=torch.int32)
        slots64 = slots.long()
        cache = torch.zeros(DECODE_BATCH * 4, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
        q_out = prep._quantize_q_cuda(q)

        def per_call(fn: Callable[[], object]) -> float:
            fn()
            return min(timeit.repeat(fn, number=calls, repeat=9)) / calls * 1e6

        # the public functions' dispatch test (`type(x) is torch.Tensor and x.is_cuda`) included
        return {
            "quantize_q_us": per_call(
                lambda: (type(q) is torch.Tensor and q.is_cuda, prep._quantize_q_cuda(q))
            ),
            "quantize_q_out_us": per_call(
                lambda: (type(q) is torch.Tensor and q.is_cuda, prep._quantize_q_cuda(q, q_out))
            ),
            "append_kv_us": per_call(
                lambda: (type(kv) is torch.Tensor and kv.is_cuda,
                         prep._append_kv_cuda(kv, slots, cache))
            ),
            "append_kv_int64_slots_us": per_call(
                lambda: (type(kv) is torch.Tensor and kv.is_cuda,
                         prep._append_kv_cuda(kv, slots64, cache))
            ),
        }
    finally:
        launch.current_raw_stream, launch.current_device_index = saved
        for handle in prep._KERNELS.values():
            handle._functions.pop(-1, None)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens for append / dequant")
    ap.add_argument(
        "--q-rows", default="65536,262144", help="query-row counts for Q-quant (comma-separated)"
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--skip-compile", action="store_true", help="skip the cold/warm compile timing")
    ap.add_argument("--sweep", action="store_true", help="also time the launch-geometry variants")
    ap.add_argument(
        "--host-only", action="store_true", help="CPU only: the Python path of the decode-step ops"
    )
    args = ap.parse_args(argv)
    q_rows = [int(x) for x in str(args.q_rows).split(",") if x]

    if args.host_only:
        host = bench_host_only(20000)
        print("host path per call on this CPU (no GPU; CuPy launch + driver not included):")
        for name, us in host.items():
            print(f"  {name:<26} {us:6.2f} us")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"host_only": host}, indent=1))
        return 0

    try:
        launch.require_gpu()
    except SnapmlaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    compile_info = {} if args.skip_compile else compile_times()
    copy_gbs = copy_bandwidth(device, args.reps)
    rows = [bench_quantize_q(device, n, copy_gbs, args.reps) for n in q_rows]
    rows += bench_paged(device, args.tokens, copy_gbs, args.reps)
    rows.append(bench_soa(device, args.tokens, copy_gbs, args.reps))
    step = bench_decode_step(device, args.reps)
    sweep = bench_sweep(device, args.tokens, max(q_rows), copy_gbs, args.reps) if args.sweep else []

    name = torch.cuda.get_device_name(device)
    print(f"{name}: device-to-device copy {copy_gbs:.0f} GB/s (2 GiB copy_, read + write)")
    print(f"prep defines {PREP_DEFINES}; kernel times: CUDA-graph replays, GPU time only")
    print(f"{'kernel':<28} {'n':>9} {'time us':>10} {'GB/s':>8} {'% copy':>7}")
    for r in rows:
        print(f"{r.name:<28} {r.n:>9} {r.us:>10.1f} {r.gbs:>8.0f} {r.copy_pct:>6.1f}%")
    print(f"decode step b={DECODE_BATCH} s_q=1 h_q={DECODE_HEADS} (us per call):")
    print(f"  {'call':<16} {'single (event)':>15} {'host, back-to-back':>19}")
    for call in ("append_kv", "quantize_q", "quantize_q_out", "step"):
        print(
            f"  {call:<16} {step[f'{call}_single_us']:>15.1f} {step[f'{call}_host_us']:>19.1f}"
        )
    print(
        f"  CUDA graph of one step (append_kv + quantize_q): replay {step['graph_replay_us']:.1f}"
        f" us per step back to back; GPU time {step['graph_gpu_us']:.1f} us per step"
        f" (append {step['graph_gpu_append_us']:.1f}, quantize_q"
        f" {step['graph_gpu_quantize_q_us']:.1f})"
    )
    if sweep:
        keys = ("warps", "rows_per_warp", "content_map")
        cols = [k for k in sweep[0] if k not in keys]
        print("launch-geometry sweep, % of copy bandwidth (raw kernels, CUDA graphs):")
        print(f"  {'warps x rows, map':<18}" + "".join(f"{c:>18}" for c in cols))
        for e in sweep:
            label = f"{e['warps']} x {e['rows_per_warp']}, {e['content_map']}"
            print(f"  {label:<18}" + "".join(f"{e[c]:>17.1f}%" for c in cols))
    if compile_info:
        print(
            f"compile {compile_info['modules']} modules: cold {compile_info['cold_s']:.2f} s, "
            f"warm (disk cache) {compile_info['warm_s'] * 1e3:.1f} ms"
        )

    if args.json is not None:
        result = {
            "device": name,
            "copy_gbs": copy_gbs,
            "defines": PREP_DEFINES,
            "kernels": [asdict(r) for r in rows],
            "decode_step": step,
            "sweep": sweep,
            "compile": compile_info,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
