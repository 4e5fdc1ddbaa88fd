"""The split planner against one wave of splits (docs/PERF.md, "Split plans for any batch"): the
FP8 default path on the same data with ``EXTRA_WAVES = 0`` (the one-wave plan) and with the
planner, at batches that do and do not divide the SM count and at mixed lengths."""

from __future__ import annotations

import argparse
import random

import torch

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import BURST, time_graph
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.ops import schedule

CASES = "64:64:16384,64:48:16384,64:80:16384,64:80:65536,64:100:16384,128:48:16384,16:100:65536,32:80:32768,64:64:mixed,16:64:mixed"
MAX_MIXED = 131072


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default=CASES, help="h_q:batch:ctx|mixed,... (s_q 1)")
    args = ap.parse_args()
    device = torch.device("cuda")
    planned = schedule.EXTRA_WAVES
    for spec in args.cases.split(","):
        h, b, ctx = spec.split(":")
        seqlens = ([random.Random(i).randint(1, MAX_MIXED) for i in range(int(b))] if ctx == "mixed"
                   else [int(ctx)] * int(b))
        case = DecodeCase.build(seqlens, 1, int(h), device)
        results = {}
        for name, extra in (("one wave", 0), ("planner", planned)):
            schedule.EXTRA_WAVES = extra
            call = case.fp8()
            out = call()[0].float()
            results[name] = (time_graph(call, clocks=BURST) * 1e6, call.work_items, out)
        schedule.EXTRA_WAVES = planned
        (t0, n0, o0), (t1, n1, o1) = results["one wave"], results["planner"]
        print(f"h{h} b{b} ctx {ctx}: one wave {t0:.1f}us ({n0} items), planner {t1:.1f}us ({n1} items), "
              f"x{t0 / t1:.3f}, rel_l2 between the outputs {compare(o1, o0).rel_l2:.1e}", flush=True)


if __name__ == "__main__":
    main()
