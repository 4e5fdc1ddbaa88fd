"""What ``SNAPMLA_CHECK_FINITE`` costs an eager decode loop: the same FP8 decode calls
(``flash_mla_with_kvcache``, Q-quant included) back to back with the checks off and on, wall
time per call from the host (the checks read a reduction back, so each call then waits for the
GPU). Usage: ``python3 scripts/finite_check_cost.py [--batch 64] [--heads 16,128] [--ctx 16384]``."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from snapmla_cli.numerics.problem import random_problem
from snapmla_cli.ops.decode import flash_mla_with_kvcache, get_mla_metadata
from snapmla_cli.ops.finite import set_gpu_checks


def per_call_us(step: Callable[[], object], calls: int) -> float:
    """Median over 5 rounds of the wall time of ``calls`` calls back to back, per call."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    for h_q in (int(h) for h in args.heads.split(",")):
        measure(args.batch, h_q, args.ctx, args.calls)


def measure(batch: int, h_q: int, ctx: int, calls: int) -> None:
    """Print one shape's per-call time with the checks off and on (best of two alternations)."""
    prob = random_problem([ctx] * batch, 1, h_q, seed=3)
    cache = prob.fp8_cache().to("cuda")
    q = prob.q.to("cuda")
    table, seqlens = prob.layout.block_table.to("cuda"), prob.layout.cache_seqlens.to("cuda")
    meta, splits = get_mla_metadata(seqlens, h_q, 1)

    def step() -> None:
        flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, splits, prob.softmax_scale)

    times: dict[bool, list[float]] = {}
    for on in (False, True, False, True):
        set_gpu_checks(on)
        step()
        times.setdefault(on, []).append(per_call_us(step, calls))
    set_gpu_checks(False)
    off, on_us = min(times[False]), min(times[True])
    print(f"finite_check_cost b{batch} h{h_q} s1 {ctx} | checks off {off:.1f} us/call, "
          f"on {on_us:.1f} us/call ({on_us - off:+.1f} us, {on_us / off:.2f}x)")

if __name__ == "__main__":
    main()
