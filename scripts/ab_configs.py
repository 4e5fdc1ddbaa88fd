"""A/B of decode configuration fields on the default FP8 path, on the GPU: each shape's call with
the configuration the library picks (tuning database, else heuristic) as A, and that configuration
with the fields of each ``--b`` laid over it (a warpgroup mode, a depth; the pipeline fitted to
shared memory) as B, timed as CUDA-graph replays at burst clocks in alternation; the median (the
higher middle one) of ``--rounds``; b 64 as the sweep. Where ab_defines.py changes a kernel's
build switches, this changes what the host launches as well (threads, shared memory, work list).

Usage: PYTHONPATH=. python3 scripts/ab_configs.py --b wg_mode=8 [--b wg_mode=8,stages=3 ...]
       [--ctx 16384,131072] [--shapes 16:1,32:1] [--rounds 3]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from ab_defines import parse_defines  # this folder is sys.path[0]
from ab_tuning import alternating_medians

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import BURST
from snapmla_cli.ops.config_choice import choose_config
from snapmla_cli.ops.decode_config import (
    DecodeConfig,
    column_capable,
    fit_stages,
    fp8_config_valid,
    with_balance,
)
from snapmla_cli.tuning.space import config_id


def overlaid(cfg: DecodeConfig, fields: dict[str, int]) -> DecodeConfig | None:
    """``cfg`` with ``fields`` replaced and its pipeline fitted (the split plan where the new
    layout cannot run columns), or None where the kernel cannot build it."""
    out = fit_stages(replace(cfg, **fields))  # type: ignore[arg-type]  # int fields only
    if not column_capable(out, True):
        out = with_balance(out, False)
    return out if fp8_config_valid(out) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", required=True, action="append", help="a B side's fields, NAME=V,... (repeatable)")
    ap.add_argument("--ctx", default="16384,131072")
    ap.add_argument("--shapes", default="16:1,32:1,16:2", help="h_q:s_q pairs")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda")
    for shape in args.shapes.split(","):
        h_q, s_q = (int(x) for x in shape.split(":"))
        for ctx in (int(c) for c in args.ctx.split(",")):
            base = choose_config(h_q * s_q, True, device, args.batch, ctx, s_q=s_q)
            sides: dict[str, DecodeConfig] = {"A": base}
            for k, text in enumerate(args.b):
                cfg = overlaid(base, parse_defines(text))
                if cfg is not None:
                    sides["B" if len(args.b) == 1 else f"B{k + 1}"] = cfg
            case = DecodeCase.build([ctx] * args.batch, s_q, h_q, device)
            calls = [case.fp8(cfg) for cfg in sides.values()]
            seconds = alternating_medians(calls, BURST, args.rounds)
            medians = {side: t * 1e6 for side, t in zip(sides, seconds)}
            a = medians["A"]
            others = ", ".join(f"{side} [{config_id(sides[side], 'fp8')}] {t:.1f} us, {side}/A {t / a:.4f}"
                               for side, t in medians.items() if side != "A")
            print(f"fp8 b{args.batch} h{h_q} s{s_q} {ctx // 1024}k: A [{config_id(base, 'fp8')}] {a:.1f} us, {others}",
                  flush=True)
            del case, calls


if __name__ == "__main__":
    main()
