"""Where split requests are merged (ops/split_fold.py), decided on the host: the counters a work
list gets, which kernels use them, and what the combine still has to do. CPU only (the GPU
checks of the merge itself are tests/gpu/test_split_fold_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.ops.decode import get_mla_metadata, metadata_plan
from snapmla_cli.ops.decode_config import heuristic_config
from snapmla_cli.ops.schedule import MAX_SPLITS_PER_REQUEST, SplitPolicy
from snapmla_cli.ops.split_fold import (
    COMBINE_ONE_ROW_MAX_ROWS,
    FOLD_MAX_PARTIAL_ROWS,
    MAX_FOLDED_SPLITS,
    MIN_ROW_TILE,
    CombineRun,
    combine_after,
    combine_rows_per_cta,
    fold_limit,
    kernel_arrivals,
    kernel_fold_limit,
    plan_fold,
)
from snapmla_cli.runtime.nvrtc import kernel_dir

CPU = torch.device("cpu")


def test_the_fold_limit_bounds_what_one_cta_reads():
    assert [fold_limit(t) for t in (16, 32, 64)] == [8, 4, 2]
    for tile in (1, 8, 16, 20, 48, 64, 128, 1000):
        limit = fold_limit(tile)
        assert 2 <= limit <= MAX_FOLDED_SPLITS
        assert limit * tile <= FOLD_MAX_PARTIAL_ROWS or limit == 2


def test_counters_exist_only_where_a_request_is_folded():
    fold = plan_fold([1, 1, 1], 128, 64, CPU)
    assert fold.arrivals is None and not fold.combine_left
    fold = plan_fold([3, 0, 1], 20, 16, CPU)
    assert fold.arrivals is not None and fold.combine_left  # the empty request
    assert fold.arrivals.dtype == torch.int32 and fold.arrivals.shape == (3 * 2,)  # ceil(20 / 16) tiles
    assert int(fold.arrivals.abs().sum()) == 0
    fold = plan_fold([64, 1], 64, 64, CPU)  # split beyond the limit only: the combine's
    assert fold.arrivals is None and fold.combine_left and fold.max_splits == 2


def test_counters_cover_the_smallest_row_tile():
    fold = plan_fold([2] * 5, 128, 64, CPU)
    assert fold.arrivals is not None and fold.arrivals.numel() == 5 * 128 // MIN_ROW_TILE


def test_the_limit_follows_the_tile_or_the_rows_if_fewer():
    assert plan_fold([2], 16, 64, CPU).max_splits == fold_limit(16)
    assert plan_fold([2], 128, 64, CPU).max_splits == fold_limit(64)


@pytest.mark.parametrize("splits,kernel_folds,arrivals,combine", [
    ([2, 1], True, True, None),                  # the kernel merged everything
    ([2, 0], True, True, CombineRun(2)),         # ... but an empty request is the combine's
    ([2, 5], True, True, CombineRun(2)),         # ... and one beyond the limit
    ([2, 1], False, False, CombineRun(0)),       # mma.sync: no fold
    ([5, 1], True, False, CombineRun(0)),        # nothing within the limit: no counters
    ([1, 1], True, False, None),                 # nothing split: no counters, no combine
    ([1, 0], False, False, CombineRun(0)),
])
def test_the_combine_runs_only_for_what_the_kernel_left(splits, kernel_folds, arrivals, combine):
    fold = plan_fold(splits, 64, 64, CPU)
    given = kernel_arrivals(fold, kernel_folds)
    assert (given is not None) == arrivals
    assert combine_after(fold, given) == combine
    assert kernel_fold_limit(fold, given) == (fold.max_splits if arrivals else 0)


def test_a_work_list_without_a_plan_runs_the_whole_combine():
    assert kernel_arrivals(None, True) is None
    assert combine_after(None, None) == CombineRun(0)


def test_get_mla_metadata_records_the_fold_of_its_work_list():
    lens = torch.tensor([0, 9000, 65, 4097], dtype=torch.int32)
    cfg = heuristic_config(32, True).with_sms(132)
    meta, num_splits = get_mla_metadata(lens, 32, 1, config=cfg)
    plan = metadata_plan(meta)
    assert plan is not None and plan.fold is not None
    counts = (num_splits[1:] - num_splits[:-1]).tolist()
    assert plan.fold.combine_left and plan.fold.max_splits == fold_limit(cfg.block_m)
    assert (plan.fold.arrivals is not None) == any(1 < n <= plan.fold.max_splits for n in counts)
    assert metadata_plan(meta.clone()) is None  # a copy runs the combine


def test_the_combine_takes_a_cta_per_row_for_few_rows():
    assert combine_rows_per_cta(64) == 1 and combine_rows_per_cta(COMBINE_ONE_ROW_MAX_ROWS) == 1
    assert combine_rows_per_cta(COMBINE_ONE_ROW_MAX_ROWS + 1) == 4


def test_a_policy_cannot_cut_a_request_finer_than_the_combine_holds():
    SplitPolicy(max_splits_per_request=MAX_SPLITS_PER_REQUEST)
    for bad in (0, MAX_SPLITS_PER_REQUEST + 1):
        with pytest.raises(SnapmlaError, match="max_splits_per_request"):
            SplitPolicy(max_splits_per_request=bad)


@pytest.mark.parametrize("source,constant,host", [
    ("decode_common.cuh", "kMaxFoldedSplits", MAX_FOLDED_SPLITS),
    ("combine.cu", "kMaxSplits", MAX_SPLITS_PER_REQUEST),
])
def test_kernel_limits_mirror_the_host_limits(source, constant, host):
    """The fold keeps a row tile's split weights in shared memory (kMaxFoldedSplits per row), the
    combine a row's (kMaxSplits): the host must never plan more."""
    text = (kernel_dir() / source).read_text()
    match = re.search(rf"constexpr int {constant} = (\d+);", text)
    assert match and int(match.group(1)) == host
