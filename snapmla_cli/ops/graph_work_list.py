"""A fixed-shape split-KV work list for decode steps replayed from CUDA graphs.

A CUDA graph keeps its kernels' grids and arguments, so an engine that captures its decode step
once needs a work list whose shape and configuration stay the same while the lengths change.
``get_mla_metadata`` returns new tensors each step, shaped by that step's plan;
:class:`GraphWorkList` keeps one pair of tensors and rewrites them in place every step:

- the configuration is fixed when it is made: the caller's, else the tuning database's or the
  heuristic's for the batch at ``max_context`` (or, without it, at no particular context), with
  the split plan whatever the policy says (balanced columns have no useful fixed shape: a
  column's items depend on the lengths);
- the work list has :func:`~.schedule.graph_capacity` places, enough for any lengths: the
  planner skips its finer plans that would not fit; the places past a step's plan are empty
  (their CTAs return at once in the wgmma kernels; the mma.sync kernels' load Q and write a
  scratch slot);
- split requests: the decode kernel merges those of 2 .. ``fold_limit`` splits itself (the
  counters are made once and reset themselves after each call), and the combine kernel always
  runs after it for the others (requests without keys, or with more splits), leaving the folded
  ones alone, so one captured launch sequence is right for every step's plan.

An engine calls :meth:`GraphWorkList.update` before each replay (the lengths on the host: no
wait for the GPU) and passes ``work.metadata`` / ``work.num_splits`` to the captured decode calls.
"""

from __future__ import annotations

import torch

from ..errors import SnapmlaError, show
from ..numerics.decode_args import checked_flag, is_integer
from ..numerics.formats import PAGE_SIZE
from ..sizes import MAX_SIZE as MAX_SEQLEN
from .config_choice import MetadataPlan, choose_config, record_plan
from .decode import check_rows, check_s_q, requested_device
from .decode_config import DecodeConfig, checked_config, with_balance
from .schedule import WORK_FIELDS, graph_capacity, graph_work_tables, host_seqlens
from .split_fold import fixed_fold

# requests the kernels can index (int32, MAX_SEQLEN's bound), num_splits's batch + 1 entries
# included
MAX_BATCH = MAX_SEQLEN - 1


class GraphWorkList:
    """The work list and cumulative split counts of a decode step of ``batch`` requests and
    ``num_heads_per_head_k`` (``s_q * h_q``) rows, as tensors of fixed shape on ``device``
    (``metadata`` int32 ``[capacity, 1, 4]``, ``num_splits`` int32 ``[batch + 1]``) that
    :meth:`update` rewrites for each step's lengths. A decode call given them runs ``config``
    (recorded for ``metadata`` as ``get_mla_metadata`` records its own). ``max_context``: the
    most tokens a request will hold (e.g. the block table's width x 64); it bounds the split
    plan tighter than the GPU's size alone (fewer empty places at small batches), and without
    ``config`` it is the context the configuration is looked up at (the tuning buckets are per
    context; with neither, the configuration most buckets agree on, which at small batches can
    be a long context's). ``s_q``, when given, picks the entry of this very shape among those of
    the same rows, as in :func:`get_mla_metadata`."""

    def __init__(self, batch: int, num_heads_per_head_k: int, device: torch.device | str, *, fp8: bool = True,
                 config: DecodeConfig | None = None, max_context: int | None = None,
                 s_q: int | None = None) -> None:
        if not is_integer(batch) or not 1 <= batch <= MAX_BATCH:
            raise SnapmlaError(f"batch: expected 1..{MAX_BATCH} requests (an integer), got {show(batch)}")
        check_rows(num_heads_per_head_k)
        check_s_q(s_q, num_heads_per_head_k)
        if max_context is not None and (not is_integer(max_context) or not 0 <= max_context <= MAX_SEQLEN):
            raise SnapmlaError(f"max_context: expected the most tokens a request holds (0..{MAX_SEQLEN}, "
                               f"int32 lengths), got {show(max_context)}")
        fp8 = checked_flag("fp8", fp8)
        config = checked_config(config, fp8)
        self.max_context = max_context
        self.device = requested_device(device)  # (last: a bad argument is named before a missing GPU)
        self.batch, self.rows, self.fp8 = batch, num_heads_per_head_k, fp8
        context = None if max_context is None else float(max_context)
        requested = config or choose_config(num_heads_per_head_k, fp8, self.device, batch, context, s_q)
        self.config = with_balance(requested, False)  # the split plan: a fixed shape
        max_blocks = None if max_context is None else -(-max_context // PAGE_SIZE)
        self.capacity = graph_capacity(batch, num_heads_per_head_k, self.config.block_m, self.config.split,
                                       max_blocks)
        self.metadata = torch.empty((self.capacity, 1, WORK_FIELDS), dtype=torch.int32, device=self.device)
        self.num_splits = torch.empty(batch + 1, dtype=torch.int32, device=self.device)
        fold = fixed_fold(batch, num_heads_per_head_k, self.config.block_m, self.device)
        record_plan(self.metadata, MetadataPlan(num_heads_per_head_k, fp8, None, self.config, requested, fold,
                                                batch=batch))
        self.update(torch.zeros(batch, dtype=torch.int32))

    def update(self, cache_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan the step of these lengths (int32 ``[batch]``, best on the host: lengths on the GPU
        are read back, which waits for the stream) into :attr:`metadata` and :attr:`num_splits`,
        by copies queued on the current stream; returns the two tensors."""
        seqlens = host_seqlens(cache_seqlens)
        if len(seqlens) != self.batch:
            raise SnapmlaError(f"cache_seqlens: expected {self.batch} lengths (the batch this work list was "
                               f"made for), got {len(seqlens)}")
        if self.max_context is not None and max(seqlens) > self.max_context:
            raise SnapmlaError(f"cache_seqlens: a length of {max(seqlens)} exceeds max_context={self.max_context}, "
                               "which this work list was sized for")
        work, cumulative, _ = graph_work_tables(seqlens, self.rows, self.config.block_m, self.config.split,
                                                self.capacity)
        self.metadata.copy_(torch.from_numpy(work), non_blocking=True)
        self.num_splits.copy_(torch.from_numpy(cumulative), non_blocking=True)
        return self.metadata, self.num_splits
