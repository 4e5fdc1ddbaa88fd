"""One FP8 (or BF16) decode call on a benchmark shape, for Nsight Compute:
``ncu -k snapmla_decode_fp8 -c 1 python3 scripts/profile_decode.py --heads 16``.
``scripts/trace_decode.py`` runs the same call with the kernel's phase trace on."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from snapmla_cli.cache.layout import random_paged_layout
from snapmla_cli.numerics.formats import D_QK, FP8_TOKEN_BYTES
from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata
from snapmla_cli.ops.decode_config import config_from_spec
from snapmla_cli.ops.prep import append_kv, quantize_q


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The benchmark shape and the FP8 configuration (shared with trace_decode.py)."""
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--mtp", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--config", help="FP8 kernel configuration (config_from_spec format) instead of the default path")


def run_decode(args: argparse.Namespace, bf16: bool = False) -> Callable[[], object]:
    """Two decode calls on the shape of ``args`` (the first compiles and warms up); returns the
    call, so that a caller can run it again (trace_decode.py's burst clocks)."""
    device = torch.device("cuda")
    layout = random_paged_layout([args.ctx] * args.batch, generator=torch.Generator().manual_seed(0), spare_blocks=0)
    table, lens = layout.block_table.to(device), layout.cache_seqlens.to(device)
    q = (torch.randn(args.batch, args.mtp, args.heads, D_QK, device=device) * 0.5).to(torch.bfloat16)
    kv = torch.randn(layout.num_blocks * 64, D_QK, device=device).to(torch.bfloat16)
    rows = args.mtp * args.heads
    step: Callable[[], object]
    if bf16:
        meta, splits = get_mla_metadata(lens, rows, 1, fp8=False)
        step = partial(decode_bf16, q, kv.view(-1, 64, 1, D_QK), table, lens, meta, splits, None, True)
    else:
        cache = torch.empty(layout.num_blocks, 64, FP8_TOKEN_BYTES, dtype=torch.uint8, device=device)
        append_kv(kv, torch.arange(kv.shape[0], device=device, dtype=torch.int32), cache)
        cfg = None
        if args.config:
            cfg = config_from_spec(args.config).with_sms(torch.cuda.get_device_properties(device).multi_processor_count)
        meta, splits = get_mla_metadata(lens, rows, 1, fp8=True, config=cfg)
        step = partial(decode_fp8, quantize_q(q), cache, table, lens, meta, splits, None, True, config=cfg)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    run_decode(args, bf16=args.bf16)


if __name__ == "__main__":
    main()
