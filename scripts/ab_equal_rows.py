"""Same-call A/B of the shipped tuning entries of two shapes with equal rows (e.g. h_q 64 s_q 1
and h_q 32 s_q 2, both 64 rows), each run on the first shape: what the lookup's s_q tie-break
(thirty-eighth session) changes for a caller that passes s_q. Prints us per configuration and
the ratio, median of ``--rounds`` alternating rounds of CUDA-graph replays at burst clocks."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import BURST, time_graph
from snapmla_cli.ops.decode_config import DecodeConfig
from snapmla_cli.tuning.db import load_file
from snapmla_cli.tuning.space import config_id


def entry_config(db: Path, h_q: int, s_q: int, fmt: str, batch: int, context: int) -> DecodeConfig:
    for section in load_file(db).sections:
        for e in section.entries:
            b = e.bucket
            if (b.h_q, b.s_q, b.format) == (h_q, s_q, fmt) and b.batch[0] <= batch <= b.batch[1] \
                    and b.context[0] <= context <= b.context[1]:
                return e.config
    raise SystemExit(f"no entry h{h_q} s{s_q} {fmt} b{batch} ctx {context} in {db}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="tuning_db/NVIDIA_H200.yaml")
    ap.add_argument("--shape", default="64:1", help="h_q:s_q that runs")
    ap.add_argument("--other", default="32:2", help="h_q:s_q whose entry is tried on it")
    ap.add_argument("--format", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", default="16384,32768,65536,131072")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    h_q, s_q = map(int, args.shape.split(":"))
    oh, os_ = map(int, args.other.split(":"))
    fp8 = args.format == "fp8"
    for ctx in map(int, args.ctx.split(",")):
        own = entry_config(Path(args.db), h_q, s_q, args.format, args.batch, ctx).with_sms(sms)
        other = entry_config(Path(args.db), oh, os_, args.format, args.batch, ctx).with_sms(sms)
        case = DecodeCase.build([ctx] * args.batch, s_q, h_q, device)
        calls = {"own": case.fp8(own) if fp8 else case.bf16(own),
                 "other": case.fp8(other) if fp8 else case.bf16(other)}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(time_graph(call, clocks=BURST) * 1e6)
        t_own, t_other = (statistics.median(times[n]) for n in ("own", "other"))
        print(f"{args.format} h{h_q} s{s_q} b{args.batch} ctx {ctx}: own {config_id(own, args.format)} "
              f"{t_own:.1f} us | h{oh} s{os_}'s {config_id(other, args.format)} {t_other:.1f} us | "
              f"other/own {t_other / t_own:.3f}", flush=True)


if __name__ == "__main__":
    main()
