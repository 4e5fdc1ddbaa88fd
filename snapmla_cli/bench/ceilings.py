"""Measure a GPU's ceilings (bf16 / fp8 matmul rate, copy bandwidth) in the same run as the
kernels they judge, on random data (zeros run faster than real data)."""

from __future__ import annotations

import torch

from .roofline import Ceilings
from .timing import BURST, Clocks, time_cuda

GEMM_N = 8192
COPY_BYTES = 2 << 30


def measure_ceilings(device: torch.device, clocks: Clocks = BURST) -> Ceilings:
    """In the clock state of the kernels' timings (bench.timing.Clocks): a power-capped kernel
    is judged against power-capped ceilings."""
    a = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
    t16 = time_cuda(lambda: a @ b, reps=10, clocks=clocks)
    flops = 2.0 * GEMM_N**3
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    t8 = time_cuda(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps=10, clocks=clocks)
    src = torch.empty(COPY_BYTES // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    tc = time_cuda(lambda: dst.copy_(src), reps=10, clocks=clocks)
    return Ceilings(p16=flops / t16, p8=flops / t8, bandwidth=2.0 * COPY_BYTES / tc)
