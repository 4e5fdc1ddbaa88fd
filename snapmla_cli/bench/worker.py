"""The per-rank loop of ``snapmla bench``: for every layout, context and case of the plan, wait
for the other ranks, let the step runner time one decode step, and record a :class:`Measurement`.

The step runner is injected (the :class:`StepRunner` protocol): the real one launches the GPU
kernels (``bench.gpu_step``), the fake one runs tiny torch matmuls on the CPU
(``bench.fake_step``) so that the orchestration, the gather and the rendering run in CI. The
communicator is injected too (:class:`Comm`): torch.distributed between ranks, or
:class:`LocalComm` for a single in-process rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..sizes import format_size
from .plan import BenchPlan, place
from .results import Measurement, StepTiming, format_spread

Progress = Callable[[str], None]
Gathered = TypeVar("Gathered")  # what every rank contributes to an all-gather


@dataclass(frozen=True)
class StepSpec:
    """One decode step to build and time on one rank."""

    impl: str  # "fp8" or "bf16"
    batch: int  # requests of this rank's DP group
    s_q: int  # query tokens per request (MTP)
    heads: int  # query heads on this rank
    context: int  # cached tokens per request, the new ones included
    layers: int  # attention calls per step
    seed: int


class StepRunner(Protocol):
    device_name: str  # recorded with each measurement

    def setup(self) -> dict[str, Any]:
        """Prepare the device; return facts about it for the report (name, ceilings...)."""

    def run(self, spec: StepSpec, ready: Callable[[], None]) -> StepTiming:
        """Build the step's tensors, call ``ready()`` exactly once right before the timed
        steps (a barrier: all ranks time together), time the step, free the tensors."""

    def close(self) -> None: ...


class Comm(Protocol):
    rank: int
    world: int

    def barrier(self) -> None: ...

    def all_gather(self, obj: Gathered) -> list[Gathered]: ...


class LocalComm:
    """A world of one rank, no torch.distributed."""

    rank = 0
    world = 1

    def barrier(self) -> None:
        pass

    def all_gather(self, obj: Gathered) -> list[Gathered]:
        return [obj]


# a rank's seed stays within what torch.Generator.manual_seed takes (the option allows 2^63 - 1)
SEED_RANGE = 2**63


def rank_seed(plan: BenchPlan, dp_index: int) -> int:
    """Different requests (page layout, data) in every DP group; the same within a TP group,
    whose ranks decode the same requests."""
    return (plan.seed * 1_000_003 + dp_index) % SEED_RANGE  # torch generators take 64 bits


def run_rank(
    plan: BenchPlan,
    rank: int,
    runner: StepRunner,
    comm: Comm,
    progress: Progress | None = None,
) -> list[Measurement]:
    """Time every case of the plan on this rank, in the same order on every rank. Barriers
    before each case and right before its timed steps make the ranks time it together (as
    they would run in a server), whatever their set-up times."""
    device = runner.device_name
    out: list[Measurement] = []
    for layout in plan.layouts:
        where = place(rank, layout, plan.heads)
        for ctx in plan.contexts:
            for case in plan.batches(ctx).cases():
                spec = StepSpec(case.impl, case.batch, plan.s_q, where.heads, ctx, plan.layers,
                                rank_seed(plan, where.dp_index))
                comm.barrier()
                t = runner.run(spec, comm.barrier)
                m = Measurement(
                    rank=rank, layout=layout.name, dp_index=where.dp_index,
                    tp_index=where.tp_index, context=ctx, impl=case.impl, batch=case.batch,
                    s_q=plan.s_q, heads=where.heads, layers=plan.layers, step_s=t.step_s,
                    kernel=t.kernel, graphed=t.graphed, t_min_s=t.t_min_s, note=t.note,
                    device=device, spread=t.spread, bf16_t_min_s=t.bf16_t_min_s,
                )
                out.append(m)
                if progress is not None:
                    progress(
                        f"{layout.name} ctx {format_size(ctx)} {case.impl} batch {case.batch} "
                        f"heads {where.heads}: {m.step_s * 1e3:.2f} ms/step, "
                        f"{m.us_per_layer:.1f} us/layer ({t.kernel}{', graph' if t.graphed else ''}"
                        f"{'' if t.spread is None else f', rounds {format_spread(t.spread)} apart'})"
                    )
    comm.barrier()
    return out
