"""How reproducible `snapmla bench --clocks burst` is for a whole decode step (docs/PERF.md,
fiftieth session): each case's step (a model's layers, one CUDA graph) timed several times in
turn with the burst clocks of before (rounds share one 25 ms window after one idle pause) and
with Clocks.BURST (a step too long for that window idles before every round), so the spread of
each method shows side by side. A case may be listed more than once: each listing builds its
inputs and caches afresh (new allocations), and each line names the GPU's temperature and power
draw when it starts (NVML), so a gap between listings or calls can be set against them."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable

import pynvml
import torch
from clock_reasons import nvml_handle  # this folder is sys.path[0]

from snapmla_cli.bench.gpu_step import GpuStepRunner
from snapmla_cli.bench.timing import BURST, capture_graph, time_cuda
from snapmla_cli.bench.worker import StepSpec

ONE_WINDOW = dataclasses.replace(BURST, name="one-window", idle_each_round=False)
CASES = "fp8:55:16384,bf16:55:16384,fp8:13:65536,bf16:13:65536"  # Kimi-K2's bench cases


class _Repeated(GpuStepRunner):
    """Times the captured step `repeats` times with each method, alternating; prints the lists."""

    repeats = 4

    def _time(self, step: Callable[[], None], ready: Callable[[], None]) -> tuple[list[float], bool, str]:
        step()
        torch.cuda.synchronize(self.device)
        graph = capture_graph(step)
        ready()
        runs: dict[str, list[float]] = {ONE_WINDOW.name: [], BURST.name: []}
        for _ in range(self.repeats):
            for clocks in (ONE_WINDOW, BURST):
                runs[clocks.name].append(time_cuda(graph.replay, reps=self.steps, warmup=self.warmup,
                                                   clocks=clocks) * 1e3)
        for name, ms in runs.items():
            print(f"  {name:>10}: " + " ".join(f"{t:.2f}" for t in ms)
                  + f" ms  median {statistics.median(ms):.2f}, max/min {max(ms) / min(ms):.3f}", flush=True)
        del graph
        return [ms / 1e3 for ms in runs[BURST.name]], True, ""


def _gpu_state(handle: object) -> str:
    """Temperature and power draw of the GPU now (NVML)."""
    celsius = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    watts = pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3
    return f"{celsius} C, {watts:.0f} W"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default=CASES, help="format:batch:context,... (s_q 1)")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    runner = _Repeated(0, roofline=False, clocks=BURST.name)
    runner.repeats = args.repeats
    runner.setup()
    pynvml.nvmlInit()
    handle = nvml_handle(runner.device)
    for case in args.cases.split(","):
        impl, batch, context = case.split(":")
        print(f"{impl} b {batch} ctx {context}, {args.heads} heads x {args.layers} layers"
              f" ({_gpu_state(handle)}):", flush=True)
        runner.run(StepSpec(impl, int(batch), 1, args.heads, int(context), args.layers, seed=0), lambda: None)
    runner.close()


if __name__ == "__main__":
    main()
