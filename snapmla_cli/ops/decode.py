"""Python faces of the decode kernels: FlashMLA-compatible ``get_mla_metadata`` /
``flash_mla_with_kvcache`` dispatching on the cache format, and ``decode_fp8`` taking an
already-quantized Q so that an engine quantizes once per step.

Every argument is checked (shape, dtype, device, contiguity) with a one-line
:class:`SnapmlaError`: fully on the first call of an argument signature, which stores the
call's prepared launches (:mod:`.decode_launch`), and on later calls what the signature does
not fix (contiguity, a caller's ``out`` / ``lse``). The devices are checked after every
layout, the work list's planned batch and rows, the scale, ``causal`` and ``config``
(:func:`_checked_call`), so that a call on a machine without a GPU names a bad argument before it
reports the missing GPU. The launch path
does no host synchronisation (the output and split buffers are sized from shapes only), so a
decode step can be captured in a CUDA graph.
The configuration is chosen once per step, in ``get_mla_metadata`` (which reads the lengths
anyway, so it knows the context), and travels with the metadata tensor to the decode calls.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import ParamSpec, TypeVar

import numpy as np
import torch

from ..cache.layout import gather_from_pages
from ..errors import NoGpuError, SnapmlaError, dtype_name, show
from ..numerics.decode_args import (
    LOG2E,
    check_key_pads,
    checked_flag,
    checked_lengths,
    checked_softmax_scale,
    is_integer,
    require_strided,
)
from ..numerics.formats import (
    D_QK,
    D_V,
    FP8_CACHE_DTYPES,
    FP8_DTYPE,
    FP8_TOKEN_BYTES,
    PAGE_SIZE,
)
from ..numerics.quant import QuantizedRows, as_e4m3
from ..runtime.cluster_launch import ClusterLaunch
from ..runtime.gpu_arch import require_arch
from ..sizes import MAX_SIZE
from .alignment import VEC_ALIGN, misaligned, require_aligned
from .cluster_fold import cluster_defines, holds_a_wave, planned_cluster
from .config_choice import (
    ContentStamp,
    MetadataPlan,
    choose_config,
    decode_config_for,
    mean_context,
    metadata_plan,
    record_plan,
)
from .decode_config import (
    DecodeConfig,
    bf16_defines,
    bf16_kernel,
    bf16_smem_bytes,
    checked_config,
    cluster_capable,
    fp8_defines,
    fp8_kernel,
    fp8_smem_bytes,
    runs_columns,
    settle_balance,
)
from .decode_launch import (
    DecodePlan,
    combine_launch,
    decode_launch,
    find_plan,
    metadata_ref,
    store_plan,
)
from .finite import GPU_CHECKS, capturing, check_all_finite, check_finite, check_quantizable
from .schedule import WORK_FIELDS, build_work_list, check_work_list, host_seqlens
from .split_fold import (
    SplitFold,
    combine_after,
    combine_rows_per_cta,
    kernel_arrivals,
    kernel_fold_limit,
    plan_fold,
)

__all__ = ["MetadataPlan", "choose_config", "decode_bf16", "decode_fp8",
           "flash_mla_with_kvcache", "get_mla_metadata", "mean_context", "metadata_plan"]

FLOAT32_BYTES = 4


def _runtime() -> ModuleType:
    from ..runtime import launch  # imported lazily: CuPy is optional

    return launch


def get_mla_metadata(
    cache_seqlens: torch.Tensor | None = None,
    num_heads_per_head_k: int | None = None,
    num_heads_k: int = 1,
    num_heads_q: int | None = None,
    is_fp8_kvcache: bool | None = None,
    topk: int | None = None,
    *,
    num_q_tokens_per_head_k: int | None = None,
    fp8: bool | None = None,
    config: DecodeConfig | None = None,
    device: torch.device | str | None = None,
    s_q: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV work list and cumulative split counts (see :mod:`snapmla_cli.ops.schedule`):
    ``(tile_scheduler_metadata, num_splits)``, int32 ``[ctas, items, 4]`` and int32 ``[b + 1]``
    on ``device`` (or ``cache_seqlens``'s), to pass on to the decode calls.
    ``num_heads_per_head_k`` is ``s_q * h_q`` as in FlashMLA (whose later versions call it
    ``num_q_tokens_per_head_k``: either keyword is taken, one of them given); ``num_heads_k``
    must be 1.
    ``s_q`` (optional, not in FlashMLA's signature): the query tokens per request, so that the
    configuration choice takes the tuning entry of this very shape where two shapes have the
    same rows (h_q 32 s_q 1 and h_q 16 s_q 2); without it the rows alone decide.

    FlashMLA's later arguments are taken: ``num_heads_q`` (h_q: it gives ``s_q``),
    ``is_fp8_kvcache`` (the same as ``fp8``; FP8 unless one says otherwise); ``topk`` (sparse
    attention) is refused.

    ``cache_seqlens`` is read to the host once; its mean length is the context of the
    configuration choice (unless ``config`` is given), and it settles an automatic split
    policy (balanced columns or the split plan, :func:`settle_balance`). The settled
    configuration is recorded for the returned work list (:func:`metadata_plan`), and a decode
    call given that tensor and no ``config`` (or the unsettled one) runs it: the two calls
    cannot disagree, and the decode needs no host read. The returned tensors may be rewritten in
    place with a later step's list of the same shape (FlashMLA's static buffers for CUDA graphs)
    by torch operations, which move their version counters: the decode then merges the splits in
    the way right for any contents (the combine), as it does in a graph capture.

    Reading lengths that live on the GPU waits for the stream that writes them. An engine that
    keeps its lengths on the host (a CPU tensor) passes them with ``device``, the GPU the decode
    runs on: the call then never waits for the GPU, and the tensors go to ``device`` by
    asynchronous copies. Without ``device`` the tensors go where ``cache_seqlens`` is."""
    if cache_seqlens is None:  # FlashMLA's newest form takes no argument (and plans lazily)
        raise SnapmlaError("cache_seqlens: expected the requests' lengths, an int32 [batch] tensor: snapmla "
                           "plans its work list from them (get_mla_metadata(cache_seqlens, s_q * h_q, 1)); "
                           "FlashMLA's argument-free form and its lazily planned FlashMLASchedMeta are not "
                           "supported")
    num_heads_per_head_k, rows_name = _rows_argument(num_heads_per_head_k, num_q_tokens_per_head_k)
    if not is_integer(num_heads_k) or num_heads_k != 1:
        raise SnapmlaError(f"num_heads_k: expected 1 (MLA has one latent KV head), got {show(num_heads_k)}")
    if topk is not None:
        raise SnapmlaError(f"topk: sparse attention is not supported (snapmla decodes dense MLA); pass None, "
                           f"got {show(topk)}")
    check_rows(num_heads_per_head_k, rows_name)
    check_s_q(s_q, num_heads_per_head_k)
    s_q = _s_q_of(s_q, num_heads_q, num_heads_per_head_k)
    fp8 = _cache_format(fp8, is_fp8_kvcache)
    config = checked_config(config, fp8)
    seqlens = host_seqlens(cache_seqlens)  # (checks that it is an int32 [b] tensor)
    target = _metadata_device(cache_seqlens, device)
    context = mean_context(seqlens)
    requested = config or choose_config(num_heads_per_head_k, fp8, target, len(seqlens), context, s_q)
    cfg = settle_balance(requested, seqlens, num_heads_per_head_k, fp8)
    work = build_work_list(cache_seqlens, num_heads_per_head_k, cfg.block_m, cfg.split, seqlens,
                           runs_columns(cfg, fp8), target)
    fold = plan_fold(work.splits_per_request, num_heads_per_head_k, cfg.block_m, target, work.cluster)
    record_plan(work.metadata, MetadataPlan(num_heads_per_head_k, fp8, context, cfg, requested, fold,
                                            ContentStamp.of(work.metadata, work.num_splits), len(seqlens)))
    return work.metadata, work.num_splits


def _rows_argument(num_heads_per_head_k: int | None, num_q_tokens_per_head_k: int | None) -> tuple[int, str]:
    """The rows (``s_q * h_q``) under either of FlashMLA's names for them, exactly one given, and
    the name it came under (for its errors)."""
    given = [(value, name) for value, name in ((num_heads_per_head_k, "num_heads_per_head_k"),
                                               (num_q_tokens_per_head_k, "num_q_tokens_per_head_k"))
             if value is not None]
    if len(given) != 1:
        raise SnapmlaError("num_heads_per_head_k: expected the rows s_q * h_q, given once (or as "
                           f"num_q_tokens_per_head_k, FlashMLA's later name), got {len(given)} values")
    return given[0]


def _s_q_of(s_q: int | None, num_heads_q: int | None, num_heads_per_head_k: int) -> int | None:
    """The query tokens per request, from ``s_q`` or FlashMLA's ``num_heads_q`` (rows = s_q * h_q)."""
    if num_heads_q is None:
        return s_q
    if not is_integer(num_heads_q) or num_heads_q < 1 or num_heads_per_head_k % num_heads_q:
        raise SnapmlaError(f"num_heads_q: expected a positive divisor of num_heads_per_head_k "
                           f"({num_heads_per_head_k} = s_q * h_q), got {show(num_heads_q)}")
    derived = int(num_heads_per_head_k // num_heads_q)
    if s_q is not None and s_q != derived:
        raise SnapmlaError(f"s_q: {show(s_q)} disagrees with num_heads_q {num_heads_q} "
                           f"({num_heads_per_head_k} rows = {derived} x {num_heads_q})")
    return derived


def _cache_format(fp8: object, is_fp8_kvcache: object) -> bool:
    """Whether the work list is for the FP8 cache: ``fp8`` or FlashMLA's ``is_fp8_kvcache``
    (they must agree when both are given); FP8 when neither is."""
    if is_fp8_kvcache is None:
        return True if fp8 is None else checked_flag("fp8", fp8)
    flag = checked_flag("is_fp8_kvcache", is_fp8_kvcache)
    if fp8 is not None and checked_flag("fp8", fp8) != flag:
        raise SnapmlaError(f"is_fp8_kvcache: {flag} disagrees with fp8={fp8}")
    return flag


# the kernels take h_q and s_q (and index rows) as int32, as the sizes of sizes.MAX_SIZE
MAX_ROWS = MAX_SIZE


def check_rows(num_heads_per_head_k: int, name: str = "num_heads_per_head_k") -> None:
    """The work list's row count (``s_q * h_q``) is at least one and fits the kernels' int32;
    ``name``: the keyword the caller gave it under (FlashMLA's later ``num_q_tokens_per_head_k``)."""
    if not is_integer(num_heads_per_head_k):
        raise SnapmlaError(f"{name}: expected an integer (s_q * h_q), got {type(num_heads_per_head_k).__name__}")
    if not 1 <= num_heads_per_head_k <= MAX_ROWS:
        raise SnapmlaError(f"{name}: expected 1 <= s_q * h_q <= {MAX_ROWS}, got {show(num_heads_per_head_k)}")


def check_s_q(s_q: int | None, num_heads_per_head_k: int) -> None:
    """An optional ``s_q`` is a positive integer that divides the rows (``s_q * h_q``)."""
    if s_q is None:
        return
    if not is_integer(s_q) or s_q < 1 or num_heads_per_head_k % s_q:
        raise SnapmlaError(f"s_q: expected the query tokens per request, a positive divisor of "
                           f"num_heads_per_head_k={num_heads_per_head_k} (s_q * h_q), got {show(s_q)}")


def _metadata_device(cache_seqlens: torch.Tensor, device: torch.device | str | None) -> torch.device:
    """Where ``get_mla_metadata``'s tensors go: ``device`` if given (lengths on the host, or on
    that very device), else where the lengths are."""
    if device is None:
        return cache_seqlens.device
    target = requested_device(device)
    if cache_seqlens.device.type != "cpu" and cache_seqlens.device != target:
        raise SnapmlaError(f"device: {target}, but cache_seqlens is on {cache_seqlens.device} "
                           "(give host lengths, or lengths on that device)")
    return target


def requested_device(device: torch.device | str) -> torch.device:
    """The caller's ``device`` argument as a torch device, a CUDA one with its index (the current
    device's where none is given); a one-line error for anything else or a missing GPU."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise SnapmlaError(f"device: expected a torch device such as 'cuda:0', got {show(device)}") from err
    if target.type not in ("cpu", "cuda"):
        raise SnapmlaError(f"device: expected 'cpu' or a CUDA device such as 'cuda:0', got {show(device)}")
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise NoGpuError(f"device: {target} requested, but no CUDA GPU is available")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        elif target.index >= torch.cuda.device_count():
            raise SnapmlaError(f"device: {target} requested, but this machine has "
                               f"{torch.cuda.device_count()} CUDA GPU(s)")
    return target


def _require_cuda(t: torch.Tensor, name: str, device: torch.device | None) -> None:
    if t.device.type != "cuda":
        raise NoGpuError(f"{name}: expected a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise SnapmlaError(f"{name}: on {t.device}, expected {device} like q")


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int | None, ...]) -> None:
    """Dtype, shape and contiguity; not the device (:func:`_checked_call` checks it after every
    argument's layout, so that a bad argument is named on a machine without a GPU too)."""
    if t.dtype != dtype:
        raise SnapmlaError(f"{name}: expected {dtype_name(dtype)}, got {dtype_name(t.dtype)}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise SnapmlaError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise SnapmlaError(f"{name}: must be contiguous")


def _check_table(block_table: torch.Tensor, cache_seqlens: torch.Tensor, b: int) -> None:
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        raise SnapmlaError(f"block_table: expected int32 [{b}, max_blocks], got {dtype_name(block_table.dtype)} {list(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise SnapmlaError("block_table: rows must be contiguous (stride 1 along blocks)")
    _check(cache_seqlens, "cache_seqlens", torch.int32, (b,))


def _check_metadata(metadata: torch.Tensor, num_splits: torch.Tensor, b: int) -> None:
    """Shapes, and the batch the work list was planned for where snapmla planned it: its items
    name requests 0..batch-1, which the kernels index q, the table and out with unchecked (a
    larger list with ``num_splits[:b + 1]`` passes every shape check). A copy's batch is not known
    without reading it; the checks switch's work-list check reads it."""
    _check(metadata, "tile_scheduler_metadata", torch.int32, (None, None, WORK_FIELDS))
    _check(num_splits, "num_splits", torch.int32, (b + 1,))
    plan = metadata_plan(metadata)
    if plan is not None and plan.batch is not None and plan.batch != b:
        raise SnapmlaError(f"tile_scheduler_metadata: planned for {plan.batch} requests, the call has {b} "
                           "(a work list of a larger batch with num_splits[:b + 1]? plan one for this batch)")


def _check_planned_rows(metadata: torch.Tensor, s_q: int, h_q: int) -> None:
    """The query rows (``s_q * h_q``) the work list was planned for where snapmla planned it are
    the call's, as FlashMLA requires of its metadata. Why an error although any work list decodes
    right with any rows: its split count and the configuration it carries were sized for the
    planned rows, and a mismatch is a caller's slip (rows ``h_q`` for an MTP step of ``s_q`` 2,
    one step's list reused for another head count) that would otherwise only run slower. A copy's
    rows are not known and are not checked."""
    plan = metadata_plan(metadata)
    rows = s_q * h_q
    if plan is not None and plan.rows != rows:
        raise SnapmlaError(f"tile_scheduler_metadata: planned for {plan.rows} query rows (num_heads_per_head_k "
                           f"= s_q * h_q), the call has {rows} (s_q {s_q} x h_q {h_q}); plan it with "
                           f"get_mla_metadata(cache_seqlens, {rows}, 1)")


def _paged(k_cache: torch.Tensor, row: int) -> bool:
    """Whether ``k_cache`` is ``[blocks, 64, row]`` or ``[blocks, 64, 1, row]`` (FlashMLA's form)."""
    return k_cache.shape[1:] in ((PAGE_SIZE, row), (PAGE_SIZE, 1, row))


def _fp8_cache_rows(k_cache: torch.Tensor) -> torch.Tensor:
    """The FP8 cache as uint8 rows, checked: dtype, shape, contiguity and the start the kernels'
    16-byte loads need."""
    given = k_cache.dtype  # (named in the error as the caller passed it, not as viewed)
    if k_cache.dtype == FP8_DTYPE:
        k_cache = k_cache.view(torch.uint8)
    if k_cache.dtype != torch.uint8 or not _paged(k_cache, FP8_TOKEN_BYTES):
        raise SnapmlaError(
            f"k_cache: expected FP8 cache uint8/float8_e4m3fn [blocks, 64, {FP8_TOKEN_BYTES}] or "
            f"[blocks, 64, 1, {FP8_TOKEN_BYTES}], got {dtype_name(given)} {list(k_cache.shape)}")
    if not k_cache.is_contiguous():
        raise SnapmlaError("k_cache: must be contiguous")
    require_aligned("k_cache", k_cache)
    return k_cache


def _bf16_cache_rows(k_cache: torch.Tensor) -> torch.Tensor:
    """The bf16 cache as ``[blocks, 64, 1, 576]``, checked; an error names the shape the caller
    passed and both accepted forms (the 3-d form was named as its 4-d view, a shape never passed)."""
    if k_cache.dtype != torch.bfloat16:
        raise SnapmlaError(f"k_cache: expected bfloat16, got {dtype_name(k_cache.dtype)}")
    if not _paged(k_cache, D_QK):
        raise SnapmlaError(f"k_cache: expected shape [blocks, {PAGE_SIZE}, {D_QK}] or [blocks, {PAGE_SIZE}, 1, "
                           f"{D_QK}], got {list(k_cache.shape)}")
    if not k_cache.is_contiguous():
        raise SnapmlaError("k_cache: must be contiguous")
    return k_cache.unsqueeze(2) if k_cache.dim() == 3 else k_cache


def _check_outputs(out: torch.Tensor | None, lse: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """``shape``: the call's (b, s_q, h_q). Layouts only: their device is checked with the
    other tensors' (:func:`_one_device`, a replay's :func:`_require_on`)."""
    b, s_q, h_q = shape
    if out is not None:
        _check(out, "out", torch.bfloat16, (b, s_q, h_q, D_V))
        require_aligned("out", out)
    if lse is not None:
        _check(lse, "lse", torch.float32, (b, h_q, s_q))


def _checked_call(shape: tuple[int, int, int], q_parts: tuple[tuple[str, torch.Tensor], ...], cache: torch.Tensor,
                  block_table: torch.Tensor, cache_seqlens: torch.Tensor, metadata: torch.Tensor,
                  num_splits: torch.Tensor, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  *, softmax_scale: float | None, causal: bool, table_reads: bool = False) -> torch.device:
    """A first call's checks after its own q and cache layouts, in an order that names a bad
    argument before a missing GPU: the table, lengths, work list (its batch and rows) and outputs
    against the call's ``shape`` (b, s_q, h_q); ``softmax_scale`` and ``causal`` (the launch plan
    reads them again; a NaN scale or ``causal="false"`` is a caller's slip to name on any machine);
    every tensor on q's device; with ``table_reads``
    the checks switch's reads of the table and work list (after the shapes: the table's batch is
    q's; on one device: they index one tensor with another); then q's device a CUDA one. Why this
    order: on a machine without a GPU every decode call ends at the last step, and a caller whose
    shape is wrong should hear about the shape, not only about the GPU. Returns the device."""
    b, s_q, h_q = shape
    if s_q < 1 or h_q < 1:  # (the work-list check would send the caller to plan 0 rows, itself refused)
        raise SnapmlaError(f"{q_parts[0][0]}: expected at least one query token and one head per request, "
                           f"got s_q {s_q} and h_q {h_q}")
    _check_table(block_table, cache_seqlens, b)
    _check_metadata(metadata, num_splits, b)
    _check_planned_rows(metadata, s_q, h_q)
    _check_outputs(out, lse, shape)
    checked_softmax_scale(softmax_scale)
    checked_flag("causal", causal)
    device = _one_device((*q_parts, ("k_cache", cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens),
                          ("tile_scheduler_metadata", metadata), ("num_splits", num_splits), ("out", out),
                          ("lse", lse)))
    if table_reads and GPU_CHECKS.on:
        _check_table_reads(block_table, cache_seqlens, b, cache, metadata, num_splits)
    q_name, q = q_parts[0]
    _require_cuda(q, q_name, None)
    return device


def _one_device(named: Iterable[tuple[str, torch.Tensor | None]]) -> torch.device:
    """The first tensor's device (q's), after checking that every other given one is on it; a
    mismatch is named as it was when each tensor was checked for CUDA: a host q among CUDA
    tensors as q (the one to move), else the odd one out (a host tensor, or another GPU's)."""
    tensors = [(name, t) for name, t in named if t is not None]
    first_name, first = tensors[0]
    for name, t in tensors[1:]:
        if t.device != first.device:
            _require_cuda(first, first_name, None)
            _require_cuda(t, name, first.device)
    return first.device


def _require_on(device: torch.device, named: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    """Each given tensor a CUDA one on ``device`` (a replayed call's outputs on its plan's GPU)."""
    for name, t in named:
        if t is not None:
            _require_cuda(t, name, device)


def _split_fold(tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor, rows: int
                ) -> tuple[SplitFold | None, ContentStamp | None]:
    """The fold ``get_mla_metadata`` planned for this very work list, these rows and these
    contents, and the stamp a launch plan built on it must keep checking; (None, None) for a
    copy of the list, one built for other rows, or one rewritten since (the combine merges)."""
    plan = metadata_plan(tile_scheduler_metadata)
    fold = None if plan is None else plan.fold_for(tile_scheduler_metadata, num_splits, rows)
    return fold, (None if fold is None or plan is None else plan.stamp)


def _split_kv_decode(
    fp8: bool,
    operands: tuple[torch.Tensor, ...],
    shape: tuple[int, int, int],
    device: torch.device,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    cfg: DecodeConfig,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    requested: DecodeConfig | None = None,
    plan_key: tuple[object, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What both decode kernels share, on a call's first run with every argument checked
    (:func:`_checked_call`): the plan of the launches (:func:`_decode_plan`), stored under
    ``plan_key`` for the calls after it (:mod:`.decode_launch`), then run. ``operands`` are the
    kernel's leading pointer arguments (Q parts, then the checked cache); ``requested`` is the
    caller's configuration object."""
    plan = _decode_plan(fp8, operands[-1], shape, device, block_table.stride(0), tile_scheduler_metadata,
                        num_splits, softmax_scale, causal, cfg, requested, plan_key)
    if plan_key is not None:
        store_plan(plan_key, plan)
    return plan.run(tuple(t.data_ptr() for t in operands[:-1]), operands[-1], block_table, cache_seqlens,
                    tile_scheduler_metadata, num_splits, out, lse)


def _cache_maps(fp8: bool, cfg: DecodeConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The TMA map lookup of the configuration's kernel (None: it reads the cache itself). The
    maps are built here, on a call's first run, so that a replay finds them cached."""
    if not cfg.wgmma:
        return None
    from ..runtime import tensor_map  # (looked up per plan: tests stand in for the driver)

    return tensor_map.fp8_cache_tensor_maps if fp8 else tensor_map.bf16_cache_tensor_map


def _decode_plan(fp8: bool, cache: torch.Tensor, shape: tuple[int, int, int], device: torch.device,
                 table_stride: int, tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor,
                 softmax_scale: float | None, causal: bool, cfg: DecodeConfig, requested: DecodeConfig | None,
                 plan_key: tuple[object, ...] | None = None) -> DecodePlan:
    """The decode launch over (row tiles x work items) and the combine's, for arguments already
    checked: kernels, grids, scalar arguments, buffer shapes, the fold's counters, and the
    cache's TMA maps built (the wgmma kernels). ``plan_key``: the key the plan is stored under
    (it is dropped when the work list is freed)."""
    b, s_q, h_q = shape
    rows = s_q * h_q
    scale = checked_softmax_scale(softmax_scale)
    causal = checked_flag("causal", causal)
    columns, items_per_column = tile_scheduler_metadata.shape[:2]
    num_work = columns * items_per_column  # places, the empty ones included
    fold, stamp = _split_fold(tile_scheduler_metadata, num_splits, rows)
    arrivals = kernel_arrivals(fold, cfg.wgmma)  # the wgmma kernels merge split requests themselves
    rt = _runtime()
    # a kernel that runs columns takes one per CTA row; the others one place (item) each
    ctas = columns if runs_columns(cfg, fp8) else num_work
    grid = (math.ceil(rows / cfg.block_m), ctas, 1)
    block = (cfg.threads(fp8), 1, 1)
    shared_mem = fp8_smem_bytes(cfg) if fp8 else bf16_smem_bytes(cfg)
    cache_maps = _cache_maps(fp8, cfg)
    if cache_maps is not None:
        cache_maps(cache)  # (built now, before any capture; checks that the cache is whole pages)
    kernel = None
    cluster = 0
    if num_work > 0:
        source_name = fp8_kernel(cfg) if fp8 else bf16_kernel(cfg)
        defines = fp8_defines(cfg) if fp8 else bf16_defines(cfg)
        cluster = planned_cluster(0 if fold is None else fold.cluster, cluster_capable(cfg, fp8))
        if cluster:
            kernel = rt.get_kernel(*source_name, cluster_defines(defines), device=device.index, dynamic_smem=shared_mem)
            if not holds_a_wave(kernel.function.ptr, cluster, grid, block, shared_mem,
                                cfg.split.num_sms * cfg.split.ctas_per_sm):
                cluster = 0
        if not cluster:  # (for the tensors' GPU, which need not be the current one)
            kernel = rt.get_kernel(*source_name, defines, device=device.index)
    run = combine_after(fold, arrivals, cluster) if b else None  # (no request: nothing to merge or write)
    rows_per_cta = combine_rows_per_cta(b * rows)
    combine = None if run is None else rt.get_kernel("combine.cu", "snapmla_combine", {"COMBINE_ROWS": rows_per_cta},
                                                     device=device.index)
    combine_grid = (b, math.ceil(rows / rows_per_cta), 1)
    return DecodePlan(
        metadata=metadata_ref(tile_scheduler_metadata, plan_key),
        stamp=stamp,
        config=requested,
        device=device,
        out_shape=(b, s_q, h_q, D_V),
        lse_shape=(b, h_q, s_q),
        partial_floats=max(num_work, 1) * rows * (D_V + 1),
        partial_lse_offset=max(num_work, 1) * rows * D_V * FLOAT32_BYTES,
        decode=kernel,
        grid=grid,
        block=block,
        shared_mem=shared_mem,
        cluster_launch=None if not cluster or kernel is None else ClusterLaunch(kernel.function.ptr, grid, block, shared_mem,
                                                              (1, cluster, 1)),
        plain_launch=decode_launch(kernel, grid, block, shared_mem, cluster),
        cache_maps=cache_maps,
        items_per_column=np.int32(items_per_column),
        scalars=(np.int32(table_stride), np.float32(scale * LOG2E), np.int32(h_q), np.int32(s_q),
                 np.int32(int(causal))),
        fold=((0 if arrivals is None else arrivals.data_ptr()), np.int32(kernel_fold_limit(fold, arrivals)))
        if cfg.wgmma else None,
        combine=combine,
        combine_launch=combine_launch(combine, combine_grid),
        combine_grid=combine_grid,
        combine_scalars=(np.int32(h_q), np.int32(s_q), np.int32(0 if run is None else run.folded_up_to)),
        keep=(arrivals,),  # never the caller's cache
    )


def _fast_checks(tensors: tuple[tuple[str, torch.Tensor], ...], block_table: torch.Tensor) -> None:
    """What a plan's key does not fix: contiguity (and the block table's rows)."""
    for name, t in tensors:
        if not t.is_contiguous():
            raise SnapmlaError(f"{name}: must be contiguous")
    if block_table.stride(1) != 1:
        raise SnapmlaError("block_table: rows must be contiguous (stride 1 along blocks)")


def _signature(q_parts: tuple[torch.Tensor, ...], k_cache: torch.Tensor, block_table: torch.Tensor,
               cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor,
               softmax_scale: float | None, causal: bool, config: DecodeConfig | None,
               out: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[object, ...]:
    """A call's plan key (:mod:`.decode_launch`): what fixes its launches. Not the cache's
    address: each layer of a step has its own cache and shares the step's work list. The scale's
    and the switch's types too: ``1 == True``, so ``causal=1`` or ``softmax_scale=True``, which a
    first call refuses, would otherwise replay a plan made for ``True`` or ``1``."""
    return (*(x for t in q_parts for x in (t.shape, t.dtype, t.get_device())),
            k_cache.shape, k_cache.dtype, k_cache.get_device(),
            block_table.shape, block_table.dtype, block_table.get_device(), block_table.stride(),
            cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.get_device(),
            id(metadata), metadata.shape, metadata.dtype, metadata.get_device(),
            num_splits.shape, num_splits.dtype, num_splits.get_device(),
            id(config), softmax_scale, type(softmax_scale), causal, type(causal), out is None, lse is None)


def _replay(plan: DecodePlan, q_parts: tuple[tuple[str, torch.Tensor], ...], shape: tuple[int, ...],
            k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
            metadata: torch.Tensor, num_splits: torch.Tensor, out: torch.Tensor | None,
            lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A call whose signature has a plan: the checks the key cannot see, then its launches."""
    q_ptrs = _replay_checks(plan, q_parts, shape, k_cache, block_table, cache_seqlens, metadata, num_splits, out, lse)
    return plan.run(q_ptrs, k_cache, block_table, cache_seqlens, metadata, num_splits, out, lse)


def _replay_checks(plan: DecodePlan, q_parts: tuple[tuple[str, torch.Tensor], ...], shape: tuple[int, ...],
                   k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   metadata: torch.Tensor, num_splits: torch.Tensor, out: torch.Tensor | None,
                   lse: torch.Tensor | None) -> tuple[int, ...]:
    """What a replayed call's key cannot see (contiguity, start addresses, a caller's outputs);
    returns q's part addresses."""
    _fast_checks((*q_parts, ("k_cache", k_cache), ("cache_seqlens", cache_seqlens),
                  ("tile_scheduler_metadata", metadata), ("num_splits", num_splits)), block_table)
    if k_cache.data_ptr() % VEC_ALIGN:  # (another layer's cache each call: not in the key)
        require_aligned("k_cache", k_cache)
    if out is not None or lse is not None:
        _check_outputs(out, lse, shape)
        _require_on(plan.device, (("out", out), ("lse", lse)))
    q_ptrs = tuple(t.data_ptr() for _, t in q_parts)
    for (name, _), ptr in zip(q_parts, q_ptrs):  # (a new q each step: its address is not in the key)
        if ptr % Q_ALIGN.get(name, VEC_ALIGN):
            _require_q_aligned(((name, ptr),))  # (the error; inline above: the hot path)
    return q_ptrs


def _tensor_args(**named: object) -> None:
    """A one-line error for an argument that is not a tensor at all (before any attribute of it
    is read)."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise SnapmlaError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")


def _output_args(out: object, lse: object) -> None:
    """The optional outputs are tensors when given (their checks read dtype and device)."""
    for name, value in (("out", out), ("lse", lse)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise SnapmlaError(f"{name}: expected a torch.Tensor or None, got {type(value).__name__}")


# start alignment of q's parts the kernels need (bytes): 16-byte loads of q, its E4M3 content and
# RoPE; the float32 scales are read one by one
Q_ALIGN = {"q.scale": 4}

def _require_q_aligned(parts: Iterable[tuple[str, int]]) -> None:
    """Each of q's parts (name, data address) starts where the kernels' loads need it (Q_ALIGN)."""
    for name, ptr in parts:
        align = Q_ALIGN.get(name, VEC_ALIGN)
        if ptr % align:
            misaligned(name, ptr, align)


_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def _tensor_parts(name: str, value: object) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors an argument holds, by the names the errors use (``q.content`` ...)."""
    if isinstance(value, QuantizedRows):
        for part in ("content", "scale", "rope"):
            yield from _tensor_parts(f"{name}.{part}", getattr(value, part))
    elif isinstance(value, torch.Tensor):
        yield name, value


def _require_strided_args(arguments: Mapping[str, object]) -> None:
    """Each tensor among ``arguments`` (a ``QuantizedRows``' parts too) a plain strided one."""
    for name, value in arguments.items():
        for part_name, part in _tensor_parts(name, value):
            require_strided(part_name, part)


def _require_strided_call(q: object, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                          metadata: torch.Tensor, num_splits: torch.Tensor, out: torch.Tensor | None,
                          lse: torch.Tensor | None) -> None:
    """A first call's layouts, checked before anything else reads them (a replay's key already
    read them, so there a nested or sparse tensor meets torch's error and the wrapper below)."""
    _require_strided_args({"q": q, "k_cache": k_cache, "block_table": block_table, "cache_seqlens": cache_seqlens,
                           "tile_scheduler_metadata": metadata, "num_splits": num_splits, "out": out, "lse": lse})


def _strided_args_named(call: Callable[_Params, _Result]) -> Callable[_Params, _Result]:
    """A nested or sparse tensor has no shape or no storage, and the call's first read of it
    (the plan key, a data pointer) raises torch's RuntimeError. The layouts are checked only
    then, so that a valid call pays nothing on the hot path and an invalid one hears which
    argument it was, in one line."""
    parameters = inspect.signature(call)

    @functools.wraps(call)
    def checked(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        try:
            return call(*args, **kwargs)
        except RuntimeError:
            _require_strided_args(parameters.bind_partial(*args, **kwargs).arguments)
            raise

    return checked


def _check_table_reads(block_table: torch.Tensor, cache_seqlens: torch.Tensor, batch: int,
                       k_cache: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor) -> None:
    """The checks switch's block-table and work-list checks: no length beyond its table row, every
    page a request reads a block of ``k_cache``, the work list planned for these lengths
    (:func:`.schedule.check_work_list`). The kernels index the table without bounds (a bounds test
    per page would not tell the caller anything: the output would still be wrong), and reading the
    lengths back is a synchronization, so it runs with the NaN checks and not on the hot path."""
    if capturing(block_table):  # (CPU tensors are checked, then refused as not CUDA right after)
        return  # the finite checks refuse capture with the switch on, naming it
    lengths = checked_lengths(block_table, cache_seqlens, batch, k_cache.shape[0])
    _check_metadata(metadata, num_splits, batch)
    check_work_list(metadata, num_splits, lengths)
    if k_cache.element_size() == 1:  # an FP8 cache: the tokens read are SnapMLA's encoding
        rows = k_cache.view(torch.uint8).reshape(k_cache.shape[0], PAGE_SIZE, FP8_TOKEN_BYTES)
        for i, n in enumerate(lengths):
            check_key_pads("k_cache", i, gather_from_pages(rows, block_table[i], n))


def _check_quantized_finite(q: QuantizedRows) -> None:
    """The finite check of an already quantized Q (its E4M3 content as well: a hand-built
    ``QuantizedRows`` may hold NaN bytes), one read-back for the three parts: host parts always,
    as ``decode_bf16``'s Q; CUDA ones under ``SNAPMLA_CHECK_FINITE`` (:func:`check_all_finite`),
    not even widened without it."""
    parts = [(f"q.{name}", getattr(q, name)) for name in ("content", "scale", "rope")]
    check_all_finite(*((name, as_e4m3(t).float()) for name, t in parts  # (non-tensors fail below)
                       if isinstance(t, torch.Tensor) and (GPU_CHECKS.on or not t.is_cuda)))


@_strided_args_named
def decode_fp8(
    q: QuantizedRows,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 decode on an already-quantized Q (``quantize_q`` output, ``[b, s_q, h_q]`` rows).
    Without ``config``, the configuration ``get_mla_metadata`` built the metadata for
    (:func:`decode_config_for`). After the first call of a signature the launch is replayed
    from its plan (:mod:`.decode_launch`).

    Returns ``(out, lse)`` as FlashMLA does: ``out`` bf16 ``[b, s_q, h_q, 512]`` and ``lse``
    float32 ``[b, h_q, s_q]``, the natural log-sum-exp of the scaled logits (a row that sees no
    key: ``out`` 0, ``lse`` +inf); written into ``out`` / ``lse`` when they are given.
    ``softmax_scale``: the logits' scale, ``576 ** -0.5`` when None; ``causal``: query token
    ``i`` of ``s_q`` sees the keys up to ``n - s_q + i``."""
    if not isinstance(q, QuantizedRows):
        raise SnapmlaError(f"q: expected QuantizedRows (the output of quantize_q), got {type(q).__name__}")
    _tensor_args(**{"q.content": q.content, "q.scale": q.scale, "q.rope": q.rope}, k_cache=k_cache,
                 block_table=block_table, cache_seqlens=cache_seqlens,
                 tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)
    if out is not None or lse is not None:
        _output_args(out, lse)
    key = _signature((q.content, q.scale, q.rope), k_cache, block_table, cache_seqlens, tile_scheduler_metadata,
                     num_splits, softmax_scale, causal, config, out, lse)
    if GPU_CHECKS.on:
        _check_quantized_finite(q)
    plan = find_plan(key, tile_scheduler_metadata, num_splits, config)
    if plan is not None:  # (the key fixes the shapes, which an earlier call of it checked)
        if GPU_CHECKS.on:
            _check_table_reads(block_table, cache_seqlens, q.scale.shape[0], k_cache, tile_scheduler_metadata,
                               num_splits)
        return _replay(plan, (("q.content", q.content), ("q.scale", q.scale), ("q.rope", q.rope)),
                       tuple(q.scale.shape), k_cache, block_table, cache_seqlens, tile_scheduler_metadata,
                       num_splits, out, lse)
    _require_strided_call(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits, out, lse)
    if q.scale.dim() != 3:
        raise SnapmlaError(f"q.scale: expected [b, s_q, h_q], got {list(q.scale.shape)}")
    b, s_q, h_q = q.scale.shape
    content = q.content.view(torch.uint8) if q.content.dtype == FP8_DTYPE else q.content
    _check(content, "q.content", torch.uint8, (b, s_q, h_q, 512))
    _check(q.scale, "q.scale", torch.float32, (b, s_q, h_q))
    _check(q.rope, "q.rope", torch.bfloat16, (b, s_q, h_q, 64))
    q_parts = (("q.content", content), ("q.scale", q.scale), ("q.rope", q.rope))
    if not GPU_CHECKS.on:  # (checked above with the switch on; host parts always, as decode_bf16's q)
        _check_quantized_finite(q)
    _require_q_aligned((name, part.data_ptr()) for name, part in q_parts if part.numel())
    cache = _fp8_cache_rows(k_cache)
    requested = checked_config(config, True)  # (before the devices: named on a host as well)
    device = _checked_call((b, s_q, h_q), q_parts, cache, block_table, cache_seqlens, tile_scheduler_metadata,
                           num_splits, out, lse, softmax_scale=softmax_scale, causal=causal, table_reads=True)
    cfg = decode_config_for(requested, tile_scheduler_metadata, s_q * h_q, True, device, b, s_q)
    require_arch(fp8_kernel(cfg)[0], device.index)  # before the tensor maps, which are Hopper's too
    return _split_kv_decode(True, (content, q.scale, q.rope, cache), (b, s_q, h_q), device,
                            block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                            softmax_scale, causal, cfg, out, lse, config, key)


@_strided_args_named
def decode_bf16(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 decode on the bf16 cache ``[blocks, 64, 1, 576]`` (the baseline). Without ``config``,
    the configuration ``get_mla_metadata`` built the metadata for (:func:`decode_config_for`);
    after the first call of a signature the launch is replayed from its plan. ``q`` bf16
    ``[b, s_q, h_q, 576]``; the other arguments and the ``(out, lse)`` returned are
    :func:`decode_fp8`'s."""
    _tensor_args(q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                 tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)
    if out is not None or lse is not None:
        _output_args(out, lse)
    key = _signature((q,), k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                     softmax_scale, causal, config, out, lse)
    plan = find_plan(key, tile_scheduler_metadata, num_splits, config)
    if plan is not None:  # (the key fixes the shapes, which an earlier call of it checked)
        if GPU_CHECKS.on:
            _check_table_reads(block_table, cache_seqlens, q.shape[0], k_cache, tile_scheduler_metadata, num_splits)
            check_finite("q", q)
        return _replay(plan, (("q", q),), tuple(q.shape[:3]), k_cache, block_table, cache_seqlens,
                       tile_scheduler_metadata, num_splits, out, lse)
    _require_strided_call(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits, out, lse)
    if q.dim() != 4:
        raise SnapmlaError(f"q: expected [b, s_q, h_q, {D_QK}], got {list(q.shape)}")
    b, s_q, h_q, _ = q.shape
    _check(q, "q", torch.bfloat16, (b, s_q, h_q, D_QK))
    check_finite("q", q)  # (host tensors always, CUDA ones under the checks switch)
    k_cache = _bf16_cache_rows(k_cache)
    require_aligned("q", q)
    require_aligned("k_cache", k_cache)
    requested = checked_config(config, False)  # (before the devices: named on a host as well)
    device = _checked_call((b, s_q, h_q), (("q", q),), k_cache, block_table, cache_seqlens, tile_scheduler_metadata,
                           num_splits, out, lse, softmax_scale=softmax_scale, causal=causal, table_reads=True)
    cfg = decode_config_for(requested, tile_scheduler_metadata, s_q * h_q, False, device, b, s_q)
    require_arch(bf16_kernel(cfg)[0], device.index)
    return _split_kv_decode(False, (q, k_cache), (b, s_q, h_q), device, block_table,
                            cache_seqlens, tile_scheduler_metadata, num_splits, softmax_scale,
                            causal, cfg, out, lse, config, key)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool | None = None,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's signature. A 656-byte FP8 cache (uint8 / float8_e4m3fn) takes the SnapMLA path
    (fused Q-quant, then FP8 decode); a bf16 cache takes the BF16 kernel.

    FlashMLA's later forms are answered by name: ``is_fp8_kvcache`` must agree with the cache's
    dtype (the FP8 cache is SnapMLA's encoding, one scale per token; FlashMLA's DeepSeek-V3.2
    layout of the same 656 bytes has four: with the flag given, each cache's first call checks
    its requests' first tokens for it, :mod:`.encoding_check`; the checks switch checks every
    token); its sparse-attention arguments (``indices``, ``attn_sink``, ...) and its lazily
    planned ``FlashMLASchedMeta`` (``num_splits=None``) are not supported, nor are the per-tensor
    ``descale_q`` / ``descale_k`` of FlashMLA's FP8 variant (keyword only here: SnapMLA quantizes
    Q itself, a scale per row, and its cache holds a scale per token).

    ``q`` bf16 ``[b, s_q, h_q, 576]``, ``head_dim_v`` 512; returns :func:`decode_fp8`'s
    ``(out, lse)``: bf16 ``[b, s_q, h_q, 512]`` and float32 ``[b, h_q, s_q]``."""
    for name, value in (("descale_q", descale_q), ("descale_k", descale_k)):
        if value is not None:
            raise SnapmlaError(f"{name}: per-tensor FP8 scales are not supported (SnapMLA quantizes Q with a "
                               "scale per row and its cache holds a scale per token); pass None")
    if not is_integer(head_dim_v) or head_dim_v != D_V:
        raise SnapmlaError(f"head_dim_v: expected {D_V}, got {show(head_dim_v)}")
    sparse = {"indices": indices, "attn_sink": attn_sink, "extra_k_cache": extra_k_cache,
              "extra_indices_in_kvcache": extra_indices_in_kvcache, "topk_length": topk_length,
              "extra_topk_length": extra_topk_length}
    num_splits = _flash_mla_forms(tile_scheduler_metadata, num_splits, sparse)
    _tensor_args(q=q, k_cache=k_cache)  # the cache's dtype picks the path below
    if is_fp8_kvcache is not None:
        fp8_cache = k_cache.dtype in FP8_CACHE_DTYPES
        if checked_flag("is_fp8_kvcache", is_fp8_kvcache) != fp8_cache:
            raise SnapmlaError(f"is_fp8_kvcache: {is_fp8_kvcache} disagrees with k_cache's dtype {dtype_name(k_cache.dtype)}")
    if k_cache.dtype == torch.bfloat16:
        return decode_bf16(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata,
                           num_splits, softmax_scale, causal)
    if k_cache.dtype in FP8_CACHE_DTYPES:
        return _quantize_and_decode(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                                    softmax_scale, causal, is_fp8_kvcache is not None)
    raise SnapmlaError(f"k_cache: expected bfloat16 or uint8/float8_e4m3fn, got {dtype_name(k_cache.dtype)}")


def _check_encoding(k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
    """FlashMLA's ``is_fp8_kvcache`` flag was given: the cache may hold its V3.2 layout
    (:mod:`.encoding_check`, once per cache)."""
    from .encoding_check import check_snapmla_encoding_once

    check_snapmla_encoding_once(k_cache, block_table, cache_seqlens)


# the first item of a fused call's plan key: never equal to a decode call's first (a shape)
_FUSED_KEY = "quantize_q + decode_fp8"


@_strided_args_named
def _quantize_and_decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                         cache_seqlens: torch.Tensor, tile_scheduler_metadata: torch.Tensor,
                         num_splits: torch.Tensor, softmax_scale: float | None, causal: bool,
                         check_encoding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla_with_kvcache`` on an FP8 cache: Q-quant, then FP8 decode. The first call of a
    signature runs ``quantize_q`` and ``decode_fp8`` with all their checks and stores a fused plan
    (the decode plan with the Q-quant launch in front); a later call checks what the key cannot
    see and runs it, Q's FP8 rows carved with the split rows out of one workspace
    (``DecodePlan.run_fused``: three allocations and a plan lookup fewer). With the checks switch
    on, every call takes the checked path (its NaN checks read Q's quantized rows)."""
    _tensor_args(block_table=block_table, cache_seqlens=cache_seqlens,
                 tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)
    key = (_FUSED_KEY, *_signature((q,), k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                                   softmax_scale, causal, None, None, None))
    plan = None if GPU_CHECKS.on else find_plan(key, tile_scheduler_metadata, num_splits, None)
    if plan is not None:  # (the key fixes the shapes and dtypes, which an earlier call checked)
        if check_encoding:
            _check_encoding(k_cache, block_table, cache_seqlens)
        q_ptr, = _replay_checks(plan, (("q", q),), (), k_cache, block_table, cache_seqlens,
                                tile_scheduler_metadata, num_splits, None, None)
        return plan.run_fused(q_ptr, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits)
    from .prep import quantize_q, quantize_q_launch

    _require_strided_call(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits, None, None)
    if q.dim() != 4 or q.shape[-1] != D_QK or q.dtype != torch.bfloat16:
        raise SnapmlaError(f"q: expected bfloat16 [b, s_q, h_q, {D_QK}], got {dtype_name(q.dtype)} {list(q.shape)}")
    # q's own layout as quantize_q checks it on a GPU, here so that a host q hears it too
    if not q.is_contiguous():
        raise SnapmlaError("q: must be contiguous")
    require_aligned("q", q)
    # the decode's arguments before Q is quantized (a host q ends the call: it is named last, after
    # any bad argument; on a GPU no Q-quant runs for a call its decode refuses)
    cache = _fp8_cache_rows(k_cache)
    try:
        _checked_call((q.shape[0], q.shape[1], q.shape[2]), (("q", q),), cache, block_table, cache_seqlens,
                      tile_scheduler_metadata, num_splits, softmax_scale=softmax_scale, causal=causal)
    except NoGpuError:
        if all(t.device.type == "cpu" for t in (q, cache, block_table, cache_seqlens, tile_scheduler_metadata,
                                                num_splits)):
            # what quantize_q and decode_fp8 would check on a GPU, named on the host too (as decode_fp8's
            # and decode_bf16's own calls do): Q's values, and the checks switch's table reads
            check_quantizable("q", q)
            if GPU_CHECKS.on:
                _check_table_reads(block_table, cache_seqlens, q.shape[0], cache, tile_scheduler_metadata,
                                   num_splits)
        raise
    if check_encoding:
        _check_encoding(k_cache, block_table, cache_seqlens)
    q8 = quantize_q(q)
    result = decode_fp8(q8, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                        softmax_scale, causal)
    decode_key = _signature((q8.content, q8.scale, q8.rope), k_cache, block_table, cache_seqlens,
                            tile_scheduler_metadata, num_splits, softmax_scale, causal, None, None, None)
    decoded_by = None if GPU_CHECKS.on else find_plan(decode_key, tile_scheduler_metadata, num_splits, None)
    if decoded_by is not None:
        store_plan(key, decoded_by.fused(quantize_q_launch(q), metadata_ref(tile_scheduler_metadata, key)))
    return result


def _flash_mla_forms(tile_scheduler_metadata: object, num_splits: torch.Tensor | None,
                     sparse: Mapping[str, object]) -> torch.Tensor:
    """One-line errors for the FlashMLA call forms snapmla does not take (a TypeError from
    Python or an attribute error deep inside would name neither the argument nor the remedy);
    returns ``num_splits``, known to be given."""
    for name, value in sparse.items():  # (FlashMLA's sparse attention: DeepSeek-V3.2's top-k decode)
        if value is not None:
            raise SnapmlaError(f"{name}: sparse attention is not supported (snapmla decodes dense MLA); "
                               f"pass None")
    if num_splits is None or not isinstance(tile_scheduler_metadata, torch.Tensor):
        raise SnapmlaError(
            "tile_scheduler_metadata: expected the (tile_scheduler_metadata, num_splits) tensors of "
            "snapmla's get_mla_metadata(cache_seqlens, s_q * h_q, 1), got "
            f"{type(tile_scheduler_metadata).__name__} and num_splits={type(num_splits).__name__} "
            "(FlashMLA's lazily planned FlashMLASchedMeta is not supported)")
    return num_splits
