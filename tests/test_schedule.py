"""The split-KV planner and work list (ops/schedule.py) on the CPU: the plans the tuning database
was timed with stay as they were, batches that do not divide the SM count get finer plans, and
the work list is consistent whatever its order."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.ops.schedule import (
    CTA_OVERHEAD_BLOCKS,
    EXTRA_WAVES,
    PARTIAL_BLOCKS_PER_ROW,
    SplitPolicy,
    _best_split_counts,
    balanced_columns,
    build_metadata,
    estimated_makespan,
    estimated_makespans,
    plan_splits,
    prefer_balanced,
    split_token_bounds,
    work_columns,
)

PAGE = 64


def one_wave_plan(seqlens: list[int], rows: int, block_m: int, policy: SplitPolicy) -> list[list[int]]:
    """The planner before it weighed finer plans: ``floor(blocks / chunk)`` splits with ``chunk``
    from the policy's waves alone (what the shipped tuning entries were timed with)."""
    blocks = [(n + PAGE - 1) // PAGE for n in seqlens]
    m_tiles = -(-rows // block_m)
    target = max(1, policy.num_sms * policy.ctas_per_sm * policy.waves // m_tiles)
    chunk = max(policy.min_blocks_per_split, -(-sum(blocks) // target))
    plans = []
    for nb in blocks:
        parts = min(max(1, nb // chunk), policy.max_splits_per_request, nb) if nb else 0
        plans.append([round(i * nb / parts) for i in range(parts + 1)] if parts else [])
    return plans


@pytest.mark.parametrize("batch", [64, 128])
@pytest.mark.parametrize("rows,block_m", [(16, 16), (32, 32), (64, 64), (128, 64), (256, 64)])
def test_tuned_batches_plan_as_the_database_was_timed(rows, block_m, batch):
    """b = 64 and 128 equal contexts (the tuned buckets): every policy the tuner searches plans
    exactly as before, so the shipped entries' times still describe the plans the decode runs."""
    for ctas, waves, min_blocks in itertools.product((1, 2), (1, 2), (2, 4, 8, 16)):
        policy = SplitPolicy(ctas_per_sm=ctas, waves=waves, min_blocks_per_split=min_blocks)
        for ctx in (16384, 32768, 65536, 131072):
            seqlens = [ctx] * batch
            assert plan_splits(seqlens, rows, block_m, policy) == one_wave_plan(seqlens, rows, block_m, policy)


def test_batch_80_takes_two_waves_of_three_splits():
    """80 requests of 256 blocks on 132 SMs: one split each leaves 52 SMs idle; three splits each
    (240 CTAs, two waves of 86 blocks) finish sooner, measured 1.2x on the H200."""
    policy = SplitPolicy()
    plans = plan_splits([16384] * 80, 64, 64, policy)
    assert all(len(b) - 1 == 3 for b in plans)
    assert one_wave_plan([16384] * 80, 64, 64, policy)[0] == [0, 256]
    blocks = np.full(80, 256)
    assert estimated_makespan(blocks, np.full(80, 3), 64, 1, 132) < estimated_makespan(blocks, np.ones(80, int), 64, 1, 132)


def test_makespan_counts_waves_of_the_longest_splits():
    """Uniform splits: waves x (split + CTA overhead); 132 slots take 132 splits a wave; one
    request in one split writes no partial output."""
    blocks = np.full(132, 100)
    one = estimated_makespan(blocks, np.ones(132, int), 64, 1, 132)
    assert one == 100 + CTA_OVERHEAD_BLOCKS
    two_waves = estimated_makespan(np.full(133, 100), np.ones(133, int), 64, 1, 132)
    assert two_waves == 2 * (100 + CTA_OVERHEAD_BLOCKS)
    # two row tiles per split: half as many splits per wave
    assert estimated_makespan(np.full(66, 100), np.ones(66, int), 128, 2, 132) == 100 + CTA_OVERHEAD_BLOCKS
    assert estimated_makespan(np.full(67, 100), np.ones(67, int), 128, 2, 132) == 2 * (100 + CTA_OVERHEAD_BLOCKS)
    # a request of 10 blocks in 3 splits: 4 + 3 + 3, and partial outputs cost something
    split = estimated_makespan(np.array([10]), np.array([3]), 64, 1, 132)
    assert 4 + CTA_OVERHEAD_BLOCKS < split < 4 + CTA_OVERHEAD_BLOCKS + 1


@pytest.mark.parametrize("seed", range(5))
def test_plans_cover_every_block_once(seed):
    rng = random.Random(seed)
    seqlens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 200000)]) for _ in range(rng.randint(1, 150))]
    for rows, block_m, ctas in ((16, 16, 2), (64, 64, 1), (128, 64, 1)):
        plans = plan_splits(seqlens, rows, block_m, SplitPolicy(ctas_per_sm=ctas))
        for n, bounds in zip(seqlens, plans):
            blocks = (n + PAGE - 1) // PAGE
            if blocks == 0:
                assert bounds == []
                continue
            assert bounds[0] == 0 and bounds[-1] == blocks
            assert all(a < b for a, b in itertools.pairwise(bounds))
            assert len(bounds) - 1 <= SplitPolicy().max_splits_per_request


def test_work_list_runs_longest_splits_first_and_keeps_the_slots():
    """The work list is ordered longest split first (the GPU starts CTAs in grid order); each
    request's partial slots are still num_splits[i] + split index in block order, and the token
    bounds come back in block order."""
    seqlens = [100 * PAGE, 7 * PAGE, 0, 3000 * PAGE + 5, 64]
    lens = torch.tensor(seqlens, dtype=torch.int32)
    work, num_splits = build_metadata(lens, 64, 64, SplitPolicy())
    assert work.shape[1:] == (1, 4)  # one item per column: the split plan
    items = work.reshape(-1, 4).tolist()
    sizes = [end - begin for _req, begin, end, _slot in items]
    assert sizes == sorted(sizes, reverse=True)
    cumulative = num_splits.tolist()
    for req in range(len(seqlens)):
        mine = sorted((begin, end, slot) for r, begin, end, slot in items if r == req)
        count = cumulative[req + 1] - cumulative[req]
        assert len(mine) == count
        if count > 1:
            assert [slot for _b, _e, slot in mine] == list(range(cumulative[req], cumulative[req + 1]))
        elif count == 1:
            assert mine[0][2] == -1
    bounds = split_token_bounds(num_splits, work, seqlens)
    for n, b in zip(seqlens, bounds):
        assert b[0] == 0 and b[-1] == n and b == sorted(b)


def _check_work_list(work: torch.Tensor, num_splits: torch.Tensor, seqlens: list[int]) -> list[list[list[int]]]:
    """Every block of every request in exactly one real item, each request's partial slots
    num_splits[i] + split index in block order (-1 alone), empty places after a column's real
    items with a slot no real item has. Returns the columns' real items."""
    columns = [[item for item in column if item[2] > item[1]] for column in work.tolist()]
    places = work.shape[0] * work.shape[1]
    real_slots = set()
    for column, raw in zip(columns, work.tolist()):
        assert column and raw[:len(column)] == column  # real items first, at least one
        for empty in raw[len(column):]:
            assert empty == [0, 0, 0, places - 1]
        real_slots.update(item[3] for item in column)
    if sum(map(len, columns)) < places:  # the empty places' scratch slot is nobody's
        assert places - 1 not in real_slots
    cumulative = num_splits.tolist()
    for req, n in enumerate(seqlens):
        mine = sorted((b, e, slot) for column in columns for r, b, e, slot in column if r == req)
        covered = [blk for b, e, _slot in mine for blk in range(b, e)]
        assert covered == list(range((n + PAGE - 1) // PAGE))
        assert len(mine) == cumulative[req + 1] - cumulative[req]
        slots = [slot for _b, _e, slot in mine]
        assert slots == ([-1] if len(mine) == 1 else list(range(cumulative[req], cumulative[req + 1])))
    bounds = split_token_bounds(num_splits, work, seqlens)
    for n, b in zip(seqlens, bounds):
        assert b[0] == 0 and b[-1] == n and b == sorted(b)
    return columns


@pytest.mark.parametrize("rows,block_m,ctas", [(16, 16, 2), (32, 32, 1), (64, 64, 1), (128, 64, 1)])
def test_balanced_columns_fill_every_sm_at_batch_64(rows, block_m, ctas):
    """b = 64 x 256 blocks: the split plan runs 128 (256 at two CTAs per SM) equal splits on 132
    (264) slots; balanced columns run one per slot, within one block of each other."""
    seqlens = [16384] * 64
    policy = SplitPolicy(ctas_per_sm=ctas, balanced=True)
    work, num_splits = build_metadata(torch.tensor(seqlens, dtype=torch.int32), rows, block_m, policy,
                                      runs_columns=True)
    columns = _check_work_list(work, num_splits, seqlens)
    slots = 132 * ctas // -(-rows // block_m)
    assert len(columns) == slots
    lengths = [sum(e - b for _r, b, e, _s in column) for column in columns]
    assert max(lengths) - min(lengths) <= 1 and sum(lengths) == 64 * 256
    split_plan, _ = build_metadata(torch.tensor(seqlens, dtype=torch.int32), rows, block_m, policy)
    assert split_plan.shape[1] == 1 and split_plan.shape[0] < slots  # not for a one-item kernel


@pytest.mark.parametrize("seed", range(6))
def test_balanced_work_lists_are_consistent(seed):
    rng = random.Random(seed)
    seqlens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 300000)]) for _ in range(rng.randint(1, 150))]
    for rows, block_m, ctas in ((16, 16, 2), (32, 32, 1), (128, 64, 1)):
        policy = SplitPolicy(ctas_per_sm=ctas, balanced=True)
        work, num_splits = build_metadata(torch.tensor(seqlens, dtype=torch.int32), rows, block_m, policy,
                                          runs_columns=True)
        if sum(seqlens) == 0:
            assert work.shape[0] == 0
            continue
        _check_work_list(work, num_splits, seqlens)


def test_balanced_columns_allow_exactly_max_splits_pieces_per_request():
    """A request of 64 blocks over 4 columns is cut into 4 pieces: allowed at a cap of 4, the split
    plan's fallback (None) at a cap of 3."""
    policy = SplitPolicy(num_sms=4, balanced=True, min_blocks_per_split=1, max_splits_per_request=4)
    plan = balanced_columns([64 * PAGE], 64, 64, policy)
    assert plan is not None and [len(column) for column in plan] == [1, 1, 1, 1]
    assert balanced_columns([64 * PAGE], 64, 64, replace(policy, max_splits_per_request=3)) is None


def test_negative_lengths_are_refused():
    """A negative length would plan -1 blocks (Python's floor division) instead of failing."""
    with pytest.raises(SnapmlaError, match="^cache_seqlens: lengths must be >= 0"):
        build_metadata(torch.tensor([100, -64], dtype=torch.int32), 16, 64, SplitPolicy())


def test_balanced_columns_fall_back_where_a_request_needs_too_many_pieces():
    """One 128k request on 132 columns would need 132 pieces: with at most 64 the split plan runs
    instead; short batches get fewer columns than SMs (min_blocks_per_split each)."""
    policy = SplitPolicy(balanced=True, max_splits_per_request=64)
    assert balanced_columns([131072], 32, 32, replace(policy, max_splits_per_request=132)) is not None
    assert balanced_columns([131072], 32, 32, policy) is None
    work, num_splits = build_metadata(torch.tensor([131072], dtype=torch.int32), 32, 32, policy,
                                      runs_columns=True)
    assert work.shape[1] == 1 and work.shape[0] <= policy.max_splits_per_request
    _check_work_list(work, num_splits, [131072])
    plan = balanced_columns([64 * 10] * 4, 32, 32, policy)
    assert plan is not None and len(plan) == 40 // policy.min_blocks_per_split
    assert balanced_columns([0, 0], 32, 32, policy) is None


# (batch, context, rows, balanced columns measured faster than the split plan) on the H200,
# one CTA per SM, 64-row tiles (docs/PERF.md, fourteenth session): the planner's model must
# agree where the measured difference is clear (> 3%)
MEASURED_BALANCE = [(55, 16384, 128, True), (13, 65536, 128, False), (64, 16384, 64, False),
                    (64, 16384, 128, False)]


@pytest.mark.parametrize("batch,context,rows,balanced", MEASURED_BALANCE)
def test_planner_prefers_balanced_columns_where_they_were_measured_faster(batch, context, rows, balanced):
    assert prefer_balanced([context] * batch, rows, 64, SplitPolicy(num_sms=132)) == balanced


def test_planner_keeps_the_split_plan_where_columns_cannot_run():
    assert not prefer_balanced([], 64, 64, SplitPolicy())
    assert not prefer_balanced([0, 0], 64, 64, SplitPolicy())
    # one request that balanced columns would cut into more pieces than a request may have
    capped = SplitPolicy(num_sms=132, max_splits_per_request=4)
    assert balanced_columns([1 << 20], 64, 64, capped) is None
    assert not prefer_balanced([1 << 20], 64, 64, capped)


@pytest.mark.parametrize("seed", range(4))
def test_split_plan_columns_are_plan_splits_longest_first(seed):
    """The work list's split-plan columns (built with NumPy) hold exactly plan_splits' bounds
    (Python's round of i nb / p), one split per column, ordered longest first with ties in
    request order."""
    rng = random.Random(seed)
    seqlens = [rng.choice([0, 1, 64, 65, rng.randint(1, 400000)]) for _ in range(rng.randint(1, 140))]
    for rows, block_m, ctas in ((16, 16, 2), (32, 32, 1), (128, 64, 1)):
        policy = SplitPolicy(ctas_per_sm=ctas, max_splits_per_request=rng.choice([4, 64, 256]))
        columns = work_columns(seqlens, rows, block_m, policy, runs_columns=False)
        assert set(columns.lengths.tolist()) <= {1}
        items = columns.pieces.tolist()
        expected = sorted(((req, bounds[s], bounds[s + 1])
                           for req, bounds in enumerate(plan_splits(seqlens, rows, block_m, policy))
                           for s in range(len(bounds) - 1)), key=lambda item: (item[1] - item[2]))
        assert [tuple(item) for item in items] == expected


def _makespan_by_waves(blocks: list[int], counts: list[int], rows: int, m_tiles: int, slots: int) -> float:
    """The planner's model written out wave by wave: every split's size listed, longest first,
    ``slots // m_tiles`` splits a wave, each wave its first (longest) split plus a CTA's overhead,
    plus the partial outputs of split requests."""
    sizes = sorted((nb // p + (s < nb % p) for nb, p in zip(blocks, counts) for s in range(p)), reverse=True)
    per_wave = max(1, slots // m_tiles)
    waves = [sizes[i:i + per_wave] for i in range(0, len(sizes), per_wave)]
    partials = sum(p for p in counts if p > 1) * rows * PARTIAL_BLOCKS_PER_ROW / slots
    return sum(wave[0] + CTA_OVERHEAD_BLOCKS for wave in waves) + partials


@pytest.mark.parametrize("seed", range(4))
def test_makespans_of_several_plans_are_each_plans_waves(seed):
    """estimated_makespans weighs a step's candidate plans in one pass over a [plans, 2 b] array;
    each row must be what that plan's waves add up to (requests without splits included)."""
    rng = random.Random(seed)
    batch = rng.randint(1, 150)
    blocks = [rng.choice([0, 1, 3, rng.randint(1, 5000)]) for _ in range(batch)]
    plans = [[min(nb, rng.randint(1, 9)) if nb else 0 for nb in blocks] for _ in range(rng.randint(1, 8))]
    if not any(sum(p) for p in plans):
        return
    rows, m_tiles, slots = rng.choice([(16, 1, 264), (64, 1, 132), (128, 2, 132), (256, 4, 132)])
    got = estimated_makespans(np.array(blocks), np.array(plans), rows, m_tiles, slots)
    for row, counts in zip(got.tolist(), plans):
        assert row == pytest.approx(_makespan_by_waves(blocks, counts, rows, m_tiles, slots), rel=1e-12)
        assert estimated_makespan(np.array(blocks), np.array(counts), rows, m_tiles, slots) == row


@pytest.mark.parametrize("seed", range(3))
def test_best_split_counts_is_the_cheapest_wave_count(seed):
    """The planner's choice: among the policy's wave count and EXTRA_WAVES more, the plan of the
    lowest modelled makespan, the fewest waves on a tie."""
    rng = random.Random(seed)
    seqlens = [rng.choice([0, 64, rng.randint(1, 300000)]) for _ in range(rng.randint(1, 100))]
    blocks = tuple((n + PAGE - 1) // PAGE for n in seqlens)
    if not sum(blocks):
        return
    policy = SplitPolicy(ctas_per_sm=rng.choice([1, 2]), min_blocks_per_split=rng.choice([2, 4, 16]))
    rows, block_m = rng.choice([(16, 16), (64, 64), (128, 64)])
    m_tiles, slots = -(-rows // block_m), policy.num_sms * policy.ctas_per_sm
    best = None
    for waves in range(policy.waves, policy.waves + EXTRA_WAVES + 1):
        chunk = max(policy.min_blocks_per_split, -(-sum(blocks) // max(1, slots * waves // m_tiles)))
        counts = [min(max(1, nb // chunk), policy.max_splits_per_request, nb) if nb else 0 for nb in blocks]
        cost = _makespan_by_waves(list(blocks), counts, rows, m_tiles, slots)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, tuple(counts))
    cost, counts = _best_split_counts(blocks, rows, block_m, policy)
    assert counts == best[1] and cost == pytest.approx(best[0], rel=1e-12)
