"""The tuning lookup's selection (snapmla_cli/tuning/lookup.py) at its edges:
the low end of a bucket's range, the majority vote among tied entries, and the memo's clamp to
the end of a range that is not a power-of-two step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from snapmla_cli.ops.decode_config import DecodeConfig, heuristic_config
from snapmla_cli.tuning import db as tdb
from snapmla_cli.tuning import lookup
from snapmla_cli.tuning.db import Entry, GpuKey, save_entries
from snapmla_cli.tuning.space import Bucket, config_problem, kernel_variants

GPU = GpuKey("Audit GPU Z100", 132, (9, 0), 13)
VARIANTS = [c for c in kernel_variants(128, "fp8")[0]
            if replace(c, split=heuristic_config(128).split) != heuristic_config(128)]


def cfg(i: int) -> DecodeConfig:
    out = replace(VARIANTS[i], split=heuristic_config(128).split)
    assert config_problem(out, "fp8") is None
    return out


def entry(batch=(64, 64), context=(16384, 16384), config: DecodeConfig | None = None) -> Entry:
    return Entry(bucket=Bucket(64, 2, batch, context, "fp8"), config=config or heuristic_config(128),
                 time_us=100.0, default_time_us=120.0, date="2026-12-01", snapmla_version="0.1.0",
                 command="snapmla tune", default_config=heuristic_config(128), kernels="abc",
                 timed_at={"batch": batch[0], "context": context[0]}, candidates=3)


@pytest.fixture
def user(tmp_path, monkeypatch):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(user))
    monkeypatch.setattr(tdb, "shipped_dir", lambda: shipped)
    monkeypatch.setattr(lookup, "_device_key_hook", lambda index: GPU)
    lookup.clear_cache(reset_warnings=True)
    yield user
    lookup.clear_cache(reset_warnings=True)


def get(**kw):
    return lookup.lookup_decode_config(rows=128, fp8=True, device=torch.device("cuda", 0), **kw)


def test_a_value_at_the_low_end_of_a_range_is_inside_it(user):
    """batch 16 lies in the range 16-128 (distance 0), so a context two octaves off decides:
    the entry of the right context wins. Counting the low end as outside once gave the 16-128
    entry a negative distance (log2(16/128) = -3), which beat the nearer entry."""
    near, far = cfg(2), cfg(3)
    save_entries(user, GPU, [entry(batch=(16, 128), context=(65536, 65536), config=far),
                             entry(batch=(8, 8), context=(16384, 16384), config=near)])
    assert get(batch=16, context=16384) == near


def test_tied_entries_take_the_configuration_most_of_them_chose(user):
    """Context unknown: three context buckets tie. The first in sort order (the 128k bucket, by
    its id's text) chose one configuration, the other two another: the majority wins."""
    lone, shared = cfg(2), cfg(3)
    save_entries(user, GPU, [entry(context=(16384, 16384), config=shared),
                             entry(context=(65536, 65536), config=shared),
                             entry(context=(131072, 131072), config=lone)])
    assert get(batch=64) == shared


def test_rounding_stays_inside_a_range_that_ends_off_the_rounding_grid(user):
    """A context of 16,300 rounds (1/16 octave) up to 16,384, past the end of a 1-16300 range:
    the memo's clamp must keep it at 16,300, not move it to 16,301, the next range's start."""
    low, high = cfg(2), cfg(3)
    save_entries(user, GPU, [entry(context=(1, 16300), config=low),
                             entry(context=(16301, 32768), config=high)])
    assert get(batch=64, context=16300) == low
    assert get(batch=64, context=16301) == high


def test_a_clear_during_a_first_read_is_not_undone(user, monkeypatch):
    """A first lookup parses the files for about 0.1 s; `snapmla tune` (or an engine) calling
    clear_cache() after writing a new entry in that time had its clear undone by the lookup's
    late store, and the old answer stayed until the next clear."""
    old, new = cfg(2), cfg(3)
    save_entries(user, GPU, [entry(config=old)])
    real_load = lookup.load_located
    calls = []

    def load_then_rewrite(gpu):
        located = real_load(gpu)  # read before the rewrite ...
        if not calls:
            save_entries(user, GPU, [entry(config=new)], force=True)  # ... which lands, then clears
            lookup.clear_cache()
        calls.append(gpu)
        return located

    monkeypatch.setattr(lookup, "load_located", load_then_rewrite)
    assert get(batch=64, context=16384) == old  # (this call read the old file)
    assert get(batch=64, context=16384) == new  # the next one reads again
    assert len(calls) == 2
