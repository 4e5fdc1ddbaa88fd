"""What a hand-over between the two CTAs of a thread-block cluster costs (`kernels/diag/cluster_handover.cu`).

A decode kernel that split O across the two SMs of a cluster would pass each page's P and row
state to the other SM in distributed shared memory (docs/DESIGN.md, the register arithmetic of
the fifty-seventh session). This measures, for one cluster alone and for a cluster on every SM
pair at once: a cluster barrier, and a one-way hand-over of 0, 4 KB (one page's P at 64 rows)
and 16 KB (one page's float32 logits) by remote stores plus a remote mbarrier arrival:

    python3 scripts/cluster_handover.py [--rounds 20000] [--json OUT]

Cycles are the SM's clock64 over the round loop (per round for the barrier, per direction for
the ping-pong); microseconds are CUDA-event time over the launch divided the same way (they
include the launch, amortized over the rounds). Every payload word is checked on arrival.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from snapmla_cli.runtime import launch
from snapmla_cli.runtime.cluster_launch import ClusterLaunch

SOURCE, KERNEL = "diag/cluster_handover.cu", "snapmla_diag_cluster_handover"
THREADS = 128
CLUSTER = (2, 1, 1)
PAYLOADS = (0, 4096, 16384)  # bytes: a signal, one page's E4M3 P at 64 rows, its float32 logits
WARMUP_ROUNDS = 200


@dataclass
class Case:
    what: str
    payload_bytes: int
    clusters: int
    cycles: float  # per barrier (MODE 0) or per one-way hand-over (MODE 1), median over clusters
    microseconds: float  # the same from CUDA events over the launch
    wrong_words: int


def run_case(mode: int, payload: int, clusters: int, rounds: int, device: torch.device) -> Case:
    kernel = launch.get_kernel(SOURCE, KERNEL, {"MODE": mode, "PAYLOAD_BYTES": payload}, device=device.index)
    grid = (CLUSTER[0] * clusters, 1, 1)
    cluster_launch = ClusterLaunch(kernel.function.ptr, grid, (THREADS, 1, 1), 0, CLUSTER)
    cycles = torch.zeros(clusters, dtype=torch.int64, device=device)
    errors = torch.zeros(1, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream

    def go(n: int) -> None:
        cluster_launch(stream, [np.int32(n), cycles.data_ptr(), errors.data_ptr()])

    go(WARMUP_ROUNDS)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    go(rounds)
    stop.record()
    torch.cuda.synchronize(device)
    legs = rounds * (2 if mode == 1 else 1)
    return Case(what="cluster barrier" if mode == 0 else "one-way hand-over", payload_bytes=payload if mode else 0,
                clusters=clusters, cycles=statistics.median(cycles.tolist()) / legs,
                microseconds=start.elapsed_time(stop) * 1e3 / legs, wrong_words=int(errors.item()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20_000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    pairs = torch.cuda.get_device_properties(device).multi_processor_count // CLUSTER[0]
    cases = []
    for clusters in (1, pairs):
        cases.append(run_case(0, 0, clusters, args.rounds, device))
        cases += [run_case(1, payload, clusters, args.rounds, device) for payload in PAYLOADS]
    table = Table(title=f"cluster hand-over on {torch.cuda.get_device_name(device)} ({args.rounds} rounds)")
    for column in ("what", "payload B", "clusters", "cycles", "us", "wrong words"):
        table.add_column(column, justify="left" if column == "what" else "right")
    for case in cases:
        table.add_row(case.what, str(case.payload_bytes), str(case.clusters), f"{case.cycles:.0f}",
                      f"{case.microseconds:.3f}", str(case.wrong_words))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in cases], indent=2) + "\n")
    if any(case.wrong_words for case in cases):
        raise SystemExit("payload words arrived wrong: the hand-over's ordering is broken")


if __name__ == "__main__":
    main()
