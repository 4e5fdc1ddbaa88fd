"""This GPU's tuning-database entries against the built-in heuristic, on the same data in one call
(issue 5's check that tuned beats or equals the heuristic): for each shape, the FP8 (or BF16)
decode with the configuration the database gives and with the heuristic's, timed as CUDA-graph
replays in alternation over ``--rounds`` rounds, at burst clocks (the benchmark's and the
tuner's state) and, with ``--steady``, power-capped (what an engine that decodes without pause
gets, but too dependent on the work just before to rank plans a few percent apart: docs/PERF.md,
fifteenth session). The database is the one the runtime reads
(``SNAPMLA_TUNING_DIR`` to point elsewhere). Prints one line per shape and the geometric mean."""

from __future__ import annotations

import argparse
import statistics

import torch

from snapmla_cli.bench.decode_case import DecodeCall, DecodeCase
from snapmla_cli.bench.timing import BURST, STEADY, Clocks, time_graph
from snapmla_cli.ops.config_choice import choose_config
from snapmla_cli.ops.decode_config import DecodeConfig, heuristic_for_work
from snapmla_cli.tuning.space import config_id


def alternating_medians(calls: list[DecodeCall], clocks: Clocks, rounds: int) -> list[float]:
    """Median seconds (the higher middle one for an even count) of each call, the calls timed in
    alternation, round after round (so that a drift of the clocks touches every side alike)."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for i, call in enumerate(calls):
            times[i].append(time_graph(call, clocks=clocks))
    return [statistics.median_high(t) for t in times]


def time_pair(case: DecodeCase, tuned: DecodeConfig, heuristic: DecodeConfig, fp8: bool, clocks: Clocks,
              rounds: int) -> tuple[float, float]:
    """Median seconds of the tuned and the heuristic configuration, timed in alternation."""
    calls = [case.fp8(c) if fp8 else case.bf16(c) for c in (tuned, heuristic)]
    t_tuned, t_heuristic = alternating_medians(calls, clocks, rounds)
    return t_tuned, t_heuristic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", default="16,32,64,128")
    ap.add_argument("--mtp", default="1,2")
    ap.add_argument("--ctx", default="16384,32768,65536,131072")
    ap.add_argument("--format", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steady", action="store_true", help="also time power-capped (after 0.2 s of work)")
    ap.add_argument("--all", action="store_true", help="also time shapes whose entry is the heuristic's")
    args = ap.parse_args()
    device = torch.device("cuda")
    fp8 = args.format == "fp8"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    states = [BURST] + ([STEADY] if args.steady else [])
    ratios: dict[str, list[float]] = {c.name: [] for c in states}
    for h in map(int, args.heads.split(",")):
        for s in map(int, args.mtp.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                rows = h * s
                tuned = choose_config(rows, fp8, device, args.batch, ctx, s_q=s)
                heuristic = heuristic_for_work(rows, fp8, args.batch, ctx, sms).with_sms(sms)
                if tuned == heuristic and not args.all:
                    for c in states:
                        ratios[c.name].append(1.0)
                    continue
                case = DecodeCase.build([ctx] * args.batch, s, h, device)
                label = f"h{h} s{s} {ctx // 1024}k {config_id(tuned, args.format)} vs {config_id(heuristic, args.format)}"
                line = [label]
                for c in states:
                    t_tuned, t_heur = time_pair(case, tuned, heuristic, fp8, c, args.rounds)
                    ratios[c.name].append(t_heur / t_tuned)
                    line.append(f"{c.name}: tuned {t_tuned * 1e6:.1f} heuristic {t_heur * 1e6:.1f} us "
                                f"({t_heur / t_tuned:.3f}x)")
                print(" | ".join(line), flush=True)
                del case
                torch.cuda.empty_cache()
    for name, r in ratios.items():
        print(f"{name}: geomean tuned over heuristic {statistics.geometric_mean(r):.4f}x "
              f"over {len(r)} shapes (entries equal to the heuristic count 1.0)")


if __name__ == "__main__":
    main()
