"""A stand-in step runner for CI: a few tiny attention-like torch matmuls on the CPU, timed with
the wall clock. It exercises everything around the kernels (ranks, barriers, the gather, the
tables, JSON and plot) in seconds on a machine without a GPU; its numbers mean nothing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..numerics.formats import D_QK, D_V, default_softmax_scale
from .results import CPU_FAKE_KERNEL, StepTiming
from .timing import round_spread
from .worker import StepSpec

FAKE_NOTE = "cpu-fake: tiny torch matmuls on the CPU stand in for the kernels; the numbers mean nothing"


class CpuFakeRunner:
    MAX_BATCH = 2
    MAX_TOKENS = 128
    MAX_HEADS = 8
    MAX_LAYERS = 4

    def __init__(self, steps: int = 3, warmup: int = 1) -> None:
        self.steps, self.warmup = steps, warmup
        self.device_name = "cpu"

    def setup(self) -> dict:
        torch.set_num_threads(1)  # ranks share the CPU
        return {"device": self.device_name, "fake": True}

    def run(self, spec: StepSpec, ready: Callable[[], None]) -> StepTiming:
        gen = torch.Generator().manual_seed(spec.seed)
        b = min(spec.batch, self.MAX_BATCH)
        n = min(spec.context, self.MAX_TOKENS)
        rows = spec.s_q * min(spec.heads, self.MAX_HEADS)
        layers = min(spec.layers, self.MAX_LAYERS)
        q = torch.randn(layers, b, rows, D_QK, generator=gen)
        kv = torch.randn(b, n, D_QK, generator=gen)
        scale = default_softmax_scale()

        def step() -> None:
            for layer in range(layers):
                p = torch.softmax(scale * q[layer] @ kv.transpose(1, 2), dim=-1)
                p @ kv[..., :D_V]

        for _ in range(self.warmup):
            step()
        ready()
        times = []
        for _ in range(self.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return StepTiming(statistics.median(times), CPU_FAKE_KERNEL, graphed=False, note=FAKE_NOTE,
                          spread=round_spread(times))

    def close(self) -> None:
        pass
