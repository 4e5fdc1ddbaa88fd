"""CUDA-event timing: warm-up, then the median over rounds of back-to-back calls (seconds).

Calls are queued back to back between one pair of events so that the host-side cost of a call
(argument checks, launch) overlaps the previous call's GPU work, as in a real decode loop; a
single call between two events would add the host cost to every sample.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_cuda(fn: Callable[[], object], reps: int = 20, warmup: int = 3, rounds: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_round = max(1, reps // rounds)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_round):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_round)
    return statistics.median(times)


def capture_graph(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``step`` captured in a CUDA graph (its kernels must already be loaded). An engine replays
    its decode step as a graph, so the graph's replay time is the step's device time without
    the Python launch path (which at short contexts can take longer than the kernels)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on a side stream before capture, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def time_graph(step: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """:func:`time_cuda` of the replay of ``step`` captured in a CUDA graph (seconds)."""
    step()  # compiles and loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = capture_graph(step)
    try:
        return time_cuda(graph.replay, reps=reps, warmup=warmup)
    finally:
        del graph
