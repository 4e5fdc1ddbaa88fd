"""CUDA-event timing: warm-up, then the median over rounds of back-to-back calls (seconds).

Calls are queued back to back between one pair of events so that the host-side cost of a call
(argument checks, launch) overlaps the previous call's GPU work, as in a real decode loop; a
single call between two events would add the host cost to every sample.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


# Device time every benchmark timing runs before it measures: the steady state of a decode loop.
# Measured on the H200 (docs/PERF.md, "Timing in the steady state"): a compute-heavy decode call
# runs at the 1980 MHz boost clock for its first ~50 ms, then the power cap (throttle reason
# 0x4) takes the SM clock to ~1815 MHz and the call 8-12% longer; and a 16-row decode timed
# after 3 warm-up calls read 11% slower than after 50 ms. A real decode step runs back to back
# with the model's other kernels, so the steady state is what an engine gets.
WARMUP_SECONDS = 0.2


def _elapsed(fn: Callable[[], object], calls: int) -> float:
    """Device seconds of ``calls`` back-to-back calls of ``fn``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def warm_up(fn: Callable[[], object], calls: int, seconds: float) -> None:
    """At least ``calls`` calls and ``seconds`` of device time of ``fn``, in doubling batches."""
    done, spent, batch = 0, 0.0, max(1, calls)
    while done < calls or spent < seconds:
        spent += _elapsed(fn, batch)
        done += batch
        batch *= 2


def time_cuda(fn: Callable[[], object], reps: int = 20, warmup: int = 3, rounds: int = 5,
              warmup_s: float = WARMUP_SECONDS) -> float:
    warm_up(fn, warmup, warmup_s)
    torch.cuda.synchronize()
    per_round = max(1, reps // rounds)
    return statistics.median(_elapsed(fn, per_round) / per_round for _ in range(rounds))


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


def time_graph(step: Callable[[], object], reps: int = 20, warmup: int = 3,
               warmup_s: float = WARMUP_SECONDS) -> float:
    """:func:`time_cuda` of the replay of ``step`` captured in a CUDA graph (seconds)."""
    step()  # compiles and loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = capture_graph(step)
    try:
        return time_cuda(graph.replay, reps=reps, warmup=warmup, warmup_s=warmup_s)
    finally:
        del graph
