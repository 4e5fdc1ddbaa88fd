"""The tensor cores' rate at the FP8 decode kernel's own wgmma shapes (`kernels/diag/wgmma_rate.cu`).

SPEC section 7 judges the decode kernel against a large FP8 GEMM's rate. The kernel's 64-row
tiles run m64n64 wgmmas whose operands come from shared memory (QK) or whose A fragments are
built from it (PV), at twice the shared-memory bytes per FLOP of a GEMM's m64n256 tiles. This
measures each shape alone and in the warpgroup mixes the kernel runs, one CTA per SM:

    python3 scripts/wgmma_rate.py [--json OUT]

Per case: TFLOP/s over the chip (CUDA events, median of rounds), FLOP per SM clock (clock64 in
the kernel: independent of the clock), the operand bytes read from shared memory per SM clock,
with a streaming warp the bytes it wrote into shared memory (bulk copies from HBM, as the decode
kernel's page loads), and the fraction of the FP8 GEMM ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from snapmla_cli.bench.ceilings import measure_ceilings
from snapmla_cli.bench.timing import BURST, time_cuda
from snapmla_cli.runtime import launch

SOURCE, KERNEL = "diag/wgmma_rate.cu", "snapmla_diag_wgmma_rate"
WG_THREADS = 128
OPERAND_BYTES = 32 * 1024 + 128 * 1024 + 4 * 1024  # the kernel's kOperandBytes: A, B, PV's B
STREAM_BYTES = 4 * 10 * 1024  # its streaming ring (kStreamSlots x kStreamSlotBytes)
STREAM_SLOT_BYTES = 10 * 1024
BARRIER_BYTES = 64
SOURCE_BYTES = 1 << 30  # the streamed buffer: 20x the L2, so the copies come from HBM
GROUPS = 8192  # wgmma groups per warpgroup and launch (a multiple of the kernel's kRoundGroups)


@dataclass(frozen=True)
class Shape:
    """A kernel shape code and what one of its groups does (kGroupSteps wgmmas)."""

    code: int
    name: str
    steps: int  # wgmmas per group
    flops: int  # per wgmma
    smem_bytes: int  # operand bytes read from shared memory per wgmma (ldmatrix included)


M = 64
SHAPES = {s.code: s for s in (
    Shape(1, "QK fp8 m64n64k32 SS", 8, 2 * M * 64 * 32, M * 32 + 64 * 32),
    Shape(2, "PV fp8 m64n64k32 RS", 8, 2 * M * 64 * 32, 64 * 32),
    Shape(3, "PV fp8 m64n64k32 RS + ldmatrix", 8, 2 * M * 64 * 32, 64 * 32 + M * 32),
    Shape(4, "RoPE bf16 m64n64k16 SS", 8, 2 * M * 64 * 16, M * 32 + 64 * 32),
    Shape(5, "GEMM fp8 m64n256k32 SS", 16, 2 * M * 256 * 32, M * 32 + 256 * 32),
)}

# (warpgroup shapes, a warp streams pages from HBM into shared memory meanwhile): the shapes
# alone, then the decode kernel's mixes (rows = M at 64 rows: one warpgroup's QK while the
# other's PV runs, its fragments loaded from the page), then with the page loads' writes
CASES: tuple[tuple[tuple[int, ...], bool], ...] = (
    ((5,), False), ((5, 5), False),
    ((1,), False), ((1, 1), False), ((1, 1, 1), False),
    ((2,), False), ((2, 2), False),
    ((3,), False), ((3, 3), False), ((3, 3, 3), False),
    ((4, 4), False),
    ((1, 3), False), ((1, 3, 3), False),
    ((5, 5), True), ((1, 1), True), ((3, 3), True), ((1, 3), True),
)


@dataclass
class Result:
    shapes: str
    stream: bool
    tflops: float
    flop_per_clock: float
    smem_bytes_per_clock: float  # operand reads (wgmma and ldmatrix)
    stream_bytes_per_clock: float  # the streaming warp's writes
    stream_tbps: float
    clock_ghz: float
    of_gemm_ceiling: float


def run_case(shapes: tuple[int, ...], stream: bool, sms: int, fp8_ceiling: float, source: torch.Tensor) -> Result:
    defines = {"NUM_WG": len(shapes), "STREAM": int(stream), **{f"WG{i}_SHAPE": s for i, s in enumerate(shapes)}}
    kernel = launch.get_kernel(SOURCE, KERNEL, defines)
    threads = WG_THREADS * len(shapes) + (32 if stream else 0)
    smem = OPERAND_BYTES + (STREAM_BYTES if stream else 0) + BARRIER_BYTES
    cycles = torch.zeros(sms * len(shapes), dtype=torch.int64, device="cuda")
    checksum = torch.empty(sms * threads, dtype=torch.float32, device="cuda")
    streamed = torch.zeros(sms, dtype=torch.int64, device="cuda")

    def call() -> None:
        launch.launch(kernel, (sms, 1, 1), (threads, 1, 1),
                      (launch.i32(GROUPS), launch.i32(12345), cycles, checksum, source,
                       launch.i64(source.numel() // STREAM_SLOT_BYTES), streamed), shared_mem=smem)

    seconds = time_cuda(call, reps=5, warmup=2, rounds=5, clocks=BURST)
    if not bool(torch.isfinite(checksum).all()):
        raise SystemExit(f"{shapes}: non-finite checksum (operands not finite?)")
    per_cta = [SHAPES[s] for s in shapes]
    cta_flops = sum(GROUPS * s.steps * s.flops for s in per_cta)
    cta_bytes = sum(GROUPS * s.steps * s.smem_bytes for s in per_cta)
    cta_cycles = cycles.view(sms, len(shapes)).amax(dim=1).double()
    clocks = statistics.median(cta_cycles.tolist())
    cta_streamed = statistics.median(streamed.double().tolist())
    tflops = sms * cta_flops / seconds / 1e12
    return Result(
        shapes=" + ".join(SHAPES[s].name for s in shapes),
        stream=stream,
        tflops=tflops,
        flop_per_clock=cta_flops / clocks,
        smem_bytes_per_clock=cta_bytes / clocks,
        stream_bytes_per_clock=cta_streamed / clocks,
        stream_tbps=float(streamed.double().sum()) / seconds / 1e12,
        clock_ghz=clocks / seconds / 1e9,
        of_gemm_ceiling=tflops * 1e12 / fp8_ceiling,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ceilings = measure_ceilings(device, BURST)
    source = torch.zeros(SOURCE_BYTES, dtype=torch.uint8, device=device)
    results = [run_case(shapes, stream, sms, ceilings.p8, source) for shapes, stream in CASES]
    table = Table(title=f"wgmma rate, {sms} CTAs (one per SM), {GROUPS} groups per warpgroup; "
                        f"FP8 GEMM ceiling {ceilings.p8 / 1e12:.0f} TFLOP/s, BF16 {ceilings.p16 / 1e12:.0f}")
    for column in ("warpgroups", "stream", "TFLOP/s", "FLOP/clk/SM", "operand B/clk/SM", "stream B/clk/SM",
                   "stream TB/s", "GHz", "of FP8 GEMM"):
        table.add_column(column, justify="left" if column == "warpgroups" else "right")
    for r in results:
        table.add_row(r.shapes, "yes" if r.stream else "", f"{r.tflops:.0f}", f"{r.flop_per_clock:.0f}",
                      f"{r.smem_bytes_per_clock:.1f}", f"{r.stream_bytes_per_clock:.1f}", f"{r.stream_tbps:.2f}",
                      f"{r.clock_ghz:.2f}", f"{r.of_gemm_ceiling:.1%}")
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps({"ceilings": asdict(ceilings), "groups": GROUPS, "sms": sms,
                                         "results": [asdict(r) for r in results]}, indent=1))


if __name__ == "__main__":
    main()
