"""The search loop of ``snapmla tune``, independent of the GPU.

Correctness and timing come from a :class:`Measurer` (the GPU one is
:class:`snapmla_cli.tuning.measure.GpuMeasurer`; tests inject fakes), the clock is injectable,
and the partial results of an interrupted run live in a JSON file (:class:`PartialStore`), so
that the selection, budget and resume logic is tested on the CPU.

Order per bucket: the heuristic default first (always measured), then the configuration of the
bucket's stored entry where there is one (``SearchSpace.prior``: a re-tune after a kernel change
keeps the former winner in any budget of one candidate or more), then every other kernel variant
with its own default split policy, then the remaining split policies, kernels in the order of
their first-phase times (the most promising kernel's policies first), so a budget cut keeps the
most useful measurements. A candidate must pass the correctness gate before it is timed; one
that fails is never stored. At the end the best few and the default are timed again,
interleaved, and those confirmation medians decide and are stored (no winner's curse from one
lucky measurement).
"""

from __future__ import annotations

import json
import math
import stat
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Protocol, cast

from ..cache.atomic import write_text_atomic
from ..errors import SnapmlaError
from ..ops.decode_config import DecodeConfig
from .db import Entry, GpuKey, db_filename, normalise_gpu_name, strip_sms
from .fields import finite_number, show
from .space import Bucket, Budget, SearchSpace, config_id, same_kernel

PARTIAL_FORMAT = "snapmla-tune-partial"
PARTIAL_VERSION = 1
EARLY_OUT = 1.5  # a candidate this many times slower than the best so far gets a rough time
# A candidate replaces the heuristic default only when its confirmation median is faster by more
# than this fraction: on the H200 two split plans the tuner's eager back-to-back calls put 0.9%
# and 1.6% ahead of the default were 3.8% and 4-7% behind it in CUDA-graph replays (the
# benchmark's timing, docs/PERF.md, fourteenth session), so smaller wins are not trusted. The
# default's split policy also settles per batch size, where a fixed winner at the timed batch
# would carry its plan to every batch size the entry serves. (The tuner now times graph replays
# at the boost clock, measure.TUNE_CLOCKS; calls over ~5 ms still cannot stay in that window.)
TIE_MARGIN = 0.02


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    detail: str = ""


class FatalMeasureError(SnapmlaError):
    """The GPU is unusable after a candidate (a sticky CUDA error): stop the run. The candidate
    is recorded as failed in the partial results, so running the command again resumes
    without it."""


class Measurer(Protocol):
    def prepare(self, bucket: Bucket) -> None:
        """The bucket's one-time setup (timing inputs, the correctness problems): done before
        the bucket's clock starts, so a seconds budget buys checks and timings only."""
        ...
    def check(self, bucket: Bucket, cfg: DecodeConfig) -> CheckResult: ...
    def time(self, bucket: Bucket, cfg: DecodeConfig, cutoff: float | None = None) -> float:
        """Seconds per call. Past ``cutoff`` seconds a rough estimate is enough (the candidate
        has lost already)."""
        ...
    def release(self) -> None: ...


@dataclass
class Measurement:
    cid: str
    config: DecodeConfig
    ok: bool
    time_s: float | None = None
    detail: str = ""
    reused: bool = False  # taken from the partial-results file

    def as_json(self) -> dict[str, Any]:
        return {"status": "ok" if self.ok else "failed", "time_s": self.time_s,
                "detail": self.detail}


@dataclass
class BucketResult:
    bucket: Bucket
    default: Measurement | None
    best: Measurement | None  # None: nothing passed the gate
    measured: list[Measurement]
    default_time_s: float | None = None  # confirmed
    best_time_s: float | None = None  # confirmed
    skipped: str = ""  # why nothing was measured (e.g. already in the database)
    entry: Entry | None = None
    notes: list[str] = field(default_factory=list)
    # wall seconds of this run's phases: the inputs and checks (not in --budget), the candidates,
    # the confirmation round; where a bucket's time goes beyond its budget
    phase_s: dict[str, float] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        if self.default_time_s and self.best_time_s:
            return self.default_time_s / self.best_time_s
        return None

    @property
    def failed(self) -> int:
        return sum(1 for m in self.measured if not m.ok)


# ---------------------------------------------------------------------------------------------
# partial results (resume)


def partial_path(folder: Path, gpu: GpuKey, device: str | None = None) -> Path:
    """Where a run's partial results live: one file per physical GPU (``device``: its UUID, where
    known). One `snapmla tune` per GPU of a node writes the same folder; with one file per GPU
    model each process's snapshot replaced the others' (a crash marker lost, another process's
    finished candidate turned back into "started"), and the measurements are the device's own."""
    stem = db_filename(gpu.name)[: -len(".yaml")]
    tag = f".{normalise_gpu_name(device)}" if device else ""
    return folder / f"{stem}{tag}.partial.json"


def _partial_problem(buckets: object) -> str | None:
    """Why the stored buckets cannot be resumed (None: they can). A hand-edited or corrupt file
    must not feed the search a NaN or negative time (the sort would pick a slower winner, the
    budget would never run out): every bucket is a mapping with finite elapsed seconds and
    results whose times, where given, are finite and positive."""
    if not isinstance(buckets, dict):
        return "buckets is not a mapping"
    for bucket_id, state in buckets.items():
        if not isinstance(state, dict) or not isinstance(state.get("results", {}), dict):
            return f"bucket {show(bucket_id)} is malformed"
        elapsed = finite_number(state.get("elapsed_s", 0.0))
        if elapsed is None or elapsed < 0:
            return f"bucket {show(bucket_id)}: elapsed_s is not a finite number >= 0"
        for cid, result in state.get("results", {}).items():
            if not isinstance(result, dict):
                return f"result {show(cid)} is malformed"
            t = result.get("time_s")
            seconds = finite_number(t)
            if t is not None and (seconds is None or seconds <= 0):
                return f"result {show(cid)}: time_s {t!r} is not a positive time"
    return None


class PartialStore:
    """``<db dir>/<GPU>.<GPU UUID>.partial.json`` (:func:`partial_path`): per bucket, every
    candidate measured so far (or started and never finished: a crash), and the tuning seconds
    spent. Keyed by the GPU key and the hash
    of the kernel sources; a file for another GPU or other kernels is ignored and replaced.
    Written atomically after every candidate; a bucket is dropped once its entry is saved."""

    def __init__(self, path: Path, gpu: GpuKey, kernels: str, resume: bool = True) -> None:
        self.path, self.gpu, self.kernels = path, gpu, kernels
        self.note = ""
        self.buckets: dict[str, dict[str, Any]] = {}
        if resume and path.exists():
            self._load()

    def _load(self) -> None:
        try:
            if not stat.S_ISREG(self.path.stat().st_mode):  # a fifo's read would never return
                raise OSError(f"{self.path} is not a regular file")
            data = json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError) as exc:
            self.note = (f"partial results {self.path} unreadable ({type(exc).__name__}); "
                         "starting over")
            return
        if not isinstance(data, dict) or data.get("format") != PARTIAL_FORMAT:
            self.note = f"partial results {self.path}: not a partial-results file; starting over"
            return
        if data.get("version") != PARTIAL_VERSION:
            self.note = (f"partial results {self.path}: version {data.get('version')!r}, this snapmla "
                         f"writes {PARTIAL_VERSION}; starting over")
            return
        if data.get("gpu") != self.gpu.as_dict() or data.get("kernels") != self.kernels:
            self.note = (f"partial results {self.path} are for another GPU or other kernel "
                         "sources; starting over")
            return
        buckets = data.get("buckets")
        problem = _partial_problem(buckets)
        if problem is not None:
            self.note = f"partial results {self.path}: {problem}; starting over"
            return
        self.buckets = cast(dict[str, dict[str, Any]], buckets)  # checked by _partial_problem

    def bucket(self, bucket_id: str) -> dict[str, Any]:
        state = self.buckets.setdefault(bucket_id, {"elapsed_s": 0.0, "results": {}})
        state.setdefault("results", {})
        state.setdefault("elapsed_s", 0.0)
        return state

    def results(self, bucket_id: str) -> dict[str, dict[str, Any]]:
        return self.bucket(bucket_id)["results"]

    def elapsed(self, bucket_id: str) -> float:
        value = self.bucket(bucket_id).get("elapsed_s", 0.0)
        return float(value) if isinstance(value, (int, float)) else 0.0

    def started(self, bucket_id: str, cid: str, elapsed: float) -> None:
        self.results(bucket_id)[cid] = {"status": "started"}
        self.bucket(bucket_id)["elapsed_s"] = elapsed
        self._write()

    def record(self, bucket_id: str, m: Measurement, elapsed: float) -> None:
        self.results(bucket_id)[m.cid] = m.as_json()
        self.bucket(bucket_id)["elapsed_s"] = elapsed
        self._write()

    def forget(self, bucket_id: str, cid: str) -> None:
        """Undo :meth:`started` (the user interrupted; not the candidate's fault)."""
        self.results(bucket_id).pop(cid, None)
        self._write()

    def finish(self, bucket_id: str) -> None:
        self.buckets.pop(bucket_id, None)
        if self.buckets:
            self._write()
        else:
            self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        payload = {"format": PARTIAL_FORMAT, "version": PARTIAL_VERSION,
                   "gpu": self.gpu.as_dict(), "kernels": self.kernels, "buckets": self.buckets}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(payload, indent=1, allow_nan=True) + "\n")


# ---------------------------------------------------------------------------------------------
# the loop


ProgressFn = Callable[[str, int, int], None]  # (description, done, total)


@dataclass
class EntryInfo:
    """Provenance written into each database entry."""

    snapmla_version: str
    command: str
    kernels: str = ""
    today: str = field(default_factory=lambda: date.today().isoformat())


class Tuner:
    def __init__(self, measurer: Measurer, budget: Budget, info: EntryInfo, *,
                 partial: PartialStore | None = None, clock: Callable[[], float] = time.monotonic,
                 confirm_top: int = 3, confirm_rounds: int = 3,
                 progress: ProgressFn | None = None) -> None:
        self.measurer, self.budget, self.info = measurer, budget, info
        self.partial, self.clock = partial, clock
        self.confirm_top, self.confirm_rounds = confirm_top, confirm_rounds
        self.progress = progress or (lambda desc, done, total: None)
        self._best: float | None = None

    def planned(self, space: SearchSpace) -> int:
        """Candidates the budget allows (default included), for the progress bar."""
        n = len(space.candidates)
        return n if self.budget.count is None else min(n, self.budget.count + 1)

    def likely_candidates(self, space: SearchSpace) -> list[DecodeConfig]:
        """The candidates worth compiling ahead: with a count budget the first ones in the
        static part of the order, else all (others still compile on first use)."""
        if self.budget.count is None:
            return list(space.candidates)
        order = list(self._order(space, {}))
        return order[: self.budget.count + 1]

    # ordering ------------------------------------------------------------------------------
    def _order(self, space: SearchSpace, done: dict[str, Measurement]) -> Iterator[DecodeConfig]:
        leading = [space.default] + ([space.prior] if space.prior is not None else [])
        firsts: list[DecodeConfig] = []  # one per kernel variant that leading does not cover
        rest: list[DecodeConfig] = []
        for cfg in space.candidates[1:]:
            if cfg == space.prior:
                continue
            (rest if any(same_kernel(cfg, f) for f in leading + firsts) else firsts).append(cfg)
        yield space.default
        if space.prior is not None:
            yield space.prior
        yield from firsts

        def kernel_rank(cfg: DecodeConfig) -> float:
            times = [m.time_s for m in done.values()
                     if m.ok and m.time_s is not None and same_kernel(m.config, cfg)]
            return min(times) if times else math.inf

        # the phase-1 times are all known once the generator resumes here
        order = sorted(range(len(rest)), key=lambda i: (kernel_rank(rest[i]), i))
        for i in order:
            yield rest[i]

    # one candidate -------------------------------------------------------------------------
    def _measure(self, bucket: Bucket, cfg: DecodeConfig, elapsed: Callable[[], float],
                 is_default: bool) -> Measurement:
        cid = config_id(cfg, bucket.format)
        prior = self.partial.results(bucket.id).get(cid) if self.partial else None
        if isinstance(prior, dict):
            status = prior.get("status")
            if status in ("ok", "failed"):
                t = prior.get("time_s")
                return Measurement(cid, cfg, status == "ok",
                                   float(t) if isinstance(t, (int, float)) else None,
                                   str(prior.get("detail", "")), reused=True)
            if status == "started" and not is_default:
                m = Measurement(cid, cfg, False, None,
                                "did not finish in an earlier run (crash?); skipped")
                if self.partial:
                    self.partial.record(bucket.id, m, elapsed())
                return m
        if self.partial:
            self.partial.started(bucket.id, cid, elapsed())
        try:
            m = self._run(bucket, cfg, cid, is_default)
        except FatalMeasureError as exc:
            if self.partial:
                if is_default:  # the baseline: timed again on resume, never reused as failed
                    self.partial.forget(bucket.id, cid)
                else:
                    self.partial.record(bucket.id, Measurement(cid, cfg, False, None, str(exc)),
                                        elapsed())
            raise
        except BaseException:
            if self.partial:
                self.partial.forget(bucket.id, cid)
            raise
        if self.partial:
            self.partial.record(bucket.id, m, elapsed())
        return m

    def _run(self, bucket: Bucket, cfg: DecodeConfig, cid: str, is_default: bool) -> Measurement:
        try:
            check = self.measurer.check(bucket, cfg)
        except FatalMeasureError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken candidate is a failed candidate
            check = CheckResult(False, f"check raised {type(exc).__name__}: {_first(exc)}")
        if not check.ok and not is_default:
            return Measurement(cid, cfg, False, None, check.detail)
        cutoff = None if is_default or self._best is None else EARLY_OUT * self._best
        try:
            t = float(self.measurer.time(bucket, cfg, cutoff=cutoff))
        except FatalMeasureError:
            raise
        except Exception as exc:  # noqa: BLE001
            return Measurement(cid, cfg, False, None, f"timing raised {type(exc).__name__}: "
                                                      f"{_first(exc)}")
        if not math.isfinite(t) or t <= 0:
            return Measurement(cid, cfg, False, None, f"timing returned {t!r}")
        if check.ok:
            self._best = t if self._best is None else min(self._best, t)
        # the default is timed even when it fails the gate (it is the baseline), never stored
        return Measurement(cid, cfg, check.ok, t, check.detail)

    # one bucket ----------------------------------------------------------------------------
    def tune(self, space: SearchSpace) -> BucketResult:
        bucket = space.bucket
        before = self.partial.elapsed(bucket.id) if self.partial else 0.0
        total = self.planned(space)
        self.progress(f"{bucket.label()}: preparing inputs and checks", 0, total)
        setup_start = self.clock()
        self.measurer.prepare(bucket)
        start = self.clock()  # after the setup: the budget is for the candidates

        def elapsed() -> float:
            return before + (self.clock() - start)

        done: dict[str, Measurement] = {}
        measured: list[Measurement] = []
        self._best = None
        try:
            default_m: Measurement | None = None
            counted = 0
            for cfg in self._order(space, done):
                is_default = cfg == space.default
                if not is_default and self._exhausted(counted, elapsed()):
                    break
                self.progress(f"{bucket.label()}: {config_id(cfg, bucket.format)}",
                              len(measured), total)
                m = self._measure(bucket, cfg, elapsed, is_default)
                measured.append(m)
                done[m.cid] = m
                if m.ok and m.time_s is not None and m.reused:
                    self._best = m.time_s if self._best is None else min(self._best, m.time_s)
                if is_default:
                    default_m = m
                else:
                    counted += 1
            self.progress(bucket.label(), len(measured), total)
            result = BucketResult(bucket, default_m, None, measured)
            if default_m is not None and not default_m.ok:
                result.notes.append(f"the heuristic default failed the correctness gate: "
                                    f"{default_m.detail}")
            confirm_start = self.clock()
            self._confirm(space, result)
            result.phase_s = {"setup": start - setup_start, "candidates": confirm_start - start,
                              "confirmation": self.clock() - confirm_start}
        finally:
            self.measurer.release()
        if result.best is not None and result.best_time_s and result.default_time_s:
            result.entry = Entry(
                bucket=bucket, config=strip_sms(result.best.config),
                time_us=result.best_time_s * 1e6, default_time_us=result.default_time_s * 1e6,
                date=self.info.today, snapmla_version=self.info.snapmla_version,
                command=self.info.command, default_config=strip_sms(space.default),
                kernels=self.info.kernels,
                timed_at={"batch": bucket.timed_batch, "context": bucket.timed_context},
                candidates=len(measured))
        return result

    def _exhausted(self, counted: int, elapsed: float) -> bool:
        if self.budget.count is not None:
            return counted >= self.budget.count
        return self.budget.seconds is not None and elapsed >= self.budget.seconds

    def _confirm(self, space: SearchSpace, result: BucketResult) -> None:
        """Re-time the best few and the default, interleaved; the medians decide."""
        ok = sorted((m for m in result.measured if m.ok and m.time_s is not None),
                    key=lambda m: m.time_s)  # type: ignore[arg-type, return-value]
        default = result.default
        if not ok or default is None or default.time_s is None:
            result.best = ok[0] if ok else None
            if ok:
                result.notes.append("no default timing to compare with; nothing stored")
            return
        top = ok[: self.confirm_top]
        contenders = top + ([default] if default.cid not in {m.cid for m in top} else [])
        samples: dict[str, list[float]] = {m.cid: [m.time_s] for m in contenders}  # type: ignore
        bucket = space.bucket
        unconfirmed: set[str] = set()  # a re-timing raised: its phase-1 time is not trusted
        for _ in range(self.confirm_rounds):
            for m in contenders:
                try:
                    samples[m.cid].append(float(self.measurer.time(bucket, m.config)))
                except FatalMeasureError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    result.notes.append(f"confirmation of {m.cid} failed: {_first(exc)}")
                    unconfirmed.add(m.cid)
        if default.cid in unconfirmed:
            result.notes.append("the default's re-timing failed; nothing stored")
            return
        top = [m for m in top if m.cid not in unconfirmed]
        if self.confirm_rounds > 0:  # the confirmation samples alone, taken back to back
            samples = {cid: v[1:] for cid, v in samples.items()}
        medians = {cid: statistics.median(v) for cid, v in samples.items() if v}
        # the default competes too: where none of the top few beats it on the confirmation
        # medians by more than TIE_MARGIN, the heuristic's own configuration is the bucket's
        # answer, so a stored entry is never slower than the default it was measured against
        # (a default that failed the correctness gate is timed as the baseline but never chosen)
        eligible = top + ([default] if default.ok and default.cid not in {m.cid for m in top} else [])
        if not eligible:
            result.notes.append("every contender's re-timing failed; nothing stored")
            return
        best = min(eligible, key=lambda m: (medians[m.cid], m.cid != default.cid, m.cid))
        if default.ok and medians[best.cid] * (1 + TIE_MARGIN) >= medians[default.cid]:
            best = default
        result.best = best
        result.best_time_s = medians[best.cid]
        result.default_time_s = medians[default.cid]


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
