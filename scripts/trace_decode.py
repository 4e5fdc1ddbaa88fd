"""Per-phase timeline of the wgmma decode kernel's alternate-pages loop (WG_MODE 3 and 4).

Builds the kernel with ``TRACE_PHASES=1`` (kernels/decode_fp8_wgmma.cu: CTA (0, 0) stores
``clock64()`` at each phase boundary of every warpgroup turn), runs profile_decode.py's decode
call on a benchmark shape and prints, per turn of two pages, the cycles spent waiting for the
page's bytes, in QK, waiting for the other warpgroup's row state, the softmax in five parts and
the two PVs (with paired PVs the pair's cycles go to "pv other"), then the medians of the
steady-state turns and the SM clock (cycles over %globaltimer) during them. The softmax parts:
mode 3 (sm1-sm5): the warps' block statistics, the first warpgroup barrier, the rows' state,
the second barrier (none with the per-warp row state), P^T and its hand-over; rows = M: block
max, block max of e s_k, the rows' state, P^T, the hand-over. A diagnostic: its stores sit in
the chains it times, so the trace build is slower than the real one; read phases against each
other (see docs/PERF.md, "Softmax latency, ablations, timeline" and the eleventh session).

``--clocks burst`` traces a call made after the benchmarks' burst procedure (1 s idle, 10 ms of
warm-up calls), so that the SM clock it prints is the one the tables' times are taken at; by
default the traced call follows the data generation and the compiling call at once.

    python3 scripts/trace_decode.py --heads 64 --mtp 1 --ctx 32768 [--config 3:4:1:4:1:1:1:4] [--define PV_PAIRS=0] [--clocks burst]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator

import numpy as np
from ab_defines import parse_defines  # this folder is sys.path[0]
from profile_decode import add_shape_args, run_decode

from snapmla_cli.bench.decode_case import extra_defines
from snapmla_cli.bench.timing import BURST, settle
from snapmla_cli.runtime import launch

TRACE_SYMBOL = "snapmla_phase_trace"
TURNS, POINTS = 64, 11  # kTraceTurns, kTracePoints of the kernel
TIMER_SYMBOL = "snapmla_phase_ns"
PHASES = ("data", "qk", "wait", "sm1", "sm2", "sm3", "sm4", "sm5", "pv other", "pv own")
WARMUP_TURNS = 4  # the pipeline fills during the first turns

def loaded_globals(symbol: str) -> Iterator[int]:
    """Device addresses of the global ``symbol`` in every loaded kernel module that defines it
    (a diagnostic build exports it; the other builds do not)."""
    import cupy

    for module in launch._MODULES.values():
        try:
            ptr = module.get_global_var(symbol)
        except cupy.cuda.driver.CUDADriverError:
            continue
        yield ptr


def read_global(symbol: str, shape: tuple[int, ...],
                missing: str = "trace_decode: nothing traced: the configuration is not an alternate-pages "
                               "one (WG_MODE 3 or 4), or CTA (0, 0) had no pages") -> np.ndarray:
    """The int64 device global ``symbol`` of the loaded module that has a non-zero one (else
    exits with ``missing``)."""
    import cupy

    for ptr in loaded_globals(symbol):
        host = np.zeros(shape, np.int64)
        cupy.cuda.runtime.memcpy(host.ctypes.data, ptr, host.nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
        if host.any():
            return host
    raise SystemExit(missing)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--define", default="", help="further kernel defines, NAME=V,... (an A/B switch's phases)")
    ap.add_argument("--clocks", choices=("plain", "burst"), default="plain",
                    help="burst: trace a call made after the benchmarks' idle pause and short warm-up")
    ap.set_defaults(heads=64)
    args = ap.parse_args()
    with extra_defines({**parse_defines(args.define), "TRACE_PHASES": 1}):
        step = run_decode(args)  # every call rewrites the trace: the last one's is read
        if args.clocks == "burst":
            import torch

            settle(step, 1, BURST)
            step()
            torch.cuda.synchronize()
    trace = read_global(TRACE_SYMBOL, (2, TURNS, POINTS))  # [warpgroup, turn, point] cycles
    turn_ns = read_global(TIMER_SYMBOL, (2, TURNS))           # %globaltimer at each turn start
    start = trace[0, 0, 0]
    steady: dict[str, list[int]] = {name: [] for name in PHASES}
    print("turn wg | start cycle | " + " ".join(f"{name:>8s}" for name in PHASES))
    for turn in range(TURNS):
        for wg in range(2):
            points = trace[wg, turn]
            if not points.any():
                continue
            spans = np.diff(points)
            print(f"{2 * turn + wg:4d} {wg:2d} | {points[0] - start:11d} | " + " ".join(f"{s:8d}" for s in spans))
            # a turn without a page of its own (the last) records no QK or softmax points
            if turn >= WARMUP_TURNS and points.all():
                for name, span in zip(PHASES, spans):
                    steady[name].append(int(span))
    if steady["qk"]:
        medians = {name: statistics.median(v) for name, v in steady.items()}
        print("median cycles per turn (two pages) from turn", 2 * WARMUP_TURNS, ": " +
              ", ".join(f"{name} {m:.0f}" for name, m in medians.items()) + f"; total {sum(medians.values()):.0f}")
    traced = np.nonzero(turn_ns[0])[0]
    first, last = WARMUP_TURNS, int(traced[-1]) if traced.size else 0
    if last > first:
        cycles = trace[0, last, 0] - trace[0, first, 0]
        ns = turn_ns[0, last] - turn_ns[0, first]
        print(f"SM clock over turns {first}-{last}: {cycles / ns * 1e3:.0f} MHz; "
              f"{cycles / (2 * (last - first)):.0f} cycles, {ns / (2 * (last - first)):.0f} ns per page")


if __name__ == "__main__":
    main()
