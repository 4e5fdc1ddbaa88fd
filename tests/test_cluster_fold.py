"""The cluster merge's host side (ops/cluster_fold.py, runtime/cluster_launch.py): which work
lists can run as thread-block clusters, the order the planner gives them, which kernels take
them, what the combine still does, and the launch attribute's bytes. CPU only; the merge itself
is checked on the GPU in tests/gpu/test_split_fold_gpu.py."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.ops.cluster_fold import (
    CLUSTER_SIZES,
    holds_a_wave,
    planned_cluster,
    uniform_split_count,
    work_list_cluster,
)
from snapmla_cli.ops.decode import get_mla_metadata, metadata_plan
from snapmla_cli.ops.decode_config import (
    CLUSTER_ROW_STRIDE,
    balanced,
    cluster_capable,
    cluster_rows_fit,
    heuristic_config,
    variant_config,
)
from snapmla_cli.ops.schedule import SplitPolicy, build_work_list
from snapmla_cli.ops.split_fold import CombineRun, combine_after, plan_fold
from snapmla_cli.runtime import cluster_launch
from snapmla_cli.runtime.nvrtc import kernel_dir

CPU = torch.device("cpu")


def _work(lens: list[int], rows: int = 64, block_m: int = 64, **policy):
    return build_work_list(torch.tensor(lens, dtype=torch.int32), rows, block_m, SplitPolicy(num_sms=132, **policy))


def test_uniform_split_counts_of_a_cluster_size_only():
    assert uniform_split_count(np.array([2, 2, 0, 2])) == 2
    assert uniform_split_count(np.array([8] * 3)) == 8
    assert uniform_split_count(np.array([2, 3])) == 0
    assert uniform_split_count(np.array([1, 1])) == 0  # nothing to merge
    assert uniform_split_count(np.array([6, 6])) == 0  # 512 dims do not split into 6 (and 16 > 8)
    assert uniform_split_count(np.array([0, 0])) == 0
    assert CLUSTER_SIZES == (2, 4, 8)


@pytest.mark.parametrize("batch,context,n", [(64, 16384, 2), (64, 131072, 2), (32, 32768, 4), (16, 65536, 8),
                                             (1, 16384, 0), (64, 100, 0)])
def test_equal_requests_plan_clusters_of_their_splits(batch, context, n):
    work = _work([context] * batch)
    assert work.cluster == n
    if n:
        items = work.metadata[:, 0].numpy()
        assert (items[:, 0] == np.repeat(np.arange(batch), n)).all()  # side by side
        assert (items[:, 3] == np.arange(batch * n)).all()  # in split order: slot = rank


def test_mixed_split_counts_and_columns_plan_none():
    rng = np.random.default_rng(0)
    mixed = _work(rng.integers(1000, 40000, 64).tolist())
    assert len(set(mixed.splits_per_request)) > 1 and mixed.cluster == 0
    columns = build_work_list(torch.full((64,), 16384, dtype=torch.int32), 64, 64,
                              SplitPolicy(num_sms=132, balanced=True), runs_columns=True)
    assert columns.metadata.shape[1] > 1 and columns.cluster == 0


def test_the_table_itself_is_checked():
    work = _work([16384] * 64)
    table = work.metadata.numpy().copy()
    cumulative = work.num_splits.numpy()
    assert work_list_cluster(table, cumulative) == 2
    swapped = table.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # split 1 at rank 0
    assert work_list_cluster(swapped, cumulative) == 0
    shifted = np.roll(table, 1, axis=0)  # clusters across two requests
    assert work_list_cluster(shifted, cumulative) == 0
    emptied = table.copy()
    emptied[5, 0, 2] = emptied[5, 0, 1]  # a split without blocks
    assert work_list_cluster(emptied, cumulative) == 0
    assert work_list_cluster(table[:3], cumulative) == 0  # not whole clusters


def test_an_empty_request_keeps_the_cluster_and_the_combine_writes_it():
    work = _work([16384] * 63 + [0])
    assert work.cluster == 2 and work.splits_per_request[-1] == 0
    fold = plan_fold(work.splits_per_request, 64, 64, CPU, work.cluster)
    assert fold.cluster == 2 and fold.empty_requests
    # launched in clusters, the combine is left the empty request only
    assert combine_after(fold, fold.arrivals, 2) == CombineRun(2)
    full = plan_fold([4] * 8, 64, 64, CPU, 4)
    assert combine_after(full, full.arrivals, 4) is None  # 4 > the fold's limit of 2, still merged
    assert full.arrivals is None and combine_after(full, None, 0) == CombineRun(0)  # without: the combine's


def test_get_mla_metadata_records_the_cluster():
    lens = torch.full((64,), 32768, dtype=torch.int32)
    meta, _ = get_mla_metadata(lens, 64, 1, config=heuristic_config(64).with_sms(132))
    plan = metadata_plan(meta)
    assert plan is not None and plan.fold is not None and plan.fold.cluster == 2


def test_only_wgmma_kernels_with_one_item_per_cta_take_clusters(monkeypatch):
    for rows in (16, 32, 64, 128):
        assert cluster_capable(heuristic_config(rows), True)
        assert not cluster_capable(heuristic_config(rows, True, 2), True)  # mma.sync
        assert not cluster_capable(heuristic_config(rows, False, 2), False)
    assert cluster_capable(heuristic_config(64, False), False)  # the BF16 wgmma kernel, 2 stages of 72 KB
    assert not cluster_capable(heuristic_config(128, False), False)  # its 128-row default runs columns
    cfg = heuristic_config(64)
    assert not cluster_capable(balanced(cfg), True)  # its build runs columns
    two_stages = variant_config(64, stages=2)
    assert not cluster_rows_fit(two_stages)  # 64 x 521 floats need more than two stages
    assert 64 * (CLUSTER_ROW_STRIDE + 1) * 4 <= 4 * 41984 and cluster_rows_fit(cfg)
    assert planned_cluster(2, True) == 2 and planned_cluster(2, False) == 0 and planned_cluster(0, True) == 0
    monkeypatch.setenv("SNAPMLA_CLUSTER_FOLD", "0")
    assert planned_cluster(2, True) == 0


def test_host_constants_mirror_the_kernel():
    text = (kernel_dir() / "decode_common.cuh").read_text()
    stride = re.search(r"constexpr int kClusterRowStride = kDimV \+ (\d+);", text)
    assert stride and 512 + int(stride.group(1)) == CLUSTER_ROW_STRIDE
    largest = re.search(r"constexpr int kMaxClusterSplits = (\d+);", text)
    assert largest and int(largest.group(1)) == max(CLUSTER_SIZES)


def test_cluster_attribute_bytes():
    attr = cluster_launch.cluster_attribute((1, 4, 1))
    assert attr.id == cluster_launch.LAUNCH_ATTR_CLUSTER_DIMENSION == 4
    assert list((ctypes.c_uint * 3).from_buffer(attr.value)) == [1, 4, 1]


def test_a_grid_must_hold_whole_clusters():
    with pytest.raises(SnapmlaError, match=r"grid \(1, 3, 1\) is not a multiple of the cluster \(1, 2, 1\)"):
        cluster_launch.ClusterLaunch(0, (1, 3, 1), (384, 1, 1), 0, (1, 2, 1))


def test_ordering_keeps_longest_requests_first():
    lens = [16384] * 32 + [16384 + 64 * 40] * 32  # uneven pieces, two splits each
    work = _work(lens, max_splits_per_request=2)
    assert work.cluster == 2
    first_requests = work.metadata[:64:2, 0, 0].tolist()
    assert set(first_requests) == set(range(32, 64))  # the longer requests' clusters start first


def test_a_cluster_build_must_hold_the_plans_wave_not_the_whole_grid(monkeypatch) -> None:
    """``holds_a_wave`` compares the CTAs resident at once in clusters with what the plan runs at
    once: the split policy's slots, or the grid where it is smaller (a 264-CTA grid over 132
    slots needs 132 resident, not 264)."""
    resident = {"clusters": 66}
    monkeypatch.setattr(cluster_launch, "max_active_clusters", lambda *a: resident["clusters"])
    assert holds_a_wave(0, 2, (1, 264, 1), (384, 1, 1), 1024, 132)
    assert holds_a_wave(0, 2, (1, 100, 1), (384, 1, 1), 1024, 132) and holds_a_wave(0, 2, (2, 66, 1), (384, 1, 1), 1024, 132)
    resident["clusters"] = 65
    assert not holds_a_wave(0, 2, (1, 264, 1), (384, 1, 1), 1024, 132)
