"""A/B of the cluster merge (ops/cluster_fold.py) against the split merge through the global
partials (the fold, or the combine past the fold's limit), on the GPU: each shape's FP8 and / or
BF16 call as the library runs it, planned once with ``SNAPMLA_CLUSTER_FOLD=1`` (A) and once with ``=0`` (B),
timed as CUDA-graph replays at burst clocks in alternation; the median (the higher middle one,
as scripts/ab_tuning.py) of ``--rounds``; b 64 as the sweep. The line says whether A's plan
really launched clusters (and of what size).

Usage: PYTHONPATH=. python3 scripts/ab_cluster_fold.py [--ctx 16384,131072] [--shapes 16:1,32:1]
       [--batch 64] [--rounds 3] [--formats fp8,bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
from itertools import product

import torch
from ab_split_fold import add_sweep_arguments, sweep  # this folder is sys.path[0]

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import BURST, time_graph
from snapmla_cli.ops import decode_launch


def planned_clusters() -> int:
    """The cluster size of the stored decode plans (one shape's: they were cleared before it;
    0: launched without)."""
    return max((p.cluster_size for p in decode_launch.stored_plans()), default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_arguments(ap, "16384,131072")
    ap.add_argument("--formats", default="fp8")
    args = ap.parse_args()
    device = torch.device("cuda")
    for (h_q, s_q, ctx), fmt in product(sweep(args), args.formats.split(",")):
        case = DecodeCase.build([ctx] * args.batch, s_q, h_q, device)
        call = case.fp8() if fmt == "fp8" else case.bf16()
        times: dict[str, list[float]] = {"A": [], "B": []}
        cluster = 0
        for _ in range(args.rounds):
            for side, value in (("A", "1"), ("B", "0")):
                os.environ["SNAPMLA_CLUSTER_FOLD"] = value
                decode_launch.clear_plans()  # planned again under this side's switch
                times[side].append(time_graph(call, clocks=BURST) * 1e6)
                if side == "A":
                    cluster = planned_clusters()
        os.environ.pop("SNAPMLA_CLUSTER_FOLD", None)
        a, b = statistics.median_high(times["A"]), statistics.median_high(times["B"])
        print(f"{fmt} b{args.batch} h{h_q} s{s_q} {ctx // 1024}k: cluster {cluster}: A {a:.1f} us, "
              f"B {b:.1f} us, A/B {a / b:.4f}", flush=True)
        del case


if __name__ == "__main__":
    main()
