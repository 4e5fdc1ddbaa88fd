"""The tuner's search loop (snapmla_cli/tuning/tuner.py) and the range parser
(snapmla_cli/tuning/space.py) at their boundaries: ties, resumes, phase-two order, range ends."""

from __future__ import annotations

from dataclasses import replace

import pytest

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.tuning.db import GpuKey
from snapmla_cli.tuning.space import (
    Bucket,
    Budget,
    config_id,
    parse_ranges,
    same_kernel,
    search_space,
)
from snapmla_cli.tuning.tuner import (
    EARLY_OUT,
    TIE_MARGIN,
    CheckResult,
    EntryInfo,
    PartialStore,
    Tuner,
    partial_path,
)

GPU = GpuKey("Audit GPU Z100", 132, (9, 0), 13)
INFO = EntryInfo("0.1.0", "snapmla tune", "k1", today="2026-12-01")


def small_space():
    return search_space(Bucket(64, 2, (1, 1), (4096, 4096), "fp8"), 132)


class Fake:
    """Every candidate correct; ``times`` by config id; records each timing's cutoff."""

    def __init__(self, times, interrupt_after=None):
        self.times, self.cutoffs, self.interrupt_after = times, [], interrupt_after

    def prepare(self, bucket):
        pass

    def release(self):
        pass

    def check(self, bucket, cfg):
        return CheckResult(True, "fake")

    def time(self, bucket, cfg, cutoff=None):
        if self.interrupt_after is not None and len(self.cutoffs) >= self.interrupt_after:
            raise KeyboardInterrupt
        cid = config_id(cfg, "fp8")
        self.cutoffs.append((cid, cutoff))
        return self.times[cid]


def distinct_times(space):
    return {cid: 1e-3 * (1.0 + ((i * 7919) % 1009) / 100) for i, cid in enumerate(space.ids())}


def test_a_candidate_exactly_tie_margin_faster_does_not_replace_the_default():
    """'None of the top few beats it by more than TIE_MARGIN': exactly the margin is a tie, and
    the heuristic's own configuration stays the bucket's answer."""
    space = small_space()
    ids = space.ids()
    rival = ids[7]
    times = {cid: 100.0 for cid in ids}
    times[rival] = 50.0
    times[ids[0]] = 50.0 * (1 + TIE_MARGIN)  # the tuner's own product: equal, not a float's hair off
    result = Tuner(Fake(times), Budget(count=1000), INFO).tune(space)
    assert result.best.cid == ids[0]


def test_a_resumed_run_gives_the_early_out_the_reused_best_time(tmp_path):
    """Resumed, the times read back from the partial file are the best so far: the next candidate
    gets EARLY_OUT times the fastest of them as its cutoff, as it would have in one run."""
    space = small_space()
    times = distinct_times(space)
    path = partial_path(tmp_path, GPU)
    first = Fake(times, interrupt_after=4)
    with pytest.raises(KeyboardInterrupt):
        Tuner(first, Budget(count=1000), INFO, partial=PartialStore(path, GPU, "k1"), confirm_rounds=0).tune(space)
    reused_best = min(times[cid] for cid, _ in first.cutoffs)
    second = Fake(times)
    Tuner(second, Budget(count=1000), INFO, partial=PartialStore(path, GPU, "k1"), confirm_rounds=0).tune(space)
    cid, cutoff = second.cutoffs[0]
    assert cid not in {c for c, _ in first.cutoffs}  # a new candidate, not a reused one
    assert cutoff == pytest.approx(EARLY_OUT * reused_best)


def test_phase_two_ranks_a_kernel_by_its_fastest_time():
    """The prior (a stored entry's configuration) may share the default's kernel: that kernel then
    has two phase-1 times, and its split policies come first in phase two when its fastest time
    (the prior's) is the best of all kernels, however slow the default was."""
    space = small_space()
    default = space.default
    prior = next(c for c in space.candidates[1:] if same_kernel(c, default))
    seeded = replace(space, prior=prior)
    leading, firsts = [default, prior], []
    for cfg in space.candidates[1:]:
        if cfg != prior and not any(same_kernel(cfg, f) for f in leading + firsts):
            firsts.append(cfg)
    assert any(same_kernel(c, default) and c not in (default, prior) for c in space.candidates)
    times = {cid: 2e-3 for cid in space.ids()}
    for i, cfg in enumerate(firsts):
        times[config_id(cfg, "fp8")] = 1e-3 * (1 + i / 1000)
    times[config_id(default, "fp8")] = 5e-3
    times[config_id(prior, "fp8")] = 0.5e-3
    budget = Budget(count=1 + len(firsts) + 1)  # the prior, phase one, then one of phase two
    result = Tuner(Fake(times), budget, INFO, confirm_rounds=0).tune(seeded)
    phase_two_first = result.measured[-1].config
    assert phase_two_first not in (default, prior, *firsts)
    assert same_kernel(phase_two_first, default)


@pytest.mark.parametrize("text", ["17-16", "65-64", "16k-16383"])
def test_a_range_that_ends_one_below_its_start_runs_backwards(text):
    with pytest.raises(SnapmlaError, match="runs backwards"):
        parse_ranges(text, "--batch")
