"""How a decode timing depends on the GPU's clock state (docs/PERF.md, "Clocks"): each shape's
FP8 / BF16 default path timed after 1.5 s idle with warm-ups of growing length, twice, so that
the boost clock, the power cap and the run-to-run spread show side by side."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import Clocks, capture_graph, time_cuda

WARMUPS_S = (0.0, 0.01, 0.025, 0.05, 0.2, 1.0)
IDLE_S = 1.5
SHAPES = "16:1:16384:fp8,16:1:32768:fp8,32:1:32768:fp8,128:1:32768:fp8,16:1:16384:bf16,128:1:32768:bf16"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=SHAPES, help="h_q:s_q:ctx:format,... (batch 64)")
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    device = torch.device("cuda")
    graphs = []
    for spec in args.shapes.split(","):
        h, s, ctx, fmt = spec.split(":")
        case = DecodeCase.build([int(ctx)] * 64, int(s), int(h), device)
        call = case.fp8() if fmt == "fp8" else case.bf16()
        call()
        torch.cuda.synchronize()
        graphs.append((spec, call, capture_graph(call)))  # the call keeps the case alive
    base = Clocks("probe", cooldown_s=IDLE_S, warmup_s=0.0, measure_s=None)
    for p in range(args.passes):
        for spec, _call, graph in graphs:
            times = [time_cuda(graph.replay, clocks=dataclasses.replace(base, warmup_s=w)) * 1e6
                     for w in WARMUPS_S]
            print(f"pass {p} {spec}: " + " ".join(f"{w * 1e3:g}ms {t:.1f}us" for w, t in zip(WARMUPS_S, times)),
                  flush=True)


if __name__ == "__main__":
    main()
