"""Where a decode call's time goes beyond its pages, per shape, for the default FP8 path:

1. the call as a CUDA graph replayed back to back (as bench_decode.py times it) and, from the
   profiler's timeline of the replays, the decode kernel's duration, how long the combine runs
   on after the decode grid ends (it is launched programmatically, so it starts early and waits),
   and the gap between two replays;
2. the kernel rebuilt with ``CTA_TIMES=1`` (kernels/decode_fp8_wgmma.cu: each CTA's consumers
   store %globaltimer when they start their first work item and end their last, the SM and the
   pages): the launch skew, the spread of the CTAs' end times (imbalance) and the time per page.

    python3 scripts/cta_times.py --heads 16,32,64 --ctx 16384,131072
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from trace_decode import loaded_globals, read_global  # this folder is sys.path[0]

from snapmla_cli.bench.decode_case import DecodeCall, DecodeCase, extra_defines
from snapmla_cli.bench.roofline import DecodeWork
from snapmla_cli.bench.timing import BURST, capture_graph, time_graph, warm_up

SYMBOL = "snapmla_cta_times"
MAX_CTAS = 4096  # kMaxTimedCtas of the kernel
FIELDS = 4  # start ns, end ns, SM, pages
PROFILED_REPLAYS = 10
BURST_WARMUP_CALLS = 3  # as bench timing's warm-up
DECODE_KERNEL, COMBINE_KERNEL = "snapmla_decode_fp8", "snapmla_combine"


def clear_times() -> None:
    """Zero the times of every loaded build (the next read then finds this call's build)."""
    import cupy

    for ptr in loaded_globals(SYMBOL):
        cupy.cuda.runtime.memset(ptr, 0, MAX_CTAS * FIELDS * 8)


def replay_timeline(call: DecodeCall) -> str:
    """The decode kernel's duration, the combine's run-on after it and the gap to the next
    replay (medians over the profiled replays of the call's graph, us)."""
    graph = capture_graph(call)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    del graph
    decode = sorted((e for e in events if e["name"].startswith(DECODE_KERNEL)), key=lambda e: e["ts"])
    combine = sorted((e for e in events if e["name"].startswith(COMBINE_KERNEL)), key=lambda e: e["ts"])
    if not decode or len(combine) != len(decode):
        return "timeline: no decode / combine pairs (one split per request: no combine)"
    end = [d["ts"] + d["dur"] for d in decode]
    run_on = [c["ts"] + c["dur"] - e for c, e in zip(combine, end)]
    gaps = [decode[i + 1]["ts"] - (combine[i]["ts"] + combine[i]["dur"]) for i in range(len(decode) - 1)]
    return (f"decode kernel {statistics.median(d['dur'] for d in decode):.1f} us, combine runs on "
            f"{statistics.median(run_on):.1f} us after it, gap to the next replay {statistics.median(gaps):.1f} us")


def cta_spread(call: DecodeCall) -> str:
    """The CTA_TIMES build's launch skew, end-time spread and time per page."""
    with extra_defines({"CTA_TIMES": 1}):
        warm_up(call, BURST_WARMUP_CALLS, BURST.warmup_s)  # compiles the diagnostic build, warms the clocks
        clear_times()
        call()
        torch.cuda.synchronize()
    times = read_global(SYMBOL, (MAX_CTAS, FIELDS), "cta_times: no CTA times: the default path did not run "
                                                    "the FP8 wgmma kernel")
    used = times[times[:, 0] > 0]
    start, end, pages = used[:, 0], used[:, 1], used[:, 3]
    t0 = start.min()
    ends = np.percentile((end - t0) / 1e3, [0, 10, 50, 90, 100])
    per_page = (end - start) / np.maximum(pages, 1) / 1e3
    return (f"{len(used)} CTAs on {len(np.unique(used[:, 2]))} SMs, pages {pages.min()}-{pages.max()}; start skew "
            f"{(start.max() - t0) / 1e3:.1f} us; ends from the first start min/p10/p50/p90/max "
            + "/".join(f"{e:.1f}" for e in ends) + f" us; us per page median {np.median(per_page):.3f}")


def report(w: DecodeWork, device: torch.device, copy_bandwidth: float) -> None:
    case = DecodeCase.build([w.context] * w.batch, w.s_q, w.h_q, device)
    call = case.fp8()
    t_call = time_graph(call, clocks=BURST)
    roof_us = w.bytes(True) / copy_bandwidth * 1e6
    print(f"cta_times h{w.h_q} s{w.s_q} ctx{w.context} b{w.batch}: graph replay {t_call * 1e6:.1f} us "
          f"(memory roofline {roof_us:.1f} us); {replay_timeline(call)}; {cta_spread(call)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", default="16,32,64")
    ap.add_argument("--mtp", default="1")
    ap.add_argument("--ctx", default="16384")
    ap.add_argument("--copy-tbs", type=float, default=4.26, help="copy ceiling (TB/s) for the roofline column")
    args = ap.parse_args()
    device = torch.device("cuda")
    for h in map(int, args.heads.split(",")):
        for s in map(int, args.mtp.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                report(DecodeWork(args.batch, s, h, ctx), device, args.copy_tbs * 1e12)


if __name__ == "__main__":
    main()
