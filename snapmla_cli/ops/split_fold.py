"""Where a decode step's split requests are merged: in the decode kernel (the fold) or by the
combine kernel after it.

The wgmma decode kernels merge a split request themselves: the CTA that stores the request's
last split (counted per request and row tile in ``arrivals``) merges the partials and resets its
counter (``kernels/decode_common.cuh``, ``fold_split``). The combine kernel's launch and its
wait for the whole decode grid cost 4-10 us a call at b 64 on the H200; the fold gets back
1-2.5 of them at 16-64 rows and 2-6 where no request is split (then no combine runs;
docs/PERF.md, sixteenth session). The counters are made here, per work list, by
``get_mla_metadata`` (one small zeroed buffer a decode step, shared by its layers, which run in
turn): a work list that is copied, e.g. into an engine's static buffer for CUDA graphs, has no
plan recorded and runs the combine, as does a kernel without the fold (mma.sync). A request
without keys has no split at all; the combine writes it (out 0, lse +inf), so a step with such
requests still launches it, told to leave the split requests alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from .decode_config import ROWS_PER_GROUP

# kernels/decode_common.cuh kMaxFoldedSplits: a row tile's split weights live in shared memory
MAX_FOLDED_SPLITS = 64
# the smallest row tile of any decode kernel (one row group): counters for the most row tiles a
# config can have
MIN_ROW_TILE = ROWS_PER_GROUP


@dataclass(frozen=True, eq=False)
class SplitFold:
    """A work list's split facts for the decode call, known on the host when it was built."""

    arrivals: torch.Tensor | None  # int32 [b x row tiles], zero; None: no request is split
    foldable: bool  # every split request has at most MAX_FOLDED_SPLITS splits
    has_empty: bool  # a request has no keys (no split): only the combine writes it


class Combine(Enum):
    """What the combine kernel has to do after the decode kernel."""

    NONE = "none"  # nothing: every request was written by the decode kernel
    ALL = "all"  # merge the split requests and write the empty ones
    EMPTY_ONLY = "empty_only"  # the decode kernel merged the split ones: write the empty ones


def plan_fold(splits_per_request: Sequence[int], rows: int, device: torch.device) -> SplitFold:
    """The fold of one work list: zeroed counters where a request is split (on ``device``)."""
    split = any(n > 1 for n in splits_per_request)
    tiles = -(-rows // MIN_ROW_TILE)
    arrivals = torch.zeros(len(splits_per_request) * tiles, dtype=torch.int32, device=device) if split else None
    return SplitFold(arrivals, max(splits_per_request, default=0) <= MAX_FOLDED_SPLITS,
                     any(n == 0 for n in splits_per_request))


def kernel_arrivals(fold: SplitFold | None, kernel_folds: bool) -> torch.Tensor | None:
    """The counters the decode kernel gets: None (it writes partials for the combine) unless
    the work list has a fold within the kernel's limits and the kernel can fold."""
    if fold is None or not kernel_folds or not fold.foldable:
        return None
    return fold.arrivals


def combine_after(fold: SplitFold | None, arrivals: torch.Tensor | None) -> Combine:
    """The combine's part once the decode kernel ran with ``arrivals``."""
    if fold is None:
        return Combine.ALL  # a work list built elsewhere: nothing known on the host
    if fold.arrivals is not None and arrivals is None:
        return Combine.ALL
    return Combine.EMPTY_ONLY if fold.has_empty else Combine.NONE
