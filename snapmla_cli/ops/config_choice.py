"""Which decode configuration runs: the tuning database's entry for this GPU, shape and
context, else the built-in heuristic; and the configuration a work list was built for, so that
``get_mla_metadata`` and the decode calls cannot disagree (the metadata carries it)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..tuning import lookup
from .decode_config import DecodeConfig, heuristic_for_work, settle_blind
from .finite import capturing
from .schedule import SplitPolicy
from .split_fold import SplitFold


def choose_config(rows: int, fp8: bool, device: torch.device, batch: int | None = None,
                  context: float | None = None, s_q: int | None = None) -> DecodeConfig:
    """Tuning-database entry for this GPU and shape if any, else the heuristic; with this
    GPU's SM count filled in. Cached lookups, no I/O on the hot path. ``context`` is the mean
    cached tokens per request (:func:`mean_context`); None (unknown) lets the lookup take the
    configuration most of the shape's context buckets agree on. ``s_q`` (None: unknown) picks
    the entry of the query's own shape among those of the same rows."""
    tuned = lookup.lookup_decode_config(rows=rows, fp8=fp8, device=device, batch=batch, context=context,
                                        s_q=s_q)
    sms = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
           else SplitPolicy().num_sms)
    cfg = tuned if tuned is not None else heuristic_for_work(rows, fp8, batch, context, sms)
    return cfg.with_sms(sms)


def mean_context(seqlens: list[int]) -> float | None:
    """Mean cached tokens per request: the ``context`` the tuning lookup expects (its buckets
    are timed with every request at one length); None for an empty batch."""
    return sum(seqlens) / len(seqlens) if seqlens else None


@dataclass(frozen=True, eq=False)
class ContentStamp:
    """What a work list's two tensors held when ``get_mla_metadata`` planned them: their version
    counters (torch moves them on every in-place write: ``copy_``, slice assignment, ``out=``)
    and which ``num_splits`` tensor came with the work list.

    Why: the split merge's plan (which requests the decode kernel folds, whether they run as
    clusters, whether the combine runs at all) is decided on the host from the work list's
    contents. An engine that keeps the tensors as static buffers and rewrites them each step
    (FlashMLA's CUDA-graph pattern: ``meta.copy_(new_meta)``) would otherwise run new contents
    under the old decisions: partials left unmerged, or another request's partials merged. A
    stamp that no longer holds drops those decisions, and the combine merges every split, which
    is right for any contents. A CUDA graph being captured never trusts them either: replays run
    whatever the buffers hold by then (unless the capture is declared to replay the contents it
    saw: :func:`captures_replay_fixed_contents`). Writes that torch does not see (a kernel of the
    caller's own through the data pointer, a write through ``tensor.data``) cannot be noticed;
    such a caller uses ``GraphWorkList``."""

    metadata_version: int
    num_splits: weakref.ref[torch.Tensor]
    num_splits_version: int

    @classmethod
    def of(cls, metadata: torch.Tensor, num_splits: torch.Tensor) -> ContentStamp:
        return cls(metadata._version, weakref.ref(num_splits), num_splits._version)

    def holds(self, metadata: torch.Tensor, num_splits: torch.Tensor) -> bool:
        """Whether ``metadata`` (the stamped tensor) and ``num_splits`` still hold what was planned,
        outside a CUDA graph's capture."""
        return (metadata._version == self.metadata_version and self.num_splits() is num_splits
                and num_splits._version == self.num_splits_version
                and (_fixed_content_captures > 0 or not capturing(metadata)))


_fixed_content_captures = 0  # captures_replay_fixed_contents blocks open now


@contextlib.contextmanager
def captures_replay_fixed_contents() -> Iterator[None]:
    """Within this block, a CUDA graph being captured trusts the split merge a work list was
    planned with: its replays will run the very contents it was captured with (the benchmarks'
    and the tuner's graphs, which replay one step to time its kernels without the host's launch
    path). Without it a capture launches the merge that is right for any contents, since an
    engine's graph is replayed over work lists rewritten in place."""
    global _fixed_content_captures
    _fixed_content_captures += 1
    try:
        yield
    finally:
        _fixed_content_captures -= 1


@dataclass(frozen=True)
class MetadataPlan:
    """What ``get_mla_metadata`` built a work list for: the rows and format it was asked for,
    the mean context it saw, and the configuration whose row tile and split policy it used."""

    rows: int
    fp8: bool
    context: float | None
    config: DecodeConfig  # its balance settled for the batch (decode_config.settle_balance)
    requested: DecodeConfig | None = None  # what the caller passed or the choice gave, unsettled
    fold: SplitFold | None = field(default=None, compare=False)  # the split merge's counters and facts
    # the contents ``fold`` was decided from; None: a fold right for any contents (GraphWorkList's)
    stamp: ContentStamp | None = field(default=None, compare=False)
    batch: int | None = None  # the requests it was planned for (its items name requests 0..batch-1)

    def fold_for(self, metadata: torch.Tensor, num_splits: torch.Tensor, rows: int) -> SplitFold | None:
        """The fold for a decode call of ``rows`` rows on these tensors: None (the combine merges
        every split) when it was planned for other rows or other contents."""
        if self.rows != rows or (self.stamp is not None and not self.stamp.holds(metadata, num_splits)):
            return None
        return self.fold


# Work list tensor -> its MetadataPlan, so that the decode call runs the configuration the
# metadata was built for without reading anything from the device. Why a map keyed by the
# tensor's identity with a weak reference, and not a Python attribute on the tensor: the entry
# dies with the tensor (no leak; the reference check means a reused id or allocator address
# never hits), and the user's tensor is left as torch made it (a DecodeConfig in its __dict__
# would travel into torch.save / deepcopy, and torch.load(weights_only=True) would refuse the
# file). Not weakref.WeakKeyDictionary: it compares keys with ==, elementwise on tensors; and
# torch.utils.weak.WeakIdKeyDictionary (not public API) costs ~1.7 us per lookup, this ~0.3 us.
# Dict operations are atomic under the GIL; a lookup is safe inside CUDA graph capture.
_PLANS: dict[int, tuple[weakref.ref[torch.Tensor], MetadataPlan]] = {}


def record_plan(metadata: torch.Tensor, plan: MetadataPlan) -> None:
    key = id(metadata)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _PLANS.get(key)
        if entry is not None and entry[0] is ref:  # not a newer tensor's entry under the same id
            del _PLANS[key]

    _PLANS[key] = (weakref.ref(metadata, forget), plan)


def metadata_plan(tile_scheduler_metadata: object) -> MetadataPlan | None:
    """The plan ``get_mla_metadata`` recorded for this very tensor, or None (built otherwise,
    or a copy / view of it: e.g. a static buffer for CUDA graphs, for which an engine can pass
    ``config=metadata_plan(meta).config`` to the decode call). Its configuration holds for any
    contents; its split merge only while the contents are the planned ones
    (:meth:`MetadataPlan.fold_for`)."""
    entry = _PLANS.get(id(tile_scheduler_metadata))
    if entry is None or entry[0]() is not tile_scheduler_metadata:
        return None
    return entry[1]


def decode_config_for(config: DecodeConfig | None, tile_scheduler_metadata: object, rows: int,
                      fp8: bool, device: torch.device, batch: int, s_q: int | None = None) -> DecodeConfig:
    """The decode call's configuration: an explicit ``config`` wins; else the one the metadata
    was built for (same row tile and split policy, context-aware); else, for metadata built for
    the other format (e.g. FlashMLA-style ``get_mla_metadata`` defaulting to FP8 before a BF16
    decode) or other rows (which the decode calls refuse before they ask: FlashMLA's metadata
    must match q), a fresh choice at the recorded context; else, for metadata snapmla did not
    build, today's context-blind choice. Any of these is correct with any work list (the work
    items do not depend on the row tile), only possibly slower."""
    if config is not None:
        if not config.split.auto_balance:
            return config
        # an automatic balance is settled by get_mla_metadata; the work list's plan knows how
        # (a list built otherwise runs on the one-item build, which runs any list)
        plan = metadata_plan(tile_scheduler_metadata)
        if plan is not None and plan.requested == config:
            return plan.config
        return settle_blind(config)
    plan = metadata_plan(tile_scheduler_metadata)
    if plan is None:
        return settle_blind(choose_config(rows, fp8, device, batch, s_q=s_q))
    if plan.rows == rows and plan.fp8 == fp8:
        return plan.config
    return settle_blind(choose_config(rows, fp8, device, batch, plan.context, s_q))
