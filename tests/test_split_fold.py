"""Where split requests are merged (ops/split_fold.py), decided on the host: the counters a work
list gets, which kernels use them, and what the combine still has to do. CPU only (the GPU
checks of the merge itself are tests/gpu/test_split_fold_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from snapmla_cli.ops.decode import get_mla_metadata, metadata_plan
from snapmla_cli.ops.decode_config import heuristic_config
from snapmla_cli.ops.split_fold import (
    MAX_FOLDED_SPLITS,
    MIN_ROW_TILE,
    Combine,
    combine_after,
    kernel_arrivals,
    plan_fold,
)
from snapmla_cli.runtime.nvrtc import kernel_dir

CPU = torch.device("cpu")


def test_counters_exist_only_where_a_request_is_split():
    fold = plan_fold([1, 1, 1], 128, CPU)
    assert fold.arrivals is None and fold.foldable and not fold.has_empty
    fold = plan_fold([3, 0, 1], 20, CPU)
    assert fold.arrivals is not None and fold.has_empty
    assert fold.arrivals.dtype == torch.int32 and fold.arrivals.shape == (3 * 2,)  # ceil(20 / 16) tiles
    assert int(fold.arrivals.abs().sum()) == 0


def test_counters_cover_the_smallest_row_tile():
    fold = plan_fold([2] * 5, 128, CPU)
    assert fold.arrivals is not None and fold.arrivals.numel() == 5 * 128 // MIN_ROW_TILE


def test_a_request_beyond_the_shared_memory_weights_is_not_foldable():
    assert plan_fold([MAX_FOLDED_SPLITS, 2], 16, CPU).foldable
    assert not plan_fold([MAX_FOLDED_SPLITS + 1, 2], 16, CPU).foldable


@pytest.mark.parametrize("splits,kernel_folds,arrivals,combine", [
    ([2, 1], True, True, Combine.NONE),            # the kernel merged everything
    ([2, 0], True, True, Combine.EMPTY_ONLY),      # ... but an empty request is the combine's
    ([2, 1], False, False, Combine.ALL),           # mma.sync: no fold
    ([65, 1], True, False, Combine.ALL),           # too many splits for the kernel's weights
    ([1, 1], True, False, Combine.NONE),           # nothing split: no counters, no combine
    ([1, 0], False, False, Combine.EMPTY_ONLY),
])
def test_the_combine_runs_only_for_what_the_kernel_left(splits, kernel_folds, arrivals, combine):
    fold = plan_fold(splits, 16, CPU)
    given = kernel_arrivals(fold, kernel_folds)
    assert (given is not None) == arrivals
    assert combine_after(fold, given) is combine


def test_a_work_list_without_a_plan_runs_the_whole_combine():
    assert kernel_arrivals(None, True) is None
    assert combine_after(None, None) is Combine.ALL


def test_get_mla_metadata_records_the_fold_of_its_work_list():
    lens = torch.tensor([0, 9000, 65, 4097], dtype=torch.int32)
    cfg = heuristic_config(32, True).with_sms(132)
    meta, num_splits = get_mla_metadata(lens, 32, 1, config=cfg)
    plan = metadata_plan(meta)
    assert plan is not None and plan.fold is not None
    counts = (num_splits[1:] - num_splits[:-1]).tolist()
    assert plan.fold.has_empty == (0 in counts) and plan.fold.has_empty
    assert (plan.fold.arrivals is not None) == (max(counts) > 1)
    assert metadata_plan(meta.clone()) is None  # a copy runs the combine


def test_kernel_limit_mirrors_the_host_limit():
    """The kernels keep a row tile's split weights in shared memory, kMaxFoldedSplits per row:
    the host must never fold more."""
    source = (kernel_dir() / "decode_common.cuh").read_text()
    match = re.search(r"constexpr int kMaxFoldedSplits = (\d+);", source)
    assert match and int(match.group(1)) == MAX_FOLDED_SPLITS
