"""Prep-kernel benchmark (issue 3): GB/s of Q-quant, K-append and the fetch-dequant variants at
large n, the decode-step latency of append + Q-quant, device-to-device copy bandwidth measured in
the same run (the ceiling these memory-bound kernels are judged against), and NVRTC cold / warm
compile times of every registered kernel. Prints a table; ``--json PATH`` saves the numbers.

    python scripts/bench_prep.py [--tokens 1048576] [--q-rows 65536] [--json out/prep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python scripts/bench_prep.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapmla_cli.bench.timing import time_cuda
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.formats import D_CONTENT, D_QK, D_ROPE, FP8_TOKEN_BYTES, PAGE_SIZE
from snapmla_cli.ops.prep import (
    append_kv,
    fetch_dequant,
    fetch_dequant_slots,
    fetch_dequant_soa,
    quantize_q,
)
from snapmla_cli.runtime import kernel_cache, launch, nvrtc
from snapmla_cli.runtime.registry import PREP_DEFINES, compile_all

COPY_BYTES = 2 << 30  # 2 GiB source, as in the decode benchmark's ceiling
BF16_ROW = D_QK * 2
Q_OUT_ROW = D_CONTENT + 4 + D_ROPE * 2  # content + scale + rope
SOA_ROW = D_CONTENT + 4 + D_ROPE * 2
SLOT = 4
DECODE_BATCH = 64
DECODE_HEADS = 128


@dataclass
class Row:
    name: str
    n: int
    us: float
    bytes: int
    gbs: float
    copy_pct: float


def measure(
    name: str, n: int, nbytes: int, fn: Callable[[], object], copy_gbs: float, reps: int
) -> Row:
    t = time_cuda(fn, reps=reps, warmup=3)
    gbs = nbytes / t / 1e9
    return Row(name, n, t * 1e6, nbytes, gbs, 100.0 * gbs / copy_gbs)


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """GB/s of ``clone`` of a 2 GiB tensor, counting bytes read + written."""
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device).uniform_()
    t = time_cuda(src.clone, reps=reps, warmup=2)
    return 2.0 * COPY_BYTES / t / 1e9


def compile_times() -> dict[str, float]:
    """Cold: empty disk cache, nothing in memory. Warm: the disk cache only (a new process)."""
    saved = os.environ.get(kernel_cache.CACHE_DIR_ENV)
    with tempfile.TemporaryDirectory() as folder:
        os.environ[kernel_cache.CACHE_DIR_ENV] = folder
        try:
            nvrtc.clear_memory_cache()
            t0 = time.perf_counter()
            modules = compile_all()
            cold = time.perf_counter() - t0
            nvrtc.clear_memory_cache()
            t0 = time.perf_counter()
            compile_all()
            warm = time.perf_counter() - t0
        finally:
            if saved is None:
                os.environ.pop(kernel_cache.CACHE_DIR_ENV, None)
            else:
                os.environ[kernel_cache.CACHE_DIR_ENV] = saved
            nvrtc.clear_memory_cache()
    return {"cold_s": cold, "warm_s": warm, "modules": len(modules)}


def bench_quantize_q(device: torch.device, rows: int, copy_gbs: float, reps: int) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, D_QK, device=device, generator=g).to(torch.bfloat16)
    return [
        measure(
            "quantize_q", rows, rows * (BF16_ROW + Q_OUT_ROW), lambda: quantize_q(q), copy_gbs, reps
        )
    ]


def bench_paged(device: torch.device, tokens: int, copy_gbs: float, reps: int) -> list[Row]:
    """append_kv (random and sequential slots), then the paged and slot-list dequant."""
    g = torch.Generator(device=device).manual_seed(1)
    blocks = -(-tokens // PAGE_SIZE)
    kv = torch.randn(tokens, D_QK, device=device, generator=g).to(torch.bfloat16)
    cache = torch.empty(blocks, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8, device=device)
    perm = torch.randperm(blocks * PAGE_SIZE, device=device, generator=g)[:tokens].to(torch.int32)
    seq = torch.arange(tokens, device=device, dtype=torch.int32)
    append_bytes = tokens * (BF16_ROW + SLOT + FP8_TOKEN_BYTES)
    rows = [
        measure(
            "append_kv (random slots)",
            tokens,
            append_bytes,
            lambda: append_kv(kv, perm, cache),
            copy_gbs,
            reps,
        ),
        measure(
            "append_kv (sequential)",
            tokens,
            append_bytes,
            lambda: append_kv(kv, seq, cache),
            copy_gbs,
            reps,
        ),
    ]
    batch = 16
    per_req = tokens // batch
    pages = -(-per_req // PAGE_SIZE)
    table = torch.randperm(blocks, device=device, generator=g)[: batch * pages].to(torch.int32)
    table = table.view(batch, pages)
    lens = torch.full((batch,), per_req, dtype=torch.int32, device=device)
    total = batch * per_req
    rows.append(
        measure(
            "fetch_dequant (paged)",
            total,
            total * (FP8_TOKEN_BYTES + BF16_ROW),
            lambda: fetch_dequant(cache, table, lens, total_tokens=total),
            copy_gbs,
            reps,
        )
    )
    rows.append(
        measure(
            "fetch_dequant_slots",
            tokens,
            tokens * (FP8_TOKEN_BYTES + SLOT + BF16_ROW),
            lambda: fetch_dequant_slots(cache, perm),
            copy_gbs,
            reps,
        )
    )
    return rows


def bench_soa(device: torch.device, tokens: int, copy_gbs: float, reps: int) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(2)
    content = torch.randint(
        0, 0x7E, (tokens, D_CONTENT), dtype=torch.uint8, device=device, generator=g
    )
    scale = torch.rand(tokens, device=device, generator=g)
    rope = torch.randn(tokens, D_ROPE, device=device, generator=g).to(torch.bfloat16)
    slots = torch.randperm(tokens, device=device, generator=g).to(torch.int32)
    return [
        measure(
            "fetch_dequant_soa",
            tokens,
            tokens * (SOA_ROW + SLOT + BF16_ROW),
            lambda: fetch_dequant_soa(content, scale, rope, slots),
            copy_gbs,
            reps,
        )
    ]


def bench_decode_step(device: torch.device, reps: int) -> dict[str, float]:
    """One decode step of b=64, s_q=1, h_q=128: append the 64 new tokens, quantize the queries."""
    g = torch.Generator(device=device).manual_seed(1)
    kv = torch.randn(DECODE_BATCH, D_QK, device=device, generator=g).to(torch.bfloat16)
    q = torch.randn(DECODE_BATCH, 1, DECODE_HEADS, D_QK, device=device, generator=g).to(
        torch.bfloat16
    )
    cache = torch.empty(
        DECODE_BATCH * 4, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8, device=device
    )
    slots = (torch.arange(DECODE_BATCH, device=device, dtype=torch.int32) * 4 + 3) * PAGE_SIZE
    t_append = time_cuda(lambda: append_kv(kv, slots, cache), reps=reps * 5, warmup=5)
    t_q = time_cuda(lambda: quantize_q(q), reps=reps * 5, warmup=5)
    t_both = time_cuda(
        lambda: (append_kv(kv, slots, cache), quantize_q(q)), reps=reps * 5, warmup=5
    )
    return {
        "append_kv_us": t_append * 1e6,
        "quantize_q_us": t_q * 1e6,
        "append_plus_q_us": t_both * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens for append / dequant")
    ap.add_argument("--q-rows", type=int, default=1 << 16, help="query rows for Q-quant")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--skip-compile", action="store_true", help="skip the cold/warm compile timing")
    args = ap.parse_args(argv)

    try:
        launch.require_gpu()
    except SnapmlaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    compile_info = {} if args.skip_compile else compile_times()
    copy_gbs = copy_bandwidth(device, args.reps)
    rows = bench_quantize_q(device, args.q_rows, copy_gbs, args.reps)
    rows += bench_paged(device, args.tokens, copy_gbs, args.reps)
    rows += bench_soa(device, args.tokens, copy_gbs, args.reps)
    step = bench_decode_step(device, args.reps)

    name = torch.cuda.get_device_name(device)
    print(f"{name}: device-to-device copy {copy_gbs:.0f} GB/s (clone of 2 GiB, read + write)")
    print(f"prep defines {PREP_DEFINES}")
    print(f"{'kernel':<26} {'n':>9} {'time us':>10} {'GB/s':>8} {'% copy':>7}")
    for r in rows:
        print(f"{r.name:<26} {r.n:>9} {r.us:>10.1f} {r.gbs:>8.0f} {r.copy_pct:>6.1f}%")
    print(
        f"decode step b={DECODE_BATCH} h_q={DECODE_HEADS}: "
        f"append_kv {step['append_kv_us']:.1f} us, "
        f"quantize_q {step['quantize_q_us']:.1f} us, both {step['append_plus_q_us']:.1f} us"
    )
    if compile_info:
        print(
            f"compile {compile_info['modules']} modules: cold {compile_info['cold_s']:.2f} s, "
            f"warm (disk cache) {compile_info['warm_s'] * 1e3:.1f} ms"
        )

    if args.json is not None:
        result = {
            "device": name,
            "copy_gbs": copy_gbs,
            "defines": PREP_DEFINES,
            "kernels": [asdict(r) for r in rows],
            "decode_step": step,
            "compile": compile_info,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
