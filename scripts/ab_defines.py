"""A/B of kernel build switches (extra ``#define``s) on the default decode paths, on the GPU:
each shape's FP8 and/or BF16 call as the library runs it (``get_mla_metadata``'s configuration
and work list), built once with the A defines and once with the B defines, timed as CUDA-graph
replays at burst clocks in alternation; the median (the higher middle one, as
scripts/ab_tuning.py) of ``--rounds``; b 64 as the sweep.

Usage: PYTHONPATH=. python3 scripts/ab_defines.py --b PV_PAIRS=0 [--b NAME=V,... ...] [--a NAME=V,...]
       [--ctx 16384,131072] [--shapes 16:1,32:1] [--formats fp8,bf16] [--rounds 3]
(each --b is one more side, timed in the same alternation and reported against A)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ab_split_fold import SHAPES  # this folder is sys.path[0]; the same shapes as the fold's A/B

from snapmla_cli.bench.decode_case import DecodeCase, extra_defines
from snapmla_cli.bench.timing import BURST, time_graph


def parse_defines(text: str) -> dict[str, int]:
    """``NAME=V,NAME=V`` (empty: none) as a defines mapping."""
    return {name: int(value) for name, value in (item.split("=") for item in text.split(",") if item)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default="", help="the A side's defines, NAME=V,... (default: none, the shipped build)")
    ap.add_argument("--b", required=True, action="append", help="a B side's defines, NAME=V,... (repeatable)")
    ap.add_argument("--ctx", default="16384,131072")
    ap.add_argument("--shapes", default=SHAPES, help="h_q:s_q pairs")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="fp8,bf16")
    args = ap.parse_args()
    sides = {"A": parse_defines(args.a)}
    for k, text in enumerate(args.b):
        sides["B" if len(args.b) == 1 else f"B{k + 1}"] = parse_defines(text)
    device = torch.device("cuda")
    for shape in args.shapes.split(","):
        h_q, s_q = (int(x) for x in shape.split(":"))
        for ctx in (int(c) for c in args.ctx.split(",")):
            case = DecodeCase.build([ctx] * args.batch, s_q, h_q, device)
            for fmt in args.formats.split(","):
                times: dict[str, list[float]] = {side: [] for side in sides}
                for _ in range(args.rounds):
                    for side, defines in sides.items():
                        with extra_defines(defines, bf16=fmt == "bf16"):
                            call = case.fp8() if fmt == "fp8" else case.bf16()
                            times[side].append(time_graph(call, clocks=BURST) * 1e6)
                medians = {side: statistics.median_high(times[side]) for side in sides}
                a = medians["A"]
                others = ", ".join(f"{side} {t:.1f} us, {side}/A {t / a:.4f}" for side, t in medians.items() if side != "A")
                print(f"{fmt} b{args.batch} h{h_q} s{s_q} {ctx // 1024}k: A {a:.1f} us, {others}", flush=True)
            del case


if __name__ == "__main__":
    main()
