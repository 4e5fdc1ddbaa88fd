"""Where a decode call's time goes beyond its pages, per shape, for the default FP8 path:

1. the call as a CUDA graph replayed back to back (as bench_decode.py times it) and, from the
   profiler's timeline of the replays, the decode kernel's duration, how long the combine runs
   on after the decode grid ends (it is launched programmatically, so it starts early and waits),
   and the gap between two replays;
2. the kernel rebuilt with ``CTA_TIMES=1`` (kernels/decode_fp8_wgmma.cu: each CTA stores
   %globaltimer at its entry, when its consumers start, have Q in shared memory, finish the
   first block's QK, leave the page loop, have stored the outputs and end after the fold, when
   its producer issued the last page; and its SM and pages): the launch skew, the spread of the
   CTAs' end times (imbalance), the time per page and the CTA's fixed phases (medians).

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
# the kernel's CtaTimeField order: consumer start, end, SM, pages, entry, Q loaded, first QK
# done, page loop done, outputs stored, the producer's last page issued
FIELDS = 10
START, END, SM, PAGES, ENTRY, Q_LOADED, FIRST_QK, LOOP_END, STORED, LAST_LOAD = range(FIELDS)
# (label, from field, to field) of the phases a CTA's fixed cost is made of
PHASES = (("entry->consumers", ENTRY, START), ("Q load", START, Q_LOADED), ("first page + QK", Q_LOADED, FIRST_QK),
          ("last load->loop end", LAST_LOAD, LOOP_END), ("epilogue", LOOP_END, STORED), ("fold", STORED, END))
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
    if len(decode) < 2:
        return "timeline: fewer than two decode kernels in the profile"
    kernel = f"decode kernel {statistics.median(d['dur'] for d in decode):.1f} us"
    # a call ends with its combine where there is one (splits the fold leaves to it), else with the decode grid
    ends = [d["ts"] + d["dur"] for d in decode]
    if len(combine) == len(decode):
        run_on = [c["ts"] + c["dur"] - e for c, e in zip(combine, ends)]
        kernel += f", combine runs on {statistics.median(run_on):.1f} us after it"
        ends = [c["ts"] + c["dur"] for c in combine]
    else:
        kernel += f" (no combine: {len(combine)} in {len(decode)} calls)"
    gaps = [decode[i + 1]["ts"] - ends[i] for i in range(len(decode) - 1)]
    return f"{kernel}, gap to the next replay {statistics.median(gaps):.1f} us"


def cta_spread(call: DecodeCall, raw_path: Path | None = None) -> str:
    """The CTA_TIMES build's launch skew, end-time spread and time per page (``raw_path``: the
    CTAs' rows saved there as ``.npy``, fields as FIELDS)."""
    with extra_defines({"CTA_TIMES": 1}):
        warm_up(call, BURST_WARMUP_CALLS, BURST.warmup_s)  # compiles the diagnostic build, warms the clocks
        clear_times()
        call()
        torch.cuda.synchronize()
    times = read_global(SYMBOL, (MAX_CTAS, FIELDS), "cta_times: no CTA times: the default path did not run "
                                                    "the FP8 wgmma kernel")
    used = times[times[:, START] > 0]
    if raw_path is not None:
        np.save(raw_path, used)
    entry, end, pages = used[:, ENTRY], used[:, END], used[:, PAGES]
    t0 = entry.min()
    ends = np.percentile((end - t0) / 1e3, [0, 10, 50, 90, 100])
    # the steady pages: from the first block's QK to the loop's end (one item per CTA: its pages less one)
    per_page = (used[:, LOOP_END] - used[:, FIRST_QK]) / np.maximum(pages - 1, 1) / 1e3
    phases = "; ".join(f"{label} {np.median((used[:, b] - used[:, a]) / 1e3):.2f}" for label, a, b in PHASES)
    return (f"{len(used)} CTAs on {len(np.unique(used[:, SM]))} SMs, pages {pages.min()}-{pages.max()}; entry skew "
            f"{(entry.max() - t0) / 1e3:.1f} us; ends from the first entry min/p10/p50/p90/max "
            + "/".join(f"{e:.1f}" for e in ends) + f" us; us per steady page median {np.median(per_page):.3f}; "
            f"phases (median us): {phases}")


def report(w: DecodeWork, device: torch.device, copy_bandwidth: float, raw_dir: Path | None) -> None:
    case = DecodeCase.build([w.context] * w.batch, w.s_q, w.h_q, device)
    call = case.fp8()
    t_call = time_graph(call, clocks=BURST)
    roof_us = w.bytes(True) / copy_bandwidth * 1e6
    raw = None if raw_dir is None else raw_dir / f"cta_times_h{w.h_q}_s{w.s_q}_ctx{w.context}_b{w.batch}.npy"
    print(f"cta_times h{w.h_q} s{w.s_q} ctx{w.context} b{w.batch}: graph replay {t_call * 1e6:.1f} us "
          f"(memory roofline {roof_us:.1f} us); {replay_timeline(call)}; {cta_spread(call, raw)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", default="16,32,64")
    ap.add_argument("--mtp", default="1")
    ap.add_argument("--ctx", default="16384")
    ap.add_argument("--copy-tbs", type=float, default=4.26, help="copy ceiling (TB/s) for the roofline column")
    ap.add_argument("--raw-dir", type=Path, help="save each shape's CTA rows there (.npy)")
    args = ap.parse_args()
    device = torch.device("cuda")
    for h in map(int, args.heads.split(",")):
        for s in map(int, args.mtp.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                report(DecodeWork(args.batch, s, h, ctx, causal=True), device, args.copy_tbs * 1e12, args.raw_dir)


if __name__ == "__main__":
    main()
