"""A decode call's launches, prepared once per argument signature and then replayed.

Why: an eager decode call (one not replayed from a CUDA graph) ran every argument check and
rebuilt both launches each time: 112-190 us of host time per call at b 1 on the H200's host,
against 16-24 us of GPU work (docs/PERF.md, eighteenth session), paid on every layer by an
engine that launches from Python. Now the first call of a signature (shapes, dtypes, devices,
the metadata tensor, the configuration object, scale, causal) runs every check of :mod:`.decode`
and stores a :class:`DecodePlan`; a later call tests only what the key cannot see (contiguity,
start addresses, the block table's inner stride, a caller's ``out`` / ``lse``), looks up the
cache's TMA maps, allocates the outputs and the split buffers, and launches.

The cache's address is not in the key: an engine calls every layer of a step, each on its own
cache, with that step's one work list, so a key holding the address made every call of an eager
loop a first call (about 4x the host time of a replay).

A plan holds for one metadata tensor (a weak reference: ids are reused) and one configuration
object, and one whose split merge was decided from the work list's contents only while they are
unchanged (``config_choice.ContentStamp``: no in-place write since, no graph capture); a plan
whose work list was freed is dropped at the next first call (a decode loop plans once per step),
and the cache forgets every plan when the loaded kernels are forgotten or a kernel build switch
changes (:func:`clear_plans`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.cluster_launch import ClusterLaunch
from ..runtime.launch import (
    Kernel,
    current_device_index,
    current_raw_stream,
    launch_prepared,
    launch_raw,
    on_kernels_cleared,
    prepare_plain,
    prepare_programmatic,
)
from ..runtime.pdl import PreparedLaunch, ProgrammaticLaunch
from ..tuning.lookup import on_cache_cleared
from .config_choice import ContentStamp
from .decode_config import DecodeConfig
from .prep import QuantizeQLaunch
from .split_fold import COMBINE_THREADS

MAX_PLANS = 1024  # plans kept (all forgotten when full: signatures change rarely)
COMBINE_BLOCK = (COMBINE_THREADS, 1, 1)
# kernels/combine.cu's arguments: partial out / lse, num_splits, out, lse; h_q, s_q, folded_up_to
COMBINE_ARG_TYPES = (ctypes.c_void_p,) * 5 + (ctypes.c_int32,) * 3


@dataclass(frozen=True, eq=False, slots=True)
class DecodePlan:
    """Everything of a decode call that its key fixes: the kernels, grids, scalar arguments and
    buffer shapes. ``run`` adds the per-call pointers."""

    metadata: weakref.ref[torch.Tensor]  # the work list it was built for
    stamp: ContentStamp | None  # the contents its split merge was decided from (None: any contents)
    config: DecodeConfig | None  # the caller's configuration object (identity)
    device: torch.device
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    # the split rows' float32 buffer, one allocation: O / L [places, rows, 512], then lse
    # [places, rows] (``partial_lse_offset`` bytes in; a multiple of 16)
    partial_floats: int
    partial_lse_offset: int
    decode: Kernel | None  # None: no work item (every request empty)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    cluster_launch: ClusterLaunch | None  # a request's splits in one cluster (ops/cluster_fold.py)
    # the decode kernel's prepared plain launch when not in clusters (None: no driver entry for
    # it, then CuPy launches; runtime/launch.py prepare_plain)
    plain_launch: PreparedLaunch | None
    # the wgmma kernels' TMA maps of a cache (runtime/tensor_map.py, a cached lookup per call);
    # None: the kernel reads the cache itself
    cache_maps: Callable[[torch.Tensor], torch.Tensor] | None
    items_per_column: np.int32
    scalars: tuple[object, ...]  # block-table stride, scale * log2(e), h_q, s_q, causal
    fold: tuple[object, ...] | None  # wgmma kernels: (arrivals pointer, fold limit); else None
    combine: Kernel | None  # None: the decode kernel merged every split itself
    combine_launch: ProgrammaticLaunch | None  # its prepared programmatic launch
    combine_grid: tuple[int, int, int]
    combine_scalars: tuple[object, ...]  # h_q, s_q, folded_up_to
    # what the pointers above point into and nothing else holds (the fold's counters): never a
    # caller's tensor, which a plan must not keep alive
    keep: tuple[object, ...]
    # flash_mla_with_kvcache's plans: the Q-quant launch into the call's workspace (run_fused)
    q_quant: QuantizeQLaunch | None = None

    @property
    def cluster_size(self) -> int:
        """The thread-block cluster the decode kernel is launched in (0: none)."""
        return 0 if self.cluster_launch is None else self.cluster_launch.dims[1]

    def holds_for(self, metadata: torch.Tensor, num_splits: torch.Tensor, config: DecodeConfig | None) -> bool:
        return (self.metadata() is metadata and self.config is config
                and (self.stamp is None or self.stamp.holds(metadata, num_splits)))

    def fused(self, q_quant: QuantizeQLaunch, metadata: weakref.ref[torch.Tensor]) -> DecodePlan:
        """This plan with Q's quantization in front (``metadata``: the reference under the fused
        call's own key)."""
        return dataclasses.replace(self, q_quant=q_quant, metadata=metadata)

    def run_fused(self, q_ptr: int, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                  metadata: torch.Tensor, num_splits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize the bf16 Q at ``q_ptr`` and decode it: Q's FP8 rows and the split rows are
        carved out of one workspace allocation (Q's parts first, then the split rows), freed on
        return like the split buffer of :meth:`run`."""
        quant = self.q_quant
        if quant is None:
            raise AssertionError("run_fused on a plan without its Q-quant launch")
        # (on the plan's GPU whichever is current: the allocation names it, the Q-quant launch
        # and run switch to it)
        workspace = torch.empty(size=(quant.nbytes + self.partial_floats * torch.float32.itemsize,), dtype=torch.uint8,
                                device=self.device)
        base = workspace.data_ptr()
        quant(q_ptr, base)
        return self.run((base, base + quant.scale_offset, base + quant.rope_offset), k_cache, block_table,
                        cache_seqlens, metadata, num_splits, None, None, partial_out=base + quant.nbytes)

    def run(self, q_ptrs: tuple[int, ...], k_cache: torch.Tensor, block_table: torch.Tensor,
            cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor,
            out: torch.Tensor | None, lse: torch.Tensor | None,
            partial_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate what the caller did not give, launch the decode kernel and the combine, on
        the tensors' GPU: the kernels belong to its context, which need not be the current one
        (a process driving several GPUs). ``k_cache`` is checked already (shape by the key,
        start address and contiguity by the caller). ``partial_out``: the split rows' buffer
        in a workspace the caller holds until the kernels are queued (else allocated here)."""
        if self.device.type == "cuda" and current_device_index() != self.device.index:
            with torch.cuda.device(self.device):
                return self.run(q_ptrs, k_cache, block_table, cache_seqlens, metadata, num_splits, out, lse,
                                partial_out)
        device = self.device
        if out is None:
            out = torch.empty(size=self.out_shape, dtype=torch.bfloat16, device=device)
        if lse is None:
            lse = torch.empty(size=self.lse_shape, dtype=torch.float32, device=device)
        partial: torch.Tensor | None = None
        if partial_out is None:
            # (freed on return: the caching allocator reuses it only after the kernels queued here)
            partial = torch.empty(size=(self.partial_floats,), dtype=torch.float32, device=device)
            partial_out = partial.data_ptr()
        partial_lse = partial_out + self.partial_lse_offset
        out_ptr, lse_ptr = out.data_ptr(), lse.data_ptr()
        if self.decode is not None:
            cache_ptr = (k_cache if self.cache_maps is None else self.cache_maps(k_cache)).data_ptr()
            args: list[object] = [*q_ptrs, cache_ptr, block_table.data_ptr(), cache_seqlens.data_ptr(),
                                  metadata.data_ptr(), self.items_per_column, out_ptr, lse_ptr,
                                  partial_out, partial_lse, *self.scalars]
            if self.fold is not None:
                args += [num_splits.data_ptr(), *self.fold]
            prepared = self.cluster_launch or self.plain_launch
            if prepared is not None:
                prepared(current_raw_stream(self.decode.device_index), args)
            else:
                launch_raw(self.decode, self.grid, self.block, args, self.shared_mem)
        if self.combine is not None:
            # programmatic: launched while the decode grid drains, it waits for it in the kernel
            launch_prepared(self.combine, self.combine_launch, self.combine_grid, COMBINE_BLOCK,
                            [partial_out, partial_lse, num_splits.data_ptr(), out_ptr, lse_ptr,
                             *self.combine_scalars])
        return out, lse


_PLANS: dict[tuple[object, ...], DecodePlan] = {}
# keys of plans whose work list was freed (weakref callbacks only append: the dict itself is
# changed by store_plan, never from inside a garbage collection)
_FREED_KEYS: list[tuple[object, ...]] = []


def metadata_ref(metadata: torch.Tensor, key: tuple[object, ...] | None) -> weakref.ref[torch.Tensor]:
    """A plan's weak reference to its work list; with a key, the plan is dropped once the list
    is freed (an eager loop makes one list per step: its plans would pile up to MAX_PLANS)."""
    if key is None:
        return weakref.ref(metadata)
    return weakref.ref(metadata, lambda _ref: _FREED_KEYS.append(key))


def combine_launch(kernel: Kernel | None, grid: tuple[int, int, int]) -> ProgrammaticLaunch | None:
    """The combine's prepared programmatic launch (None without a combine or without PDL)."""
    return None if kernel is None else prepare_programmatic(kernel, grid, COMBINE_BLOCK, 0, COMBINE_ARG_TYPES)


def decode_launch(kernel: Kernel | None, grid: tuple[int, int, int], block: tuple[int, int, int],
                  shared_mem: int, cluster: int) -> PreparedLaunch | None:
    """The decode kernel's prepared plain launch (None: in clusters, no kernel, or no driver
    entry for it)."""
    return None if kernel is None or cluster else prepare_plain(kernel, grid, block, shared_mem)


def find_plan(key: tuple[object, ...], metadata: torch.Tensor, num_splits: torch.Tensor,
              config: DecodeConfig | None) -> DecodePlan | None:
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable argument (a list as softmax_scale): the full checks name it
        return None
    return plan if plan is not None and plan.holds_for(metadata, num_splits, config) else None


def _drop_freed() -> None:
    """Forget the plans whose work list is gone (a plan of a newer list under a reused id stays).
    Another thread may take the last key between a test and a pop: the pop itself is the test."""
    while True:
        try:
            key = _FREED_KEYS.pop()
        except IndexError:
            return
        plan = _PLANS.get(key)
        if plan is not None and plan.metadata() is None:
            _PLANS.pop(key, None)  # (another thread may have cleared it since)


def store_plan(key: tuple[object, ...], plan: DecodePlan) -> None:
    _drop_freed()
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def stored_plans() -> list[DecodePlan]:
    """The plans kept now (for diagnostics and A/B scripts: which launch a call replays)."""
    return list(_PLANS.values())


def clear_plans() -> None:
    """Forget every plan (a kernel build switch changed, or the loaded kernels were dropped)."""
    _PLANS.clear()
    _FREED_KEYS.clear()


on_kernels_cleared(clear_plans)
on_cache_cleared(clear_plans)  # a plan holds the tuning database's answer of its time
