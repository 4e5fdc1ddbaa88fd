"""Split-KV scheduling (``get_mla_metadata``): which CTA column processes which KV blocks.

FlashMLA's contract is kept: ``get_mla_metadata(cache_seqlens, s_q * h_q, 1)`` returns
``(tile_scheduler_metadata, num_splits)`` with ``num_splits`` int32 ``[b + 1]`` cumulative split
counts. snapmla's metadata is a plain work list of (request, first block, end block, partial slot
or -1) items, computed on the host from the sequence lengths: one small copy
per decode step (shared by every layer), and the decode kernel then needs no scheduling logic.
Requests are cut into splits of nearly equal block counts so that the CTA count fills the GPU.

The work list is int32 ``[columns, items_per_column, 4]``: a kernel that runs columns gives each
CTA row one column and runs its items in turn (the FP8 and BF16 wgmma kernels, where they compile
that loop without spills), the others give each CTA one item (grid ``columns *
items_per_column``). Unused places hold an empty item (no blocks; its partial slot is a scratch
slot nobody reads). A balanced plan (``SplitPolicy.balanced``) gives every column an equal share
of the flattened block list, a column crossing request boundaries (FlashMLA's scheduling): at
b = 64 on 132 SMs the one-wave plan runs 128 CTAs and leaves 4 SMs idle, the balanced one keeps
all 132 busy at the cost of a second item per column (its epilogue, Q load and partial outputs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from ..errors import SnapmlaError, dtype_name, show
from ..numerics.decode_args import require_readable
from ..numerics.formats import D_V, FP8_TOKEN_BYTES, PAGE_SIZE
from .cluster_fold import uniform_split_count, work_list_cluster

WORK_FIELDS = 4  # request, block_begin, block_end, partial slot
# kernels/combine.cu kMaxSplits: the combine keeps a request's split weights in shared memory,
# so no policy cuts a request finer
MAX_SPLITS_PER_REQUEST = 512


@dataclass(frozen=True)
class SplitPolicy:
    """How finely to split the KV sequence. ``ctas_per_sm`` is how many CTAs the decode kernel
    keeps resident per SM; ``waves`` how many rounds of those the split count aims at;
    ``min_blocks_per_split`` stops splitting short sequences (each split costs a combine);
    ``balanced``: equal shares of all blocks per CTA column, for kernels that run columns (the
    others, and requests that would need more than ``max_splits_per_request`` pieces, get the
    split plan). ``auto_balance``: let the planner choose between the two for each batch
    (:func:`prefer_balanced`); ``decode_config.settle_balance`` turns it into ``balanced`` before
    a work list is built or a kernel chosen."""

    num_sms: int = 132
    ctas_per_sm: int = 1
    waves: int = 1
    min_blocks_per_split: int = 4
    max_splits_per_request: int = 256
    balanced: bool = False
    auto_balance: bool = False

    def __post_init__(self) -> None:
        """Counts are positive ints and switches bools: a zero or negative count would divide by
        zero or plan no CTA at all far from where it was given."""
        for name in ("num_sms", "ctas_per_sm", "waves", "min_blocks_per_split", "max_splits_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SnapmlaError(f"SplitPolicy.{name}: expected a positive int, got {show(value)}")
        for name in ("balanced", "auto_balance"):
            if not isinstance(getattr(self, name), bool):
                raise SnapmlaError(f"SplitPolicy.{name}: expected True or False, got {show(getattr(self, name))}")
        if self.max_splits_per_request > MAX_SPLITS_PER_REQUEST:
            raise SnapmlaError(f"SplitPolicy.max_splits_per_request: expected 1..{MAX_SPLITS_PER_REQUEST}, "
                               f"got {show(self.max_splits_per_request)}")


def rows_per_cta_tiles(rows: int, block_m: int) -> int:
    return (rows + block_m - 1) // block_m


# The split planner's cost model, in the time a CTA takes for one FP8 KV block:
# - a CTA's latency beyond its blocks (Q, the first page's arrival, the epilogue), per wave;
CTA_OVERHEAD_BLOCKS = 2
# - the partial outputs of split requests: float32 [rows, 512] written by the split and read
#   back by the combine, bandwidth shared by the whole GPU (bytes per row and split, in blocks).
PARTIAL_BYTES_PER_ROW = 2 * D_V * 4
PARTIAL_BLOCKS_PER_ROW = PARTIAL_BYTES_PER_ROW / (PAGE_SIZE * FP8_TOKEN_BYTES)
# Finer plans than the policy's `waves` that the planner also weighs (waves + 1 .. + this).
EXTRA_WAVES = 7
# What a page costs a column build (the kernel that runs a column's items in turn) beyond the
# one-item build's, as a fraction, in prefer_balanced's model: the 64-row rows = M column build
# measured 1-3% slower per page, and balanced columns 1-4% slower than the split plan at b 64
# where both fill the GPU (docs/PERF.md, fourteenth session).
COLUMN_PAGE_COST = 0.03


def _split_counts(blocks: np.ndarray, chunk: np.ndarray | int, policy: SplitPolicy) -> np.ndarray:
    """Splits per request: ``floor(blocks / chunk)``, at least one (none for an empty request).
    ``chunk`` may be a column of candidate chunks (``[plans, 1]``): one row of counts each."""
    counts = np.minimum(np.maximum(blocks // chunk, 1), policy.max_splits_per_request)
    return np.where(blocks > 0, np.minimum(counts, blocks), 0)


def estimated_makespan(blocks: np.ndarray, counts: np.ndarray, rows: int, m_tiles: int,
                       slots: int) -> float:
    """A plan's time in KV blocks of one CTA: the splits launched longest first (the work list's
    order), the GPU running ``slots`` CTAs at a time, each wave as long as its longest split
    plus the fixed cost of a CTA, plus the partial outputs' traffic spread over the GPU. A
    request of ``nb`` blocks in ``p`` splits has ``nb % p`` splits of ``nb // p + 1`` blocks and
    the others of ``nb // p``."""
    return float(estimated_makespans(blocks, np.asarray(counts)[None, :], rows, m_tiles, slots)[0])


def estimated_makespans(blocks: np.ndarray, counts: np.ndarray, rows: int, m_tiles: int,
                        slots: int) -> np.ndarray:
    """:func:`estimated_makespan` of several plans of one batch at once, ``counts`` int
    ``[plans, b]`` (a request without keys: 0 splits): the planner weighs up to eight plans a
    decode step, and one pass over a ``[plans, 2 b]`` array costs the host what one plan's did.
    Each row lists the split sizes ``q + 1`` and ``q`` with their multiplicities (zero for the
    sizes a request does not have, and for a request without splits: no wave starts at them)."""
    plans = counts.shape[0]
    q, r = np.divmod(blocks[None, :], np.maximum(counts, 1))
    sizes = np.concatenate([q + 1, q], axis=1)
    multiplicity = np.concatenate([r, counts - r], axis=1)  # r = 0 where counts = 0 (divided by 1)
    order = np.argsort(-sizes, axis=1, kind="stable")
    plan_of = np.arange(plans)[:, None]
    sizes = sizes[plan_of, order]
    ends = np.cumsum(multiplicity[plan_of, order], axis=1)
    per_wave = max(1, slots // m_tiles)
    waves = -(-ends[:, -1] // per_wave)
    # the longest split of wave k is the split at position k * per_wave of the sorted list: one
    # search over all plans' ends, each plan's shifted past the previous one's
    starts = np.arange(int(waves.max())) * per_wave
    shift = int(max(ends[:, -1].max(), starts[-1] if len(starts) else 0)) + 1
    row_shift = plan_of * shift
    firsts = np.searchsorted((ends + row_shift).ravel(), (starts[None, :] + row_shift).ravel(), side="right")
    in_plan = np.arange(len(starts))[None, :] < waves[:, None]
    longest = np.where(in_plan, sizes.ravel()[np.minimum(firsts, sizes.size - 1)].reshape(plans, -1), 0)
    return (longest.sum(axis=1) + waves * CTA_OVERHEAD_BLOCKS) + _partials_cost(counts, rows, slots)


def _partials_cost(pieces: np.ndarray, rows: int, slots: int) -> np.ndarray:
    """The partial outputs of requests cut into more than one piece, in blocks of one CTA, per
    row of ``pieces`` (pieces per request)."""
    return np.where(pieces > 1, pieces, 0).sum(axis=-1) * rows * PARTIAL_BLOCKS_PER_ROW / slots


def _blocks_per_request(seqlens: Sequence[int]) -> tuple[int, ...]:
    """KV blocks (pages) per request: the planners' input, hashable for their caches."""
    return _blocks_of(tuple(seqlens))


# A decode step asks for its lengths' blocks two or three times (the balance, the work list)
@functools.lru_cache(maxsize=4)
def _blocks_of(seqlens: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(((np.asarray(seqlens, dtype=np.int64) + PAGE_SIZE - 1) // PAGE_SIZE).tolist())


def plan_splits(seqlens: list[int], rows: int, block_m: int, policy: SplitPolicy) -> list[list[int]]:
    """Block boundaries per request, e.g. ``[[0, 12, 24], [0, 3], []]`` (empty: no keys).

    The CTA count (splits x row tiles) should fill whole waves: a grid of 1.45 waves leaves
    most SMs idle for the last 45%. For ``w`` waves each request gets ``floor(blocks / chunk)``
    splits (at least one), with ``chunk`` the block count that gives ``num_sms * ctas_per_sm * w``
    CTAs. The policy's ``waves`` is where the search starts: finer plans (up to
    ``EXTRA_WAVES`` more waves) are taken when :func:`estimated_makespan` says they finish
    sooner. That matters for batches that do not divide the SM count: 80 requests of 256 blocks
    on 132 SMs get one split each at one wave (80 SMs busy, the others idle) but three at two
    waves (measured 1.2-1.35x sooner on the H200, docs/PERF.md).
    """
    blocks = _blocks_per_request(seqlens)
    if sum(blocks) == 0:
        return [[] for _ in seqlens]
    counts = _best_split_counts(blocks, rows, block_m, _plan_key(policy))[1]
    return [[round(i * nb / parts) for i in range(parts + 1)] if parts else []
            for nb, parts in zip(blocks, counts)]


@functools.lru_cache(maxsize=64)
def _plan_key(policy: SplitPolicy) -> SplitPolicy:
    """``policy`` without the fields the planners do not read (balanced columns or not): the
    key of their caches."""
    return replace(policy, balanced=False, auto_balance=False)


# get_mla_metadata asks twice per step, when it settles an automatic balance
# (prefer_balanced) and when it plans (plan_splits): the model takes about 0.2 ms on the host
@functools.lru_cache(maxsize=4)
def _best_split_counts(blocks_per_request: tuple[int, ...], rows: int, block_m: int, policy: SplitPolicy,
                       max_pieces: int | None = None) -> tuple[float, tuple[int, ...]]:
    """(estimated makespan, splits per request) of the best split plan (see plan_splits);
    ``max_pieces``: only plans of at most that many splits in all (a fixed-size work list,
    :func:`graph_capacity`, which the policy's own wave count always fits)."""
    blocks = np.asarray(blocks_per_request, dtype=np.int64)
    total = int(blocks.sum())
    m_tiles = rows_per_cta_tiles(rows, block_m)
    slots = policy.num_sms * policy.ctas_per_sm
    waves = np.arange(policy.waves, policy.waves + EXTRA_WAVES + 1)
    chunks = np.maximum(policy.min_blocks_per_split, -(-total // np.maximum(1, slots * waves // m_tiles)))
    chunks = chunks[np.concatenate([[True], chunks[1:] != chunks[:-1]])]  # the chunk only shrinks
    counts = _split_counts(blocks[None, :], chunks[:, None], policy)
    if max_pieces is not None:
        counts = counts[counts.sum(axis=1) <= max_pieces]
        if not len(counts):
            raise SnapmlaError(f"a fixed work list of {max_pieces} items is too small for this batch's split plan")
    costs = estimated_makespans(blocks, counts, rows, m_tiles, slots)
    best = int(np.argmin(costs))  # the first of equal costs: the fewest waves
    return float(costs[best]), tuple(counts[best].tolist())


def prefer_balanced(seqlens: list[int], rows: int, block_m: int, policy: SplitPolicy) -> bool:
    """Whether balanced columns finish this batch sooner than the best split plan, by the
    planner's model: the split plan's :func:`estimated_makespan` against the longest column's
    blocks times ``1 + COLUMN_PAGE_COST``, plus a CTA's fixed cost per item of that column,
    plus the partial outputs. Balanced columns win where the split plan's waves fit the GPU
    badly (55 requests of 256 blocks at 128 rows: 110 of 132 SMs busy, measured 1.11x sooner
    balanced) and lose by a few percent where both fill it (b 64, docs/PERF.md)."""
    return _prefer_balanced(_blocks_per_request(seqlens), rows, block_m, _plan_key(policy))


# Decode steps repeat their pages per request until a request starts a page: at b 1 63 steps of
# 64, so a decision (and a work list, _work_tables) is kept per pages-per-request tuple
@functools.lru_cache(maxsize=8)
def _prefer_balanced(blocks: tuple[int, ...], rows: int, block_m: int, policy: SplitPolicy) -> bool:
    plan = _balanced_columns(blocks, rows, block_m, policy)
    if plan is None:
        return False
    split_cost = _best_split_counts(blocks, rows, block_m, policy)[0]
    slots = policy.num_sms * policy.ctas_per_sm
    column_blocks = np.bincount(plan.column_of(), weights=plan.pieces[:, 2] - plan.pieces[:, 1],
                                minlength=len(plan.lengths))
    longest = float(np.max(column_blocks * (1 + COLUMN_PAGE_COST) + plan.lengths * CTA_OVERHEAD_BLOCKS))
    pieces = np.bincount(plan.pieces[:, 0], minlength=len(blocks))
    return bool(longest + _partials_cost(pieces, rows, slots) < split_cost)


def host_seqlens(cache_seqlens: torch.Tensor) -> list[int]:
    """``cache_seqlens`` checked (int32 ``[b]``, lengths >= 0) and read to the host. This is the
    one device-to-host copy of a decode step's scheduling: ``get_mla_metadata`` reads it once and
    uses the list both for the configuration choice (the context) and for the work list."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise SnapmlaError(f"cache_seqlens: expected a torch.Tensor, got {type(cache_seqlens).__name__}")
    require_readable("cache_seqlens", cache_seqlens)
    if cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        raise SnapmlaError(
            f"cache_seqlens: expected int32 [b], got {dtype_name(cache_seqlens.dtype)} {tuple(cache_seqlens.shape)}"
        )
    seqlens = cache_seqlens.tolist()
    if any(n < 0 for n in seqlens):
        raise SnapmlaError("cache_seqlens: lengths must be >= 0")
    return seqlens


Columns = Sequence[Sequence[tuple[int, int, int]]]  # per CTA column its (request, first, end block)


class ColumnPieces(NamedTuple):
    """CTA columns as arrays (a step's plan is rebuilt on the host every step, and Python lists
    of tuples made that a millisecond at b 64): ``pieces`` int64 ``[n, 3]`` (request, first
    block, end block) column after column, each column's in block order; ``lengths`` int64
    ``[columns]``, its pieces per column. Cached plans share these arrays: read-only."""

    pieces: np.ndarray
    lengths: np.ndarray

    def column_of(self) -> np.ndarray:
        """The column of each piece."""
        return np.repeat(np.arange(len(self.lengths)), self.lengths)

    def as_columns(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """The same columns as tuples (:data:`Columns`)."""
        rows = [tuple(piece) for piece in self.pieces.tolist()]
        ends = np.cumsum(self.lengths).tolist()
        return tuple(tuple(rows[end - n:end]) for end, n in zip(ends, self.lengths.tolist()))


def _read_only(*arrays: np.ndarray) -> None:
    for array in arrays:
        array.flags.writeable = False


def balanced_columns(seqlens: list[int], rows: int, block_m: int, policy: SplitPolicy) -> Columns | None:
    """Per CTA column its pieces ``(request, first block, end block)`` in block order, every
    column an equal share (within one block) of the flattened block list: one wave of
    ``num_sms * ctas_per_sm / row tiles`` columns, fewer when the blocks are too few for
    ``min_blocks_per_split`` each. None when a request would be cut into more than
    ``max_splits_per_request`` pieces (the split plan caps it) or there are no blocks."""
    plan = _balanced_columns(_blocks_per_request(seqlens), rows, block_m, _plan_key(policy))
    return None if plan is None else plan.as_columns()


# get_mla_metadata asks twice per step when it settles an automatic balance (prefer_balanced)
# and then builds balanced columns
@functools.lru_cache(maxsize=4)
def _balanced_columns(blocks: tuple[int, ...], rows: int, block_m: int, policy: SplitPolicy) -> ColumnPieces | None:
    offsets = np.zeros(len(blocks) + 1, dtype=np.int64)  # the flattened first block of each request
    np.cumsum(blocks, out=offsets[1:])
    total = int(offsets[-1])
    if total == 0:
        return None
    slots = policy.num_sms * policy.ctas_per_sm // rows_per_cta_tiles(rows, block_m)
    columns = max(1, min(slots, total // max(1, policy.min_blocks_per_split)))
    bounds = np.arange(columns + 1, dtype=np.int64) * total // columns  # column c: [bounds[c], bounds[c + 1])
    # the pieces are the stretches between consecutive cuts, a cut at every column bound and
    # every request start; each column has at least one block, so none is empty
    cuts = np.union1d(bounds, offsets)
    starts, ends = cuts[:-1], cuts[1:]
    request = np.searchsorted(offsets, starts, side="right") - 1  # past the empty requests there
    column = np.searchsorted(bounds, starts, side="right") - 1
    pieces_per_request = np.bincount(request, minlength=len(blocks))
    if int(pieces_per_request.max()) > policy.max_splits_per_request:
        return None
    first = offsets[request]
    plan = ColumnPieces(np.stack([request, starts - first, ends - first], axis=1),
                        np.bincount(column, minlength=columns).astype(np.int64))
    _read_only(*plan)
    return plan


def _split_plan_columns(blocks: tuple[int, ...], rows: int, block_m: int, policy: SplitPolicy,
                        max_pieces: int | None = None) -> ColumnPieces:
    """The split plan (:func:`plan_splits`: request ``i``'s split ``s`` of ``p`` covers blocks
    ``round(s nb / p)`` to ``round((s + 1) nb / p)``) as columns of one item each, longest
    first: the GPU starts CTAs in grid order as SMs free up, so this is the
    longest-processing-time-first schedule. Where every request has the same number of splits
    and it is a cluster size (:mod:`.cluster_fold`), a request's splits stay side by side in
    split order, the requests longest piece first."""
    nb = np.asarray(blocks, dtype=np.int64)
    if int(nb.sum()) == 0:
        return ColumnPieces(np.zeros((0, 3), dtype=np.int64), np.zeros(0, dtype=np.int64))
    counts = np.asarray(_best_split_counts(blocks, rows, block_m, _plan_key(policy), max_pieces)[1], dtype=np.int64)
    request = np.repeat(np.arange(len(blocks)), counts)
    split = np.arange(len(request)) - np.repeat(np.cumsum(counts) - counts, counts)
    size, parts = nb[request], counts[request]
    # Python's round(i * nb / p): the same float64 quotient, rounded half to even
    begin = np.rint(split * size / parts).astype(np.int64)
    end = np.rint((split + 1) * size / parts).astype(np.int64)
    order = np.argsort(begin - end, kind="stable")  # longest first; ties keep request order
    n = uniform_split_count(counts)
    if n:  # a request's splits side by side in split order: one thread-block cluster
        starts = (np.cumsum(counts) - counts)[counts > 0]
        longest = np.maximum.reduceat(end - begin, starts)
        order = (starts[np.argsort(-longest, kind="stable")][:, None] + np.arange(n)).ravel()
    return ColumnPieces(np.stack([request, begin, end], axis=1)[order], np.ones(len(request), dtype=np.int64))


def work_columns(seqlens: list[int], rows: int, block_m: int, policy: SplitPolicy,
                 runs_columns: bool) -> ColumnPieces:
    """The plan as CTA columns of ``(request, first block, end block)`` pieces: balanced
    columns where the policy asks for them and the kernel runs columns, else one split per
    column."""
    return _work_columns(_blocks_per_request(seqlens), rows, block_m, policy, runs_columns)


def _work_columns(blocks: tuple[int, ...], rows: int, block_m: int, policy: SplitPolicy,
                  runs_columns: bool) -> ColumnPieces:
    if policy.balanced and runs_columns:
        plan = _balanced_columns(blocks, rows, block_m, _plan_key(policy))
        if plan is not None:
            return plan
    return _split_plan_columns(blocks, rows, block_m, policy)


# A fixed-size work list (ops/graph_work_list.py) has room for one wave more than its policy's:
# the planner's finer plans up to there always fit, finer ones where they happen to
GRAPH_EXTRA_WAVES = 1


def graph_capacity(batch: int, rows: int, block_m: int, policy: SplitPolicy, max_blocks: int | None = None) -> int:
    """Items of a fixed-size split-plan work list that every batch of ``batch`` requests fits.
    A plan for ``w`` waves aims at ``target(w)`` splits, and each request gets at most one split
    more than its share ``floor(blocks / chunk) <= blocks / chunk``, so the plan has at most
    ``batch + target(w)`` splits; the capacity is that bound at the policy's waves plus
    ``GRAPH_EXTRA_WAVES``. Each request also has at most ``max_splits_per_request`` splits and,
    its chunks being at least ``min_blocks_per_split`` blocks, at most ``max_blocks //
    min_blocks_per_split`` (at least one) when no request has more than ``max_blocks`` blocks."""
    target = max(1, policy.num_sms * policy.ctas_per_sm * (policy.waves + GRAPH_EXTRA_WAVES)
                 // rows_per_cta_tiles(rows, block_m))
    per_request = policy.max_splits_per_request
    if max_blocks is not None:
        per_request = min(per_request, max(1, max_blocks // max(1, policy.min_blocks_per_split)))
    return max(1, min(batch * per_request, batch + target))


def graph_work_tables(seqlens: Sequence[int], rows: int, block_m: int, policy: SplitPolicy, capacity: int
                      ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The split plan of ``seqlens`` as a work list of exactly ``capacity`` one-item columns
    (:func:`graph_capacity`; the places past the plan empty), the cumulative split counts and
    the splits per request. Cached by pages per request: the arrays must not be written."""
    return _graph_work_tables(_blocks_per_request(seqlens), rows, block_m, policy, capacity)


@functools.lru_cache(maxsize=8)
def _graph_work_tables(blocks: tuple[int, ...], rows: int, block_m: int, policy: SplitPolicy, capacity: int
                       ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    return _work_array(_split_plan_columns(blocks, rows, block_m, policy, capacity), len(blocks), capacity)


class WorkList(NamedTuple):
    """What :func:`build_work_list` returns: the two tensors of ``get_mla_metadata`` and, on the
    host, each request's number of splits (what the split merge needs to know without a read
    from the device)."""

    metadata: torch.Tensor
    num_splits: torch.Tensor
    splits_per_request: tuple[int, ...]
    cluster: int = 0  # the thread-block cluster it can run with (ops/cluster_fold.py), 0: none


def build_metadata(
    cache_seqlens: torch.Tensor, rows: int, block_m: int, policy: SplitPolicy,
    seqlens: list[int] | None = None, runs_columns: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`build_work_list`'s two tensors."""
    work = build_work_list(cache_seqlens, rows, block_m, policy, seqlens, runs_columns)
    return work.metadata, work.num_splits


def build_work_list(
    cache_seqlens: torch.Tensor, rows: int, block_m: int, policy: SplitPolicy,
    seqlens: list[int] | None = None, runs_columns: bool = False, device: torch.device | None = None,
) -> WorkList:
    """Work list int32 ``[columns, items_per_column, 4]`` (see the module's docstring) and
    cumulative ``num_splits`` int32 ``[b + 1]``, both on the device of ``cache_seqlens``. Partial
    slot of split ``s`` of request ``i`` (splits in block order) is ``num_splits[i] + s``; a request
    with one split writes its output directly (slot -1). ``runs_columns``: the decode kernel runs
    a column's items in turn (``decode_config.runs_columns``), so a balanced policy applies.
    ``seqlens``: ``host_seqlens(cache_seqlens)`` when the caller has read it already (no second
    device-to-host copy); read here otherwise. ``device``: where the tensors go (default: where
    ``cache_seqlens`` is; lengths on the host can plan for a GPU)."""
    if seqlens is None:
        seqlens = host_seqlens(cache_seqlens)
    work, cumulative, splits = _work_tables(_blocks_per_request(seqlens), rows, block_m, policy, runs_columns)
    device = cache_seqlens.device if device is None else device
    return WorkList(_upload(work, device), _upload(cumulative, device), splits, work_list_cluster(work, cumulative))


def check_work_list(metadata: torch.Tensor, num_splits: torch.Tensor, lengths: list[int]) -> None:
    """The checks switch's work-list check: every page of every request is in exactly one split,
    the splits are within the request's pages, and their partial slots and counts are those the
    decode kernels and the combine assume (``num_splits[r] + s`` in block order, -1 for a request
    of one split). The kernels trust the work list: one planned from other lengths than the call's
    ``cache_seqlens`` (a stale list, or one rewritten without its lengths) reads pages past a
    request's end, masks with negative token counts (shared-memory writes outside the tile in the
    wgmma kernels) or leaves partials unmerged. Reading both back is a synchronization, so it runs
    with the other checks, not on the hot path."""
    counts = np.asarray(num_splits.cpu(), dtype=np.int64)
    items = np.asarray(metadata.reshape(-1, WORK_FIELDS).cpu(), dtype=np.int64)
    steps = np.diff(counts)
    if counts[0] != 0 or (steps < 0).any():
        shown = ", ".join(str(c) for c in counts.tolist()[:8]) + (", ..." if len(counts) > 8 else "")
        raise SnapmlaError(f"num_splits: expected cumulative split counts from 0, got [{shown}]")
    hint = "(pass the lengths get_mla_metadata planned this work list from)"
    per_request: dict[int, list[tuple[int, int, int]]] = {}
    for request, begin, end, partial in items.tolist():
        if end == begin:
            continue  # an empty place
        if not 0 <= request < len(lengths) or not 0 <= begin < end:
            raise SnapmlaError(f"tile_scheduler_metadata: item ({request}, {begin}, {end}, {partial}) is not "
                               f"(request 0..{len(lengths) - 1}, first block, end block > first, partial slot)")
        per_request.setdefault(request, []).append((begin, end, partial))
    for request, length in enumerate(lengths):
        pages = -(-length // PAGE_SIZE)
        splits = sorted(per_request.get(request, []))
        bounds = [0, *(end for _, end, _ in splits)]
        covered = [begin for begin, _, _ in splits] == bounds[:-1] and bounds[-1] == pages
        if not covered:
            got = (f"{len(splits)} splits over blocks [{splits[0][0]}, {max(end for _, end, _ in splits)})"
                   if splits else "no split")
            gap = " with a gap or an overlap" if splits and bounds[-1] == pages else ""
            raise SnapmlaError(f"tile_scheduler_metadata: request {request} has {got}{gap}, but "
                               f"cache_seqlens[{request}] = {length} reads blocks [0, {pages}) {hint}")
        want = [-1] if len(splits) == 1 else [int(counts[request]) + s for s in range(len(splits))]
        if [partial for _, _, partial in splits] != want or steps[request] != len(splits):
            raise SnapmlaError(f"num_splits: request {request} has {len(splits)} splits with partial slots "
                               f"{[p for _, _, p in splits]}, which num_splits {counts[request]}..{counts[request + 1]} "
                               f"does not describe {hint}")


def _upload(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """A fresh tensor of a cached table on ``device`` (copied: the cache keeps its array), without
    waiting for the device: a copy from pageable memory is staged by the driver before it
    returns, so the host need not wait for the stream (lengths given on the host: no sync).

    Made outside inference mode even when the caller runs in it (engines do): an inference
    tensor has no version counter, and the decode call reads that counter to notice a work list
    rewritten in place (``config_choice.ContentStamp``)."""
    with torch.inference_mode(False):
        return torch.from_numpy(table).to(device, non_blocking=True, copy=True)


# the work list of a step's pages per request (see _prefer_balanced): at b 1 63 steps of 64 reuse
# it. Its arrays are never written (each call uploads a copy).
@functools.lru_cache(maxsize=8)
def _work_tables(blocks: tuple[int, ...], rows: int, block_m: int, policy: SplitPolicy, runs_columns: bool
                 ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    return _work_array(_work_columns(blocks, rows, block_m, policy, runs_columns), len(blocks))


def _work_array(columns: ColumnPieces, batch: int, num_columns: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The work list of ``columns`` as int32 ``[columns, width, 4]`` (padded with empty places;
    ``num_columns``: that many columns, the ones past the plan's all empty), the cumulative
    split counts int32 ``[b + 1]`` (NumPy) and the splits per request: a step's work list is
    built on the host once per decode step."""
    pieces, lengths = columns
    if num_columns is not None:
        lengths = np.concatenate([lengths, np.zeros(num_columns - len(lengths), dtype=np.int64)])
        columns = ColumnPieces(pieces, lengths)
    width = max(int(lengths.max(initial=0)), 1)
    req, begin = pieces[:, 0], pieces[:, 1]
    splits = np.bincount(req, minlength=batch)
    cumulative = np.zeros(batch + 1, dtype=np.int32)
    np.cumsum(splits, out=cumulative[1:])
    # a piece's partial slot is its place among all pieces sorted by (request, first block), i.e.
    # cumulative[request] + its rank in the request; -1 for a request of one piece
    order = np.lexsort((begin, req))
    slot = np.empty(len(pieces), dtype=np.int64)
    slot[order] = np.arange(len(pieces))
    slot[splits[req] <= 1] = -1
    places = len(lengths) * width
    # an unused place: no blocks, request 0, the last slot of the partial buffers (sized by the
    # places; the real partial slots are fewer than the real items, so it is nobody's)
    work = np.zeros((len(lengths), width, WORK_FIELDS), dtype=np.int32)
    work[:, :, 3] = places - 1
    position = np.arange(len(pieces)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    work[columns.column_of(), position] = np.column_stack([pieces, slot])
    return work, cumulative, tuple(splits.tolist())


def split_token_bounds(num_splits: torch.Tensor, metadata: torch.Tensor, seqlens: list[int]) -> list[list[int]]:
    """Token boundaries of each request's splits (for the emulation of a split-KV run)."""
    items = metadata.reshape(-1, WORK_FIELDS).cpu().tolist()
    work = sorted((item for item in items if item[2] > item[1]), key=lambda item: (item[0], item[1]))
    bounds: list[list[int]] = [[] for _ in seqlens]
    for req, begin, end, _slot in work:
        if not bounds[req]:
            bounds[req].append(begin * PAGE_SIZE)
        bounds[req].append(min(end * PAGE_SIZE, seqlens[req]))
    return [b if b else [0, 0] for b in bounds]
