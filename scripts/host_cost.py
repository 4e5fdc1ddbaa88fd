"""The host's cost of an eager decode call (no CUDA graph): an engine that launches the decode
per layer from Python pays it on every layer of every step.

For each shape and call: the wall time per call of `calls` eager calls back to back, the same
with programmatic launch off (``SNAPMLA_PDL=0``), the host's time to issue them while the GPU is
held busy by a spin kernel queued first (the Python path and the driver's launch, nothing the GPU
does), the GPU time of the call replayed from a CUDA graph, and a cProfile of the eager decode
calls (the top functions by own time land in ``--profile-dir``):

    python3 scripts/host_cost.py --heads 16,128 --batch 1,64 --profile-dir OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_prep import host_time  # this folder is sys.path[0]

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import time_graph
from snapmla_cli.numerics.formats import D_QK, D_V, PAGE_SIZE
from snapmla_cli.ops.decode import decode_fp8, flash_mla_with_kvcache, get_mla_metadata
from snapmla_cli.ops.prep import append_kv, quantize_q

CALLS = 400
# calls issued behind the spin: at most three launches each, and the driver's launch queue
# (about a thousand entries) must not fill, or the issuing waits for the GPU
ISSUE_CALLS = 100
SPIN_CYCLES_PER_CALL = 1_000_000  # 0.5 ms at 2 GHz: more than any call's host path
PROFILE_LINES = 25


def issue_per_call(fn: Callable[[], object], calls: int) -> float:
    """Host seconds per call to issue `calls` calls behind a spin kernel long enough that the GPU
    starts none of them before the last is issued."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES_PER_CALL * calls)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls


def profile_text(fn: Callable[[], object], calls: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(PROFILE_LINES)
    return out.getvalue()


def measure_shape(b: int, h: int, ctx: int, device: torch.device, profile_dir: Path | None) -> None:
    """Print the eager and graph times of one shape's calls; profile its eager decode."""
    case = DecodeCase.build([ctx] * b, 1, h, device)
    meta, splits = get_mla_metadata(case.lens, case.rows, 1, fp8=True)

    def decode_only() -> None:
        decode_fp8(case.q8, case.cache8, case.table, case.lens, meta, splits, None, True)

    def quantize_and_decode() -> None:
        decode_fp8(quantize_q(case.q), case.cache8, case.table, case.lens, meta, splits, None, True)

    def flash_mla() -> None:
        """The same through flash_mla_with_kvcache: its fused plan after the first call."""
        flash_mla_with_kvcache(case.q, case.cache8, case.table, case.lens, D_V, meta, splits, None, True)

    growing = case.lens + torch.randint(-ctx // 2, ctx // 2, case.lens.shape, device=device, dtype=torch.int32)

    def metadata_of_a_step() -> None:
        """As in a decode loop: every length one longer than at the last step (so the planner's
        caches keyed by pages per request miss whenever a request starts a page)."""
        growing.add_(1)
        get_mla_metadata(growing, case.rows, 1, fp8=True)

    growing_on_host = growing.cpu()

    def metadata_of_a_step_from_the_host() -> None:
        """The same, with the engine's lengths on the host (no read from the GPU)."""
        growing_on_host.add_(1)
        get_mla_metadata(growing_on_host, case.rows, 1, fp8=True, device=device)

    new_kv = torch.randn(b, D_QK, device=device).to(torch.bfloat16)
    slots = torch.arange(b, dtype=torch.int32, device=device) * PAGE_SIZE  # (any valid slots: timing only)

    cases = {"decode_fp8 (metadata given)": decode_only, "quantize_q + decode_fp8": quantize_and_decode,
             "flash_mla_with_kvcache (fused)": flash_mla,
             "quantize_q": lambda: quantize_q(case.q),
             "append_kv": lambda: append_kv(new_kv, slots, case.cache8),
             "get_mla_metadata": lambda: get_mla_metadata(case.lens, case.rows, 1, fp8=True),
             "get_mla_metadata (lengths growing)": metadata_of_a_step,
             "get_mla_metadata (host lengths growing)": metadata_of_a_step_from_the_host}
    for name, fn in cases.items():
        wall = host_time(fn, CALLS)
        if name.startswith("get_mla_metadata"):  # it plans on the host: no graph, no queue
            print(f"b{b} h{h} {ctx // 1024}k {name}: eager {wall * 1e6:.1f} us per call", flush=True)
            continue
        os.environ["SNAPMLA_PDL"] = "0"
        try:
            wall_plain = host_time(fn, CALLS)
        finally:
            del os.environ["SNAPMLA_PDL"]
        issue = issue_per_call(fn, ISSUE_CALLS)
        print(f"b{b} h{h} {ctx // 1024}k {name}: eager {wall * 1e6:.1f} us per call (PDL off {wall_plain * 1e6:.1f}), "
              f"host issue {issue * 1e6:.1f} us, graph replay {time_graph(fn) * 1e6:.1f} us", flush=True)
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
        (profile_dir / f"host_profile_b{b}_h{h}.txt").write_text(profile_text(decode_only, CALLS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--profile-dir", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    for b in map(int, args.batch.split(",")):
        for h in map(int, args.heads.split(",")):
            measure_shape(b, h, args.ctx, device, args.profile_dir)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
