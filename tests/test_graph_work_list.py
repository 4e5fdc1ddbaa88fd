"""The fixed-shape work list for CUDA graphs (ops/graph_work_list.py, schedule.graph_capacity) on
the CPU: every batch fits its capacity, the planned items cover every block once with the slots
the combine expects, the places past the plan are empty, the tensors keep their identity and
shape from step to step, and the recorded plan makes one captured launch sequence right for
every step (the combine always runs after the fold)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.ops.config_choice import metadata_plan
from snapmla_cli.ops.decode_config import heuristic_config
from snapmla_cli.ops.graph_work_list import GraphWorkList
from snapmla_cli.ops.schedule import (
    GRAPH_EXTRA_WAVES,
    SplitPolicy,
    build_metadata,
    graph_capacity,
    graph_work_tables,
)
from snapmla_cli.ops.split_fold import fold_limit

PAGE = 64


def _random_lengths(rng: random.Random, batch: int) -> list[int]:
    kind = rng.choice(["mixed", "equal", "tiny", "one long"])
    if kind == "equal":
        return [rng.randint(0, 300000)] * batch
    if kind == "tiny":
        return [rng.randint(0, 130) for _ in range(batch)]
    if kind == "one long":
        return [rng.randint(0, 64) for _ in range(batch - 1)] + [rng.randint(1, 1 << 20)]
    return [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 300000)]) for _ in range(batch)]


def _check_tables(seqlens: list[int], work, cumulative, capacity: int) -> int:
    """Every block of every request once, in contiguous splits; the partial slots of split
    requests num_splits[i] + s in block order, -1 for one split; the empty places (0, 0, 0,
    capacity - 1) after the plan's items. Returns the plan's items."""
    assert work.shape == (capacity, 1, 4)
    items = work.reshape(-1, 4).tolist()
    real = [item for item in items if item[2] > item[1]]
    assert items[:len(real)] == real  # the plan first, the empty places after it
    assert all(item == [0, 0, 0, capacity - 1] for item in items[len(real):])
    counts = [cumulative[i + 1] - cumulative[i] for i in range(len(seqlens))]
    for req, n in enumerate(seqlens):
        mine = sorted((b, e, slot) for r, b, e, slot in real if r == req)
        assert len(mine) == counts[req]
        blocks = (n + PAGE - 1) // PAGE
        if blocks == 0:
            assert mine == []
            continue
        assert mine[0][0] == 0 and mine[-1][1] == blocks
        assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))
        slots = [slot for _b, _e, slot in mine]
        assert slots == ([-1] if len(mine) == 1 else list(range(cumulative[req], cumulative[req + 1])))
    return len(real)


@pytest.mark.parametrize("seed", range(6))
def test_every_batch_fits_the_capacity(seed):
    rng = random.Random(seed)
    for _ in range(25):
        batch = rng.randint(1, 160)
        seqlens = _random_lengths(rng, batch)
        rows, block_m = rng.choice([(16, 16), (32, 32), (64, 64), (128, 64), (256, 64)])
        policy = SplitPolicy(ctas_per_sm=rng.choice([1, 2]), waves=rng.choice([1, 2]),
                             min_blocks_per_split=rng.choice([1, 2, 4, 16]),
                             max_splits_per_request=rng.choice([4, 64, 256]))
        longest_blocks = (max(seqlens) + PAGE - 1) // PAGE
        for max_blocks in (None, longest_blocks, longest_blocks + rng.randint(0, 99)):
            capacity = graph_capacity(batch, rows, block_m, policy, max_blocks)
            work, cumulative, splits = graph_work_tables(seqlens, rows, block_m, policy, capacity)
            assert len(splits) == batch and cumulative.shape == (batch + 1,)
            _check_tables(seqlens, work, cumulative.tolist(), capacity)


def test_the_unrestricted_plan_is_kept_where_it_fits():
    """Where the planner's best plan fits the capacity it is the plan get_mla_metadata builds."""
    policy = SplitPolicy()
    for seqlens, rows in (([16384] * 64, 64), ([5000, 64, 0, 777, 20000], 32), ([131072] * 8, 128),
                          ([16384] * 80, 64)):
        block_m = min(64, rows)
        capacity = graph_capacity(len(seqlens), rows, block_m, policy)
        work, cumulative, _ = graph_work_tables(seqlens, rows, block_m, policy, capacity)
        ref, ref_splits = build_metadata(torch.tensor(seqlens, dtype=torch.int32), rows, block_m, policy)
        assert ref.shape[0] <= capacity
        real = _check_tables(seqlens, work, cumulative.tolist(), capacity)
        assert torch.equal(torch.from_numpy(work[:real]), ref) and cumulative.tolist() == ref_splits.tolist()


def test_plans_that_do_not_fit_are_skipped():
    """80 requests of 16k on 132 SMs: the best plan is three splits each (240 items, two waves);
    in 212 places (the policy's one wave of 132 plus a split per request, the least a capacity
    may be) the planner takes the one-wave plan, which always fits; fewer places than requests
    cannot hold a plan."""
    policy = SplitPolicy()
    seqlens = [16384] * 80
    assert build_metadata(torch.tensor(seqlens, dtype=torch.int32), 64, 64, policy)[0].shape[0] == 240
    work, cumulative, _ = graph_work_tables(seqlens, 64, 64, policy, 80 + 132)
    assert _check_tables(seqlens, work, cumulative.tolist(), 212) == 80
    assert graph_capacity(80, 64, 64, policy) == 80 + 132 * (1 + GRAPH_EXTRA_WAVES)
    with pytest.raises(SnapmlaError, match="too small"):
        graph_work_tables(seqlens, 64, 64, policy, 79)


def test_update_rewrites_the_same_tensors():
    work = GraphWorkList(5, 32, "cpu", config=heuristic_config(32))
    meta, splits = work.metadata, work.num_splits
    first = work.update(torch.tensor([5000, 64, 0, 777, 20000], dtype=torch.int32))
    assert first[0] is meta and first[1] is splits
    before = meta.clone()
    second = work.update(torch.tensor([64, 64, 64, 64, 64], dtype=torch.int32))
    assert second[0] is meta and meta.shape == before.shape and not torch.equal(meta, before)
    assert splits.tolist() == [0, 1, 2, 3, 4, 5]


def test_the_recorded_plan_runs_the_combine_after_the_fold():
    """The plan recorded for the fixed tensors: the split plan's configuration (balanced columns
    or the planner's choice settled to the split plan), counters for every request and row
    tile, the fold's limit, and the combine always launched (combine_left)."""
    auto = heuristic_config(64)
    assert auto.split.auto_balance  # the heuristic leaves the balance to the planner at 64 rows
    work = GraphWorkList(7, 64, "cpu", config=auto)
    plan = metadata_plan(work.metadata)
    assert plan is not None and plan.rows == 64 and plan.fp8 and plan.context is None
    assert plan.config == work.config and plan.requested == auto
    assert not work.config.split.balanced and not work.config.split.auto_balance
    assert plan.fold.combine_left and plan.fold.max_splits == fold_limit(64)
    assert plan.fold.arrivals.shape == (7 * 4,) and not plan.fold.arrivals.any()


def test_max_context_bounds_the_capacity():
    """One request of at most 16k tokens in chunks of at least 4 pages has at most 64 splits,
    whatever the GPU's size; a longer length than the work list was sized for is refused."""
    policy = SplitPolicy(ctas_per_sm=2, min_blocks_per_split=4)
    assert graph_capacity(1, 16, 16, policy) == policy.max_splits_per_request  # below 1 + 2 x 132 x 2
    assert graph_capacity(8, 16, 16, policy) == 8 + 2 * 132 * (1 + GRAPH_EXTRA_WAVES)
    assert graph_capacity(1, 16, 16, policy, max_blocks=256) == 64
    assert graph_capacity(3, 16, 16, policy, max_blocks=2) == 3  # a split each
    work = GraphWorkList(2, 16, "cpu", max_context=16384)
    work.update(torch.tensor([16384, 0], dtype=torch.int32))
    with pytest.raises(SnapmlaError, match="^cache_seqlens: a length of 16385 exceeds max_context=16384"):
        work.update(torch.tensor([16385, 0], dtype=torch.int32))
    with pytest.raises(SnapmlaError, match="^max_context: expected"):
        GraphWorkList(2, 16, "cpu", max_context=-1)



def test_a_max_context_past_a_page_boundary_counts_its_partial_page():
    """max_context 127 is two pages: with one-block splits each request may take two of them, so
    the capacity must be 2 per request (counting one page would make the plan not fit)."""
    cfg = heuristic_config(16)
    cfg = replace(cfg, split=replace(cfg.split, min_blocks_per_split=1))
    work = GraphWorkList(2, 16, "cpu", config=cfg, max_context=127)
    assert work.capacity == 4
    _, num_splits = work.update(torch.tensor([127, 127], dtype=torch.int32))
    assert num_splits.tolist() == [0, 2, 4]
    _check_tables([127, 127], work.metadata.numpy(), num_splits.tolist(), work.capacity)


def test_bad_arguments_get_one_line_errors():
    with pytest.raises(SnapmlaError, match="^batch: expected 1..2147483646 requests"):
        GraphWorkList(0, 16, "cpu")
    with pytest.raises(SnapmlaError, match="^num_heads_per_head_k: expected"):
        GraphWorkList(2, 0, "cpu")
    with pytest.raises(SnapmlaError, match="^device: expected a torch device"):
        GraphWorkList(2, 16, "tpu-7")
    work = GraphWorkList(2, 16, "cpu")
    with pytest.raises(SnapmlaError, match=r"^cache_seqlens: expected 2 lengths .* got 3"):
        work.update(torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(SnapmlaError, match="^cache_seqlens: expected int32"):
        work.update(torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(SnapmlaError, match="^cache_seqlens: expected a torch.Tensor"):
        work.update([1, 2])  # type: ignore[arg-type]
    with pytest.raises(SnapmlaError, match="^batch: expected 1..2147483646 requests .*2.5"):
        GraphWorkList(2.5, 16, "cpu")  # type: ignore[arg-type]


def test_a_short_update_and_a_zero_max_context_are_handled():
    """``update`` with fewer lengths than the batch it was sized for is refused (its tables would
    describe another batch); a ``max_context`` of 0 (requests without keys yet) is accepted and
    bounds the lengths at 0."""
    work = GraphWorkList(3, 16, "cpu")
    with pytest.raises(SnapmlaError, match=r"^cache_seqlens: expected 3 lengths .* got 2"):
        work.update(torch.tensor([17, 4000], dtype=torch.int32))
    empty = GraphWorkList(2, 16, "cpu", max_context=0)
    _, splits = empty.update(torch.zeros(2, dtype=torch.int32))
    assert splits.tolist() == [0, 0, 0]
    with pytest.raises(SnapmlaError, match="^cache_seqlens: a length of 5 exceeds max_context=0"):
        empty.update(torch.tensor([0, 5], dtype=torch.int32))
