"""CUDA-event timing: warm-up, then the median of repeats (seconds)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_cuda(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
