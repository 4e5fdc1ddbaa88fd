"""Why a decode shape runs at the SM clock it does: NVML's clock, power and clock-event reasons
sampled while a shape's CUDA graph replays without pause, next to the replays' own times.

The 64-row tiles that stream every page from HBM (h64 s1) take about 8% longer a page than the
same tiles sharing their pages through L2 (h128 s1 / s2) in about the same cycles a turn
(docs/DESIGN.md, twenty-ninth session): the question was whether the power cap (reason 0x4) sets
the difference (it does under sustained load: docs/PERF.md, thirty-first session). Each shape
idles ``--idle`` seconds, then replays for ``--seconds`` (after two untimed replays that size
the run); a thread samples NVML every ``--period`` seconds. Per time window from the first
timed replay: the replays' mean time (CUDA events), the median SM clock and power, and the share
of samples with each clock-event reason set. NVML's power and clock readings trail the work by
about 100-300 ms; the reason bits are the part to read in the first windows.

    python3 scripts/clock_reasons.py --shapes 64:1:131072:fp8,128:1:131072:fp8
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass

import pynvml
import torch

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import capture_graph
from snapmla_cli.runtime.gpu_facts import nvml_uuid

SHAPES = "64:1:131072:fp8,128:1:131072:fp8,128:2:131072:fp8,16:1:131072:fp8,64:1:131072:bf16"
WINDOWS_MS = ((0, 25), (25, 100), (100, 300), (300, 1000), (1000, 3000))
# NVML's clock-event reason bits (nvmlClocksEventReason*) this report names
REASONS = {0x4: "power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "power brake"}


@dataclass(frozen=True)
class Sample:
    t_s: float  # host perf_counter
    sm_mhz: int
    power_w: float
    reasons: int


def _event_reasons(handle: object) -> int:
    """The clock-event reasons bitmask (named ...ThrottleReasons before nvidia-ml-py 12.535)."""
    query = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
        or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(query(handle))


def nvml_handle(device: torch.device) -> object:
    """NVML's handle of the GPU torch calls ``device``, matched by UUID as the tuning lookup
    matches it (NVML counts every GPU of the host, torch only the visible ones), else by index."""
    uuid = nvml_uuid(torch.cuda.get_device_properties(device))
    if uuid is not None:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)


def sample_nvml(handle: object, period_s: float, stop: threading.Event, out: list[Sample]) -> None:
    """Append one ``Sample`` every ``period_s`` until ``stop`` is set."""
    while not stop.is_set():
        out.append(Sample(time.perf_counter(),
                          pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                          pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                          _event_reasons(handle)))
        time.sleep(period_s)


def replay_sampled(graph: torch.cuda.CUDAGraph, seconds: float, handle: object,
                   period_s: float) -> tuple[list[tuple[float, float]], list[Sample], float]:
    """Replay ``graph`` for about ``seconds`` while NVML is sampled: (start ms, call ms) per
    replay on the GPU's timeline, the samples, and the host time of the first launch (the
    two timelines meet there: the GPU is idle before it)."""
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    calls = max(2, int(seconds / max(time.perf_counter() - start, 1e-6)))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    samples: list[Sample] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_nvml, args=(handle, period_s, stop, samples))
    sampler.start()
    t0 = time.perf_counter()
    for i in range(calls):
        events[i].record()
        graph.replay()
    events[calls].record()
    torch.cuda.synchronize()
    stop.set()
    sampler.join()
    starts = [events[0].elapsed_time(e) for e in events]
    return [(starts[i], starts[i + 1] - starts[i]) for i in range(calls)], samples, t0


def report(spec: str, replays: list[tuple[float, float]], samples: list[Sample], t0: float) -> None:
    for lo, hi in WINDOWS_MS:
        times = [ms for start, ms in replays if lo <= start < hi]
        window = [s for s in samples if lo <= (s.t_s - t0) * 1e3 < hi]
        if not times or not window:
            continue
        shares = " ".join(f"{name} {sum(bool(s.reasons & bit) for s in window) / len(window):.0%}"
                          for bit, name in REASONS.items()
                          if any(s.reasons & bit for s in window))
        print(f"{spec:>18} {lo:>5}-{hi:<5} ms: {statistics.fmean(times) * 1e3:8.1f} us/call ({len(times):4d} calls)"
              f"  SM {statistics.median(s.sm_mhz for s in window):5.0f} MHz"
              f" ({min(s.sm_mhz for s in window)}-{max(s.sm_mhz for s in window)})"
              f"  {statistics.median(s.power_w for s in window):5.0f} W  {shares or 'no reason'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="h_q:s_q:ctx:format,... (batch --batch)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--idle", type=float, default=2.0, help="seconds idle before each shape")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of replays per shape")
    ap.add_argument("--period", type=float, default=0.002, help="seconds between NVML samples")
    args = ap.parse_args()
    pynvml.nvmlInit()
    device = torch.device("cuda", torch.cuda.current_device())
    handle = nvml_handle(device)
    limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    print(f"{pynvml.nvmlDeviceGetName(handle)}: enforced power limit {limit_w:.0f} W, max SM clock "
          f"{pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)} MHz", flush=True)
    for spec in args.shapes.split(","):
        h, s, ctx, fmt = spec.split(":")
        case = DecodeCase.build([int(ctx)] * args.batch, int(s), int(h), device)
        call = case.fp8() if fmt == "fp8" else case.bf16()
        call()
        graph = capture_graph(call)
        torch.cuda.synchronize()
        time.sleep(args.idle)
        report(f"h{h} s{s} {int(ctx) // 1024}k {fmt}", *replay_sampled(graph, args.seconds, handle, args.period))
        del graph, call, case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
