"""Per-rank measurements of ``snapmla bench`` and how they add up over a layout (pure).

A DP group decodes its own requests; the ranks of a TP group decode the *same* requests with
a share of the heads each and advance in lockstep, so the group's step takes as long as its
slowest rank. Hence, for one layout:

    aggregate tokens/s = sum over DP groups of  batch * s_q / max over the group's TP ranks of step_s
    tokens/s per GPU   = aggregate / (dp * tp)

TFLOPS and GB/s (SPEC section 7, decode work only, over the whole step time, which also holds the
Q-quant and the K-append) add up over all ranks, since each rank does its own share of the work.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from ..errors import SnapmlaError
from ..report_header import report_header
from ..sizes import format_size
from .plan import BF16, FP8, BenchPlan, Layout
from .roofline import DecodeWork

BENCH_JSON_FORMAT = "snapmla-bench"

NOISY_SPREAD = 0.03  # rounds of one timing that differ by more make its median suspect (a note says so)
# StepTiming.kernel of the CPU stand-in runner (bench --cpu-fake, CI): how a measurement, also one
# read back from a report's JSON, says its timings are the CPU's wall clock and not a GPU's
CPU_FAKE_KERNEL = "cpu-fake"
# Why the timed rounds of a measurement may differ by more than NOISY_SPREAD, and what to do:
# on a GPU, too-short rounds or a device that changed state; the CPU stand-in's rounds are
# wall-clock times of tiny matmuls on a shared CPU, which no --steps would make GPU figures
# (the stand-in caps its steps anyway), so its note says only that.
GPU_NOISE_CAUSE = ("rounds too short to time steadily (more --steps make them longer), or the device was not "
                   "in one state while they ran (another process, a clock change); rerun before comparing them")
CPU_FAKE_NOISE_CAUSE = ("these are the CPU stand-in's wall-clock timings (--cpu-fake), not GPU timings; "
                        "they mean nothing as GPU figures, noisy or not")


def format_spread(spread: float | None) -> str:
    """A timing's round spread (``timing.round_spread``) as the tables and notes print it: ``1.2%``,
    ``-`` where there is none."""
    return "-" if spread is None else f"{100 * spread:.1f}%"


@dataclass(frozen=True)
class StepTiming:
    """What a step runner reports for one case on one rank."""

    step_s: float  # median time of one decode step: all layers, every launch
    kernel: str  # what ran, e.g. snapmla-fp8, snapmla-bf16, flashmla-bf16, cpu-fake
    graphed: bool  # timed as a CUDA-graph replay (else eager launches)
    t_min_s: float | None = None  # SPEC section 7 roofline of the step's decode calls
    note: str = ""
    spread: float | None = None  # the timed rounds' slowest over fastest, minus 1 (timing.round_spread)
    bf16_t_min_s: float | None = None  # FP8 steps: the BF16 roofline of the same decode work


@dataclass(frozen=True)
class Measurement:
    """One rank's timing of one case (a layout, a context, a format, a batch)."""

    rank: int
    layout: str
    dp_index: int
    tp_index: int
    context: int
    impl: str
    batch: int
    s_q: int
    heads: int  # query heads on this rank
    layers: int
    step_s: float
    kernel: str
    graphed: bool
    t_min_s: float | None = None
    note: str = ""
    device: str = ""
    spread: float | None = None  # StepTiming.spread (None in reports written before it)
    bf16_t_min_s: float | None = None  # StepTiming.bf16_t_min_s

    @property
    def work(self) -> DecodeWork:
        return DecodeWork(self.batch, self.s_q, self.heads, self.context, causal=True)  # the step decodes causally

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.s_q / self.step_s

    @property
    def us_per_layer(self) -> float:
        return 1e6 * self.step_s / self.layers

    @property
    def tflops(self) -> float:
        return self.layers * self.work.flops / self.step_s / 1e12

    @property
    def gbs(self) -> float:
        return self.layers * self.work.bytes(self.impl == FP8) / self.step_s / 1e9

    @property
    def roof_pct(self) -> float | None:
        return None if self.t_min_s is None else 100.0 * self.t_min_s / self.step_s

    @property
    def vs_bf16_roofline(self) -> float | None:
        """How many times faster than any BF16 kernel could run this step's decode work (the BF16
        roofline's time over this step's); FP8 steps only. Issue 7 quotes every FP8 speed-up
        against it too, since a weak BF16 baseline inflates the measured ratio."""
        return None if self.bf16_t_min_s is None else self.bf16_t_min_s / self.step_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, us_per_layer=self.us_per_layer,
                 tflops=self.tflops, gbs=self.gbs, roof_pct=self.roof_pct,
                 vs_bf16_roofline=self.vs_bf16_roofline)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Measurement:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class CaseResult:
    """One case over all ranks of a layout."""

    layout: Layout
    context: int
    impl: str
    kernel: str
    batch: int  # per DP group
    s_q: int
    heads: int  # per rank
    layers: int
    group_step_s: tuple[float, ...]  # per DP group: its slowest TP rank
    aggregate_tokens_per_s: float
    step_s: float  # mean over ranks
    us_per_layer: float  # mean over ranks
    tflops: float  # sum over ranks
    gbs: float  # sum over ranks
    roof_pct: float | None  # mean over ranks
    graphed: bool  # every rank replayed a CUDA graph
    notes: tuple[str, ...] = ()
    spread: float | None = None  # the largest rank's spread (None if a rank has none)
    vs_bf16_roofline: float | None = None  # mean over ranks (None if a rank has none)

    @property
    def per_gpu_tokens_per_s(self) -> float:
        return self.aggregate_tokens_per_s / self.layout.world

    def to_dict(self) -> dict:
        """The fields, the layout by name, and the per-GPU figures the table shows beside the
        sums over ranks (``tflops`` and ``gbs`` are sums; the table's columns are per GPU)."""
        d = asdict(self)
        d["layout"] = self.layout.name
        d["per_gpu_tokens_per_s"] = self.per_gpu_tokens_per_s
        d["tflops_per_gpu"] = self.tflops / self.layout.world
        d["gbs_per_gpu"] = self.gbs / self.layout.world
        return d


def _if_every_rank(values: Iterable[float | None], ranks: int, combine: Callable[[list[float]], float]) -> float | None:
    """``combine`` of the ranks' values, or None where a rank has none (no ceilings, a BF16 step,
    a report written before the field): a case figure must not stand for only some ranks."""
    known = [v for v in values if v is not None]
    return combine(known) if len(known) == ranks else None


def aggregate(layout: Layout, rows: list[Measurement]) -> CaseResult:
    """Combine one case's measurements, one per rank of ``layout``."""
    if not rows:
        raise SnapmlaError(f"{layout.name}: no measurements to combine")
    ranks = sorted(m.rank for m in rows)
    if ranks != list(range(layout.world)):
        raise SnapmlaError(f"{layout.name}: expected one result from each of ranks 0..{layout.world - 1}, got {ranks}")
    first = rows[0]
    groups: dict[int, list[Measurement]] = {}
    for m in rows:
        groups.setdefault(m.dp_index, []).append(m)
    if sorted(groups) != list(range(layout.dp)) or any(len(g) != layout.tp for g in groups.values()):
        raise SnapmlaError(f"{layout.name}: ranks do not form {layout.dp} DP groups of {layout.tp}")
    group_step = tuple(max(m.step_s for m in groups[i]) for i in range(layout.dp))
    aggregate_tps = sum(groups[i][0].batch * groups[i][0].s_q / t for i, t in enumerate(group_step))
    kernels = sorted({m.kernel for m in rows})
    return CaseResult(
        layout=layout, context=first.context, impl=first.impl, kernel="/".join(kernels),
        batch=first.batch, s_q=first.s_q, heads=first.heads, layers=first.layers,
        group_step_s=group_step, aggregate_tokens_per_s=aggregate_tps,
        step_s=statistics.fmean(m.step_s for m in rows),
        us_per_layer=statistics.fmean(m.us_per_layer for m in rows),
        tflops=sum(m.tflops for m in rows), gbs=sum(m.gbs for m in rows),
        roof_pct=_if_every_rank((m.roof_pct for m in rows), len(rows), statistics.fmean),
        graphed=all(m.graphed for m in rows),
        notes=tuple(dict.fromkeys(m.note for m in rows if m.note)),
        spread=_if_every_rank((m.spread for m in rows), len(rows), max),
        vs_bf16_roofline=_if_every_rank((m.vs_bf16_roofline for m in rows), len(rows), statistics.fmean),
    )


def speedup(fp8: CaseResult, bf16: CaseResult) -> float:
    """FP8's decode throughput over BF16's (all GPUs of the layout)."""
    return fp8.aggregate_tokens_per_s / bf16.aggregate_tokens_per_s


@dataclass(frozen=True)
class Comparison:
    """FP8 against BF16 for one (layout, context): at the same batch, and at the same KV memory
    (each format at the batch the budget holds) when a budget is set."""

    layout: Layout
    context: int
    fp8: CaseResult
    bf16: CaseResult
    fp8_mem: CaseResult | None = None
    bf16_mem: CaseResult | None = None

    @property
    def speedup_equal_batch(self) -> float:
        return speedup(self.fp8, self.bf16)

    @property
    def equal_memory(self) -> tuple[CaseResult, CaseResult] | None:
        """(FP8, BF16) at the same KV memory, or None without a budget."""
        if self.fp8_mem is None or self.bf16_mem is None:
            return None
        return self.fp8_mem, self.bf16_mem

    @property
    def speedup_equal_memory(self) -> float | None:
        if (pair := self.equal_memory) is None:
            return None
        return speedup(*pair)

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.name,
            "context": self.context,
            "equal_batch": {"fp8": self.fp8.to_dict(), "bf16": self.bf16.to_dict(),
                            "speedup": self.speedup_equal_batch},
            "equal_memory": None if (pair := self.equal_memory) is None else {
                "fp8": pair[0].to_dict(), "bf16": pair[1].to_dict(),
                "speedup": self.speedup_equal_memory},
        }


def compare(plan: BenchPlan, measurements: list[Measurement]) -> list[Comparison]:
    """Every (layout, context) of the plan, from all ranks' measurements."""
    by_case: dict[tuple[str, int, str, int], list[Measurement]] = {}
    for m in measurements:
        by_case.setdefault((m.layout, m.context, m.impl, m.batch), []).append(m)

    def case(layout: Layout, ctx: int, impl: str, batch: int) -> CaseResult:
        rows = by_case.get((layout.name, ctx, impl, batch))
        if rows is None:
            raise SnapmlaError(f"{layout.name} ctx {ctx}: no {impl} result at batch {batch}")
        return aggregate(layout, rows)

    out = []
    for layout in plan.layouts:
        for ctx in plan.contexts:
            b = plan.batches(ctx)
            mem = b.equal_memory
            out.append(Comparison(
                layout, ctx, case(layout, ctx, FP8, b.equal), case(layout, ctx, BF16, b.equal),
                None if mem is None else case(layout, ctx, FP8, mem[0]),
                None if mem is None else case(layout, ctx, BF16, mem[1]),
            ))
    return out


@dataclass
class BenchReport:
    """Everything rank 0 knows after the gather: the plan, the raw per-rank measurements and
    the comparisons; ``meta`` holds the machine facts (devices, backend, launcher)."""

    plan: BenchPlan
    measurements: list[Measurement]
    meta: dict = field(default_factory=dict)

    @property
    def comparisons(self) -> list[Comparison]:
        return compare(self.plan, self.measurements)

    @property
    def notes(self) -> list[str]:
        notes = list(dict.fromkeys(m.note for m in self.measurements if m.note))
        notes += self.plan.capped_fp8_notes()
        noisy = [m for m in self.measurements if m.spread is not None and m.spread > NOISY_SPREAD]
        for fake, cause in ((False, GPU_NOISE_CAUSE), (True, CPU_FAKE_NOISE_CAUSE)):
            group = [m for m in noisy if (m.kernel == CPU_FAKE_KERNEL) == fake]
            if group:
                notes.append(self._noisy_note(group, cause))
        return notes

    def _noisy_note(self, noisy: list[Measurement], cause: str) -> str:
        """The note on the ``noisy`` measurements (rounds apart by more than NOISY_SPREAD): how
        many, the worst, and ``cause``, which differs for the CPU stand-in's (see GPU_NOISE_CAUSE)."""
        worst = max(noisy, key=lambda m: m.spread or 0.0)
        return (f"the timed rounds of {len(noisy)} of {len(self.measurements)} measurements differ by more "
                f"than {NOISY_SPREAD:.0%} (most: {format_spread(worst.spread)}, {worst.layout} ctx "
                f"{format_size(worst.context)} {worst.impl} batch {worst.batch} on rank {worst.rank}): {cause}")

    def to_dict(self) -> dict:
        plan = asdict(self.plan)
        plan["layouts"] = [layout.name for layout in self.plan.layouts]
        return {
            **report_header(BENCH_JSON_FORMAT),
            "plan": plan,
            "meta": self.meta,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "measurements": [m.to_dict() for m in self.measurements],
            "notes": self.notes,
        }
