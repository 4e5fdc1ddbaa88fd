"""Where a decode step's split requests are merged: in the decode kernel (the fold) or by the
combine kernel after it, and how the combine is launched.

The wgmma decode kernels merge a split request themselves: the CTA that stores the request's
last split (counted per request and row tile in ``arrivals``) merges the partials and resets its
counter (``kernels/decode_common.cuh``, ``fold_split``). The combine kernel's launch and its
wait for the whole decode grid cost 4-10 us a call at b 64 on the H200; the fold gets back
1-2.5 of them at 16-64 rows and 2-6 where no request is split (then no combine runs;
docs/PERF.md, sixteenth session). But one CTA reads all of a row tile's partials, so a request
cut into many splits (small batches: 64 splits x 64 rows are 8 MB, and a b 1 call at h64 16k
took 93 us with the fold against 24 with the combine) is left to the combine kernel, which
spreads it over a CTA per row: the fold takes requests of at most ``fold_limit(tile rows)``
splits.

Where every split request has the same number of splits (2, 4 or 8), the wgmma kernels run
each request's splits as one thread-block cluster instead, merging through their shared
memory (:mod:`.cluster_fold`); ``SplitFold.cluster`` carries that size, and the combine is then
left the requests without keys only.

The counters are made here, per work list, by ``get_mla_metadata`` (one small zeroed buffer a
decode step, shared by its layers, which run in turn): a work list that is copied, e.g. into an
engine's static buffer for CUDA graphs, has no plan recorded and runs the combine, as does a
kernel without the fold (mma.sync), a work list rewritten in place since it was planned (torch
moved its version counter: FlashMLA's pattern of copying each step's list into the first one's
tensors) and one captured into a CUDA graph, whose replays run whatever the tensors hold by then
(``config_choice.ContentStamp``; the benchmarks' captures, which replay what they captured, keep
the plan). A request without keys has no split at all; the combine
writes it (out 0, lse +inf), so a step with such requests still launches it, told to leave the
folded requests alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .decode_config import ROWS_PER_GROUP

# kernels/decode_common.cuh kMaxFoldedSplits: a row tile's split weights live in shared memory
MAX_FOLDED_SPLITS = 64
# the smallest row tile of any decode kernel (one row group): counters for the most row tiles a
# config can have
MIN_ROW_TILE = ROWS_PER_GROUP
# The most partial rows (splits x tile rows, 2 KB each) one merging CTA reads. Measured against
# the combine at b 2-32 (docs/PERF.md, seventeenth session): up to 128 the fold was 0.3-2.9%
# sooner in 5 of 6 shapes, from 144 on it was later in all (up to 25% at b 8, 2.3x at b 2), as
# the one CTA's reads queue up.
FOLD_MAX_PARTIAL_ROWS = 128
# Up to this many rows (b x s_q x h_q) the combine runs a CTA per row (COMBINE_ROWS 1), above it
# a warp per row (4 per CTA): few rows are the small batches, whose requests have many splits.
COMBINE_ONE_ROW_MAX_ROWS = 1024
COMBINE_THREADS = 128  # kernels/combine.cu kThreads


def fold_limit(tile_rows: int) -> int:
    """The most splits of a request the decode kernel merges itself, for row tiles of
    ``tile_rows`` rows (16 rows: 8 splits, 64 rows: 2)."""
    return max(2, min(MAX_FOLDED_SPLITS, FOLD_MAX_PARTIAL_ROWS // max(1, tile_rows)))


@dataclass(frozen=True, eq=False)
class SplitFold:
    """A work list's split facts for the decode call, known on the host when it was built."""

    arrivals: torch.Tensor | None  # int32 [b x row tiles], zero; None: no request is folded
    max_splits: int  # the kernel merges requests of 2 .. max_splits splits
    combine_left: bool  # a request is empty or has more splits: the combine runs after the fold
    cluster: int = 0  # every split request's splits can run as one cluster of this size (0: no)
    empty_requests: bool = False  # a request has no keys (the combine writes its rows)


@dataclass(frozen=True)
class CombineRun:
    """The combine kernel's launch after a decode kernel."""

    folded_up_to: int  # it leaves requests of 2 .. folded_up_to splits alone (0: merges all)


def plan_fold(splits_per_request: Sequence[int], rows: int, tile_rows: int, device: torch.device,
              cluster: int = 0) -> SplitFold:
    """The fold of one work list: zeroed counters where a request is folded (on ``device``);
    ``cluster``: the work list's cluster size (:func:`.cluster_fold.work_list_cluster`)."""
    limit = fold_limit(min(tile_rows, rows))
    folded, left = _fold_facts(tuple(splits_per_request), limit)
    empty = 0 in splits_per_request
    return SplitFold(_counters(len(splits_per_request), rows, device) if folded else None, limit, left, cluster,
                     empty)


def fixed_fold(batch: int, rows: int, tile_rows: int, device: torch.device) -> SplitFold:
    """The fold of a work list rewritten from step to step (ops/graph_work_list.py): counters for
    every request, and the combine always launched after the decode (for whatever a step leaves
    it), so that one captured launch sequence holds for every step's plan."""
    return SplitFold(_counters(batch, rows, device), fold_limit(min(tile_rows, rows)), combine_left=True)


def _counters(batch: int, rows: int, device: torch.device) -> torch.Tensor:
    """Zeroed arrival counters, one per request and smallest row tile."""
    return torch.zeros(batch * -(-rows // MIN_ROW_TILE), dtype=torch.int32, device=device)


# once per work list (get_mla_metadata), whose split counts repeat with its pages per request
@functools.lru_cache(maxsize=8)
def _fold_facts(splits_per_request: tuple[int, ...], limit: int) -> tuple[bool, bool]:
    """(a request is folded: 2 .. limit splits; one is left to the combine: none or more)."""
    counts = np.asarray(splits_per_request, dtype=np.int64)
    return bool(((counts > 1) & (counts <= limit)).any()), bool(((counts == 0) | (counts > limit)).any())


def kernel_fold_limit(fold: SplitFold | None, arrivals: torch.Tensor | None) -> int:
    """The decode kernel's ``fold_max_splits`` argument: 0 when it gets no counters."""
    return fold.max_splits if fold is not None and arrivals is not None else 0


def kernel_arrivals(fold: SplitFold | None, kernel_folds: bool) -> torch.Tensor | None:
    """The counters the decode kernel gets: None (it writes partials for the combine) unless
    the work list has a fold and the kernel can fold."""
    if fold is None or not kernel_folds:
        return None
    return fold.arrivals


def combine_after(fold: SplitFold | None, arrivals: torch.Tensor | None, cluster: int = 0) -> CombineRun | None:
    """The combine's launch once the decode kernel ran with ``arrivals``, or launched in
    clusters of ``cluster`` splits (every split request merged there); None: no combine."""
    if fold is not None and cluster:  # only requests without keys are left
        return CombineRun(cluster) if fold.empty_requests else None
    if fold is None:  # a work list built elsewhere: nothing known on the host, merge them all
        return CombineRun(0)
    if arrivals is None:  # the kernel folded nothing: merge whatever is split or empty
        return CombineRun(0) if fold.arrivals is not None or fold.combine_left else None
    return CombineRun(fold.max_splits) if fold.combine_left else None


def combine_rows_per_cta(total_rows: int) -> int:
    """COMBINE_ROWS of the combine launch for ``total_rows`` rows (b x s_q x h_q)."""
    return 1 if total_rows <= COMBINE_ONE_ROW_MAX_ROWS else 4
