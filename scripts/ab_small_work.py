"""The small-work rule of the FP8 heuristic (``decode_config.heuristic_for_work``) against what it
chooses between, on the GPU: for each shape of 64+ rows whose 64-row tiles give every SM fewer
than ``--max-units`` row-tile pages, the FP8 decode with 64-row tiles (the rows-only heuristic),
32-row tiles and 16-row tiles (the heuristic configurations of 32 and 16 rows), timed as
CUDA-graph replays at burst clocks in alternation. Prints per shape the three times, the fastest,
the rule's pick, and the geometric means of the rule over the rows-only heuristic and over the
fastest of the three: whether ``SMALL_WORK_TILE_PAGES_PER_SM`` sits where the measurements
put it.

Usage: PYTHONPATH=. python3 scripts/ab_small_work.py [--shapes 64:1,128:1,128:2] [--batch 1,4]
       [--ctx 4096,...,131072] [--max-units 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ab_tuning import alternating_medians  # this folder is sys.path[0]

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import BURST
from snapmla_cli.ops.decode_config import (
    RING_ROW_GROUPS,
    ROWS_M_ROW_GROUPS,
    ROWS_PER_GROUP,
    heuristic_config,
    heuristic_for_work,
    tile_pages_per_sm,
)
from snapmla_cli.tuning.space import config_id

TILE_ROWS = tuple(g * ROWS_PER_GROUP for g in (ROWS_M_ROW_GROUPS, RING_ROW_GROUPS, 1))  # 64, 32, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="64:1,128:1,128:2", help="h_q:s_q pairs of 64+ rows")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--ctx", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--max-units", type=float, default=16.0,
                    help="time only shapes with fewer 64-row-tile pages per SM than this")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    over_rows_only: list[float] = []
    over_best: list[float] = []
    for shape in args.shapes.split(","):
        h, s = map(int, shape.split(":"))
        rows = h * s
        for batch in map(int, args.batch.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                units = tile_pages_per_sm(rows, batch, ctx, sms)
                if units >= args.max_units:
                    continue
                configs = [heuristic_config(t).with_sms(sms) for t in TILE_ROWS]
                rule = heuristic_for_work(rows, True, batch, ctx, sms).with_sms(sms)
                case = DecodeCase.build([ctx] * batch, s, h, device)
                times = alternating_medians([case.fp8(c) for c in configs], BURST, args.rounds)
                best = min(range(len(configs)), key=times.__getitem__)
                t_rule = times[configs.index(rule)]
                over_rows_only.append(times[0] / t_rule)
                over_best.append(times[best] / t_rule)
                listed = "  ".join(f"{t}r {v * 1e6:7.1f}" for t, v in zip(TILE_ROWS, times))
                print(f"h{h} s{s} b{batch} {ctx // 1024}k units {units:5.1f} | {listed} us | fastest "
                      f"{TILE_ROWS[best]}r, rule {config_id(rule, 'fp8')} ({times[0] / t_rule:.3f}x the "
                      f"rows-only, {times[best] / t_rule:.3f}x the fastest)", flush=True)
                del case
                torch.cuda.empty_cache()
    if not over_rows_only:
        print(f"no shape below {args.max_units} tile-pages per SM")
        return
    print(f"rule over the rows-only heuristic: geomean {statistics.geometric_mean(over_rows_only):.4f}x over "
          f"{len(over_rows_only)} shapes; over the fastest of the three: {statistics.geometric_mean(over_best):.4f}x")


if __name__ == "__main__":
    main()
