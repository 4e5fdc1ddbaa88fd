"""A/B of the split merge folded into the decode kernel (ops/split_fold.py) against the combine
kernel, on the GPU: the same configuration (the one ``get_mla_metadata`` settled) on the same
work list, once as returned (its plan carries the counters: the kernel merges) and once as a
copy (no plan: the combine merges). CUDA-graph replays at burst clocks, in alternation, the
median (the higher middle one, as scripts/ab_tuning.py) of ``--rounds``; b 64 as the sweep.

``--fold-rows N`` sets the fold's limit (ops/split_fold.py FOLD_MAX_PARTIAL_ROWS: splits x tile
rows one merging CTA may read) for the A/B, so that the fold can be timed where the planner
leaves a request to the combine (calibrating that limit); ``--formats`` picks fp8 and/or bf16.

Usage: PYTHONPATH=. python3 scripts/ab_split_fold.py [--ctx 16384,32768] [--shapes 16:1,32:1]
       [--batch 64] [--fold-rows 256] [--formats fp8,bf16]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Iterator

import torch

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import BURST, time_graph
from snapmla_cli.ops import split_fold
from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata, metadata_plan
from snapmla_cli.ops.decode_config import DecodeConfig

SHAPES = "16:1,16:2,32:1,32:2,64:1,128:1,128:2"


def add_sweep_arguments(ap: argparse.ArgumentParser, ctx: str, shapes: str = SHAPES) -> None:
    """The A/B scripts' sweep: contexts, h_q:s_q pairs, batch, rounds of alternation."""
    ap.add_argument("--ctx", default=ctx)
    ap.add_argument("--shapes", default=shapes, help="h_q:s_q pairs")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)


def sweep(args: argparse.Namespace) -> Iterator[tuple[int, int, int]]:
    """(h_q, s_q, context) of every shape and context of :func:`add_sweep_arguments`."""
    for shape in args.shapes.split(","):
        h_q, s_q = (int(x) for x in shape.split(":"))
        for ctx in (int(c) for c in args.ctx.split(",")):
            yield h_q, s_q, ctx


def step(case: DecodeCase, fp8: bool, meta: torch.Tensor, splits: torch.Tensor,
         cfg: DecodeConfig | None) -> Callable[[], object]:
    """One decode call of ``case`` on work list ``meta`` with configuration ``cfg``."""
    if fp8:
        return lambda: decode_fp8(case.q8, case.cache8, case.table, case.lens, meta, splits, None, True, config=cfg)
    return lambda: decode_bf16(case.q, case.cache16, case.table, case.lens, meta, splits, None, True, config=cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="16384,32768")
    ap.add_argument("--shapes", default=SHAPES, help="h_q:s_q pairs")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fold-rows", type=int, default=split_fold.FOLD_MAX_PARTIAL_ROWS,
                    help="the fold's limit in partial rows (splits x tile rows) for this run")
    ap.add_argument("--formats", default="fp8,bf16")
    args = ap.parse_args()
    split_fold.FOLD_MAX_PARTIAL_ROWS = args.fold_rows
    formats = [f == "fp8" for f in args.formats.split(",")]
    device = torch.device("cuda")
    for shape in args.shapes.split(","):
        h_q, s_q = (int(x) for x in shape.split(":"))
        for ctx in (int(c) for c in args.ctx.split(",")):
            case = DecodeCase.build([ctx] * args.batch, s_q, h_q, device)
            for fp8 in formats:
                meta, splits = get_mla_metadata(case.lens, case.rows, 1, fp8=fp8)
                plan = metadata_plan(meta)
                assert plan is not None
                fold_us, combine_us = [], []
                for _ in range(args.rounds):
                    fold_us.append(time_graph(step(case, fp8, meta, splits, plan.config), clocks=BURST) * 1e6)
                    combine_us.append(time_graph(step(case, fp8, meta.clone(), splits, plan.config), clocks=BURST) * 1e6)
                fold, combine = statistics.median_high(fold_us), statistics.median_high(combine_us)
                most = int((splits[1:] - splits[:-1]).max())
                folded = "" if plan.fold is None else f" fold<={plan.fold.max_splits}"
                print(f"{'fp8' if fp8 else 'bf16'} b{args.batch} h{h_q} s{s_q} {ctx // 1024}k columns "
                      f"{meta.shape[0]}x{meta.shape[1]} splits<={most}{folded}: fold {fold:.1f} us, combine {combine:.1f} us, {combine / fold:.4f}x", flush=True)
            del case


if __name__ == "__main__":
    main()
