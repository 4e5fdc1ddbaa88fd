"""CUDA-event timing: warm-up, then the median over rounds of back-to-back calls (seconds).

Calls are queued back to back between one pair of events so that the host-side cost of a call
(argument checks, launch) overlaps the previous call's GPU work, as in a real decode loop; a
single call between two events would add the host cost to every sample.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Clocks:
    """The GPU clock state a timing measures. Measured on the H200 (docs/PERF.md, "Clocks"): a
    decode call runs at the 1980 MHz boost clock for its first 25-50 ms of continuous work, then
    the power cap (throttle reason 0x4) lowers the SM clock and the call takes 5-15% longer; and
    right after heavy work (the benchmark's own data generation) it starts throttled. ``BURST``
    idles first and warms briefly: the boost-clock time, reproducible to about 1%, and what
    kernel benchmarks usually report. ``STEADY`` warms for 0.2 s: the power-capped time of a
    GPU that decodes without pause."""

    name: str
    cooldown_s: float  # idle before the warm-up
    warmup_s: float  # device time of warm-up calls
    measure_s: float | None  # device time of the measured calls at most (None: reps as asked)
    # A call so long that the rounds cannot share measure_s (one call a round overruns it): each
    # round idles, warms for warmup_s and times one call, so every sample starts from the boost
    # clock instead of the later ones running into the power cap (a 61-layer bench step of 12-25
    # ms: 0.3-0.7% faster and at least as repeatable on an H100, docs/PERF.md, fiftieth session).
    idle_each_round: bool = False


BURST = Clocks("burst", cooldown_s=1.0, warmup_s=0.01, measure_s=0.025, idle_each_round=True)
STEADY = Clocks("steady", cooldown_s=0.0, warmup_s=0.2, measure_s=None)
CLOCKS = {c.name: c for c in (BURST, STEADY)}


def _elapsed(fn: Callable[[], object], calls: int) -> float:
    """Device seconds of ``calls`` back-to-back calls of ``fn``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def warm_up(fn: Callable[[], object], calls: int, seconds: float) -> float | None:
    """At least ``calls`` calls and ``seconds`` of device time of ``fn``; the mean seconds per call
    (None when nothing ran). After the first batch, the next is sized by the time per call so far
    to end the warm-up near ``seconds``: doubling batches overshot by up to 2x, so a 3 ms call
    warmed for 28 ms instead of 10 and BURST's rounds ran past the boost window (an H100's h128
    s2 64k sweep cell read 5.6% apart, docs/PERF.md, fifty-first session)."""
    done, spent, batch = 0, 0.0, max(1, calls)
    while done < calls or spent < seconds:
        spent += _elapsed(fn, batch)
        done += batch
        per_call = spent / done
        for_time = math.ceil((seconds - spent) / per_call) if per_call > 0 else 2 * batch
        batch = max(1, calls - done, for_time)
    return spent / done if done else None


def _idle(clocks: Clocks) -> None:
    """The idle pause before a clock state's warm-up: the queued work finished, then sleep."""
    torch.cuda.synchronize()
    time.sleep(clocks.cooldown_s)


def settle(fn: Callable[[], object], warmup: int, clocks: Clocks | None) -> float | None:
    """Bring the GPU to the clock state ``clocks`` describes before the calls that count: its
    idle pause, then at least ``warmup`` calls and its warm-up time of ``fn`` (``clocks`` None:
    the calls only). The mean seconds per warm-up call (None when nothing ran)."""
    if clocks is not None and clocks.cooldown_s > 0:
        _idle(clocks)
    per_call = warm_up(fn, warmup, clocks.warmup_s if clocks is not None else 0.0)
    torch.cuda.synchronize()
    return per_call


def _idle_round(fn: Callable[[], object], clocks: Clocks, per_call: float) -> float:
    """One sample of a long call at the boost clock: the idle pause, the fewest calls that cover
    the warm-up time (at least one: the clock ramps up from idle), then one timed call."""
    _idle(clocks)
    _elapsed(fn, max(1, math.ceil(clocks.warmup_s / per_call)))
    return _elapsed(fn, 1)


def time_cuda_rounds(fn: Callable[[], object], reps: int = 20, warmup: int = 3, rounds: int = 5,
                     clocks: Clocks | None = None, min_round_s: float = 0.0) -> list[float]:
    """Seconds per call of each of ``rounds`` rounds, in the order timed; ``clocks`` None:
    ``warmup`` calls only, no idle (the tuner's single cut-off replay; its real timings pass
    ``tuning.measure.TUNE_CLOCKS``). ``min_round_s``: a round has at least the calls that fill it
    (by the warm-up's time per call), within what the clock state's window leaves; a round of a
    few short calls also times the first call's launch and reads 10-50% apart from the next."""
    per_call = settle(fn, warmup, clocks)
    per_round = max(1, reps // rounds)
    if min_round_s > 0 and per_call:
        per_round = max(per_round, math.ceil(min_round_s / per_call))
    if clocks is not None and clocks.measure_s is not None and per_call:
        fits = int(clocks.measure_s / rounds / per_call)  # calls a round within the window
        if fits == 0 and clocks.idle_each_round:
            return [_idle_round(fn, clocks, per_call) for _ in range(rounds)]
        per_round = max(1, min(per_round, fits))
    return [_elapsed(fn, per_round) / per_round for _ in range(rounds)]


def time_cuda(fn: Callable[[], object], reps: int = 20, warmup: int = 3, rounds: int = 5,
              clocks: Clocks | None = None) -> float:
    """Median seconds per call over the rounds of :func:`time_cuda_rounds`."""
    return statistics.median(time_cuda_rounds(fn, reps, warmup, rounds, clocks))


def round_spread(samples: list[float]) -> float | None:
    """How far a timing's rounds disagree: slowest over fastest, minus 1 (0.01: 1%); None for
    fewer than two rounds or a round that took no time. A repeat of the same work that moves
    by more than a few percent says the rounds were too short to time steadily or the GPU was
    not in one state (another process, clocks)."""
    if len(samples) < 2 or min(samples) <= 0:
        return None
    return max(samples) / min(samples) - 1.0


def capture_graph(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``step`` captured in a CUDA graph (its kernels must already be loaded). An engine replays
    its decode step as a graph, so the graph's replay time is the step's device time without
    the Python launch path (which at short contexts can take longer than the kernels). The graph
    is replayed over the work lists it was captured with, so their planned split merge holds
    (``captures_replay_fixed_contents``): the replay times the kernels an eager call runs."""
    from ..ops.config_choice import captures_replay_fixed_contents

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on a side stream before capture, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), captures_replay_fixed_contents():
        step()
    return graph


def time_graph_rounds(step: Callable[[], object], reps: int = 20, warmup: int = 3,
                      clocks: Clocks | None = None) -> list[float]:
    """:func:`time_cuda_rounds` of the replay of ``step`` captured in a CUDA graph (seconds)."""
    step()  # compiles and loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = capture_graph(step)
    try:
        return time_cuda_rounds(graph.replay, reps=reps, warmup=warmup, clocks=clocks)
    finally:
        del graph


def time_graph(step: Callable[[], object], reps: int = 20, warmup: int = 3,
               clocks: Clocks | None = None) -> float:
    """Median seconds per replay over the rounds of :func:`time_graph_rounds`."""
    return statistics.median(time_graph_rounds(step, reps, warmup, clocks))
