"""The FP8 heuristic's small-work rule (``decode_config.heuristic_for_work``): 64-row tiles with
too few pages per SM run as 32 or 16-row tiles. The expected tiles are the fastest of the three
measured on both the H100 and the H200 (scripts/ab_small_work.py, docs/PERF.md, forty-fifth
session) where the two GPUs agree; the rule must also leave every shape of the decode issues'
sweep (b 64) and every call of unknown work to the rows-only heuristic, which the shipped b 64
database entries were timed against. CPU only."""

from __future__ import annotations

import pytest
import torch

from snapmla_cli.ops.config_choice import choose_config, metadata_plan
from snapmla_cli.ops.decode import get_mla_metadata
from snapmla_cli.ops.decode_config import (
    FP8_MMA_SYNC,
    FP8_WGMMA,
    heuristic_config,
    heuristic_for_work,
    small_work_row_groups,
)
from snapmla_cli.ops.schedule import build_metadata
from snapmla_cli.tuning import lookup
from snapmla_cli.tuning.space import Bucket, default_config

SMS = 132  # the H100 SXM and the H200
CPU = torch.device("cpu")

# (rows, batch, context, row groups of the fastest tile on both GPUs)
MEASURED_FASTEST = [
    (64, 1, 4096, 1), (64, 1, 8192, 1), (64, 1, 16384, 1), (64, 1, 65536, 2),
    (64, 4, 4096, 2), (64, 4, 8192, 2),
    (128, 1, 4096, 1), (128, 1, 16384, 2), (128, 1, 65536, 4),
    (128, 4, 8192, 4), (128, 4, 16384, 4),
    (256, 1, 4096, 2), (256, 1, 8192, 2), (256, 1, 16384, 4), (256, 4, 4096, 4), (256, 4, 8192, 4),
]


@pytest.mark.parametrize(("rows", "batch", "context", "groups"), MEASURED_FASTEST)
def test_the_rule_picks_the_tile_both_gpus_measured_fastest(rows: int, batch: int, context: int, groups: int):
    assert small_work_row_groups(rows, batch, context, SMS) == groups
    cfg = heuristic_for_work(rows, True, batch, context, SMS)
    assert cfg.row_groups == groups
    # a smaller tile runs the heuristic configuration of that many rows (alternate pages)
    assert cfg == (heuristic_config(rows) if groups == 4 else heuristic_config(16 * groups))


@pytest.mark.parametrize("rows", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("context", [16384, 32768, 65536, 131072])
def test_the_sweep_of_the_decode_issues_keeps_the_rows_only_heuristic(rows: int, context: int):
    """b 64: the shipped b 64 entries stay current (timed against this default)."""
    assert heuristic_for_work(rows, True, 64, context, SMS) == heuristic_config(rows)


@pytest.mark.parametrize("rows", [1, 16, 17, 32])
@pytest.mark.parametrize(("batch", "context"), [(1, 64), (1, 16384), (4, 4096), (128, 131072)])
def test_up_to_32_rows_the_rule_changes_nothing(rows: int, batch: int, context: int):
    assert heuristic_for_work(rows, True, batch, context, SMS) == heuristic_config(rows)


@pytest.mark.parametrize(("batch", "context"), [(None, 16384.0), (1, None), (None, None), (0, 16384.0)])
def test_unknown_work_keeps_the_rows_only_heuristic(batch, context):
    assert heuristic_for_work(64, True, batch, context, SMS) == heuristic_config(64)


def test_bf16_and_the_mma_sync_kernel_are_left_alone():
    assert heuristic_for_work(64, False, 1, 4096, SMS) == heuristic_config(64, False)
    assert heuristic_config(64).kernel_version == FP8_WGMMA
    assert heuristic_config(64, True, FP8_MMA_SYNC).kernel_version == FP8_MMA_SYNC


@pytest.mark.parametrize("rows", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_more_context_never_shrinks_the_tile(rows: int, batch: int):
    groups = [small_work_row_groups(rows, batch, 1024 * k, SMS) for k in range(1, 257)]
    assert groups == sorted(groups), groups
    assert groups[-1] == 4  # 256k tokens a request fill any GPU of 132 SMs


def test_fewer_sms_need_fewer_pages_for_a_64_row_tile():
    """The threshold is per SM: the same call keeps 64-row tiles on a GPU with fewer SMs."""
    assert small_work_row_groups(128, 1, 16384, SMS) == 2
    assert small_work_row_groups(128, 1, 16384, 66) == 4


def test_an_empty_context_counts_as_one_page():
    assert small_work_row_groups(64, 1, 0.0, SMS) == 1


@pytest.fixture
def no_database(isolated_tuning_dirs, monkeypatch):
    monkeypatch.setattr(lookup, "lookup_decode_config", lambda **kw: None)


def test_choose_config_without_an_entry_runs_the_rule(no_database):
    cfg = choose_config(64, True, CPU, 1, context=16384.0)
    assert cfg == heuristic_config(16).with_sms(cfg.split.num_sms)
    assert choose_config(64, True, CPU, 1) == heuristic_config(64).with_sms(cfg.split.num_sms)  # context unknown


def test_the_metadata_is_built_for_the_small_tile(no_database):
    """get_mla_metadata at b 1 16k, 64 rows: the work list of 16-row tiles, recorded as such."""
    lens = torch.tensor([16384], dtype=torch.int32)
    meta, splits = get_mla_metadata(lens, 64, 1)
    plan = metadata_plan(meta)
    assert plan is not None and plan.config.row_groups == 1 and plan.config.block_m == 16
    ref_meta, ref_splits = build_metadata(lens, 64, plan.config.block_m, plan.config.split)
    assert torch.equal(meta, ref_meta) and torch.equal(splits, ref_splits)


@pytest.mark.parametrize(("batch", "groups"), [(1, 1), (4, 2), (64, 4)])
def test_the_tuner_times_against_the_rule_at_the_bucket_shape(batch: int, groups: int):
    """A bucket's default (what its entry's speed-up is quoted against, and what makes a stored
    entry current) is the rule at the bucket's timed batch and context."""
    bucket = Bucket(64, 1, (batch, batch), (4096, 4096), "fp8")
    assert default_config(bucket, SMS).row_groups == groups
    assert default_config(bucket, SMS).split.num_sms == SMS
