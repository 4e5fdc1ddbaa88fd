"""Python faces of the token-preparation kernels (``kernels/prep.cu``), with CPU fallbacks.

One function per operation; each runs the CUDA kernel when its tensors live on a CUDA device and
the reference implementation (``numerics.quant`` / ``cache.layout``) when they are on the CPU, so
``snapmla quantize`` and the tests call the same function everywhere. Arguments are checked up
front and a bad one raises a one-line :class:`SnapmlaError` naming it. The CUDA paths never
synchronize with the host (``fetch_dequant`` only when it must size its output and
``total_tokens`` is not given), so they can be captured in CUDA graphs.

Semantics shared by both paths:
- a slot outside ``[0, num_blocks * 64)`` (``-1`` padding, garbage) is skipped by ``append_kv``
  and reads as a row of zeros in the fetch functions. A block-table entry outside the cache for
  a token below ``cache_seqlens`` is refused on the CPU always and on CUDA under the checks
  switch; unchecked on CUDA, it reads as zeros. Duplicate slots in one ``append_kv``: one row wins.
- dequantized values are ``bf16(float32(e4m3) * s)`` and ``bf16(float32(rope) * s)``, i.e.
  ``QuantizedRows.dequantize(torch.float32).to(torch.bfloat16)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.layout import as_token_bytes, quantize_tokens, soa_to_rows, unpack_tokens
from ..errors import SnapmlaError, dtype_name, show
from ..host_memory import require_host_memory
from ..numerics.decode_args import checked_lengths, is_integer, require_strided
from ..numerics.formats import (
    D_CONTENT,
    D_QK,
    D_ROPE,
    FP8_CACHE_DTYPES,
    FP8_DTYPE,
    FP8_TOKEN_BYTES,
    PAGE_SIZE,
)
from ..numerics.quant import QuantizedRows, quantize_rows
from ..runtime.launch import KernelHandle, i32, i64
from ..runtime.registry import PREP_DEFINES, PREP_KERNELS, PREP_SOURCE
from ..sizes import counted
from .alignment import VEC_ALIGN, aligned_up, misaligned, require_aligned
from .finite import GPU_CHECKS, capturing, check_quantizable

_CPU_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)
_WARPS_PER_CTA = PREP_DEFINES["PREP_WARPS_PER_CTA"]
_ROWS_PER_WARP = PREP_DEFINES["PREP_ROWS_PER_WARP"]
_THREADS = 32 * _WARPS_PER_CTA
_BLOCK = (_THREADS, 1, 1)
_MAX_CTAS = 1 << 18  # beyond this the kernels' grid-stride loops take over
_MAX_PLANS = 4096  # cached per-shape launch plans (cleared when full)

# One handle per kernel, resolved to a CuPy function once per device (no per-call lookup).
_KERNELS = {name: KernelHandle(PREP_SOURCE, name, PREP_DEFINES) for name in PREP_KERNELS}
_QUANTIZE_Q = _KERNELS["snapmla_quantize_q"]
_APPEND_KV = {
    torch.int32: _KERNELS["snapmla_append_kv"],
    torch.int64: _KERNELS["snapmla_append_kv_i64"],
}
_FETCH_PAGED = _KERNELS["snapmla_fetch_dequant_paged"]
_FETCH_SLOTS = {
    torch.int32: _KERNELS["snapmla_fetch_dequant_slots"],
    torch.int64: _KERNELS["snapmla_fetch_dequant_slots_i64"],
}
_FETCH_SOA = {
    torch.int32: _KERNELS["snapmla_fetch_dequant_soa"],
    torch.int64: _KERNELS["snapmla_fetch_dequant_soa_i64"],
}


# ---------------------------------------------------------------- argument checks


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SnapmlaError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    require_strided(name, t)
    return t


def _same_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """All tensors on one device (CPU or one CUDA device); that device. The first tensor's device
    is checked before the others are compared with it: a first one without data ('meta') is
    named itself, not the others as "expected a tensor on meta"."""
    first_name, first = named[0]
    if first.device.type not in ("cpu", "cuda"):
        raise SnapmlaError(f"{first_name}: expected a CPU or CUDA tensor, got {first.device}")
    for name, t in named[1:]:
        if t.device != first.device:
            raise SnapmlaError(
                f"{name}: expected a tensor on {first.device} (like {first_name}), got {t.device}"
            )
    return first.device


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = " or ".join(dtype_name(d) for d in allowed)
        raise SnapmlaError(
            f"{name}: expected dtype {names}, got {dtype_name(t.dtype)}"
        )


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _not_contiguous(name)


def _not_contiguous(name: str) -> None:
    raise SnapmlaError(f"{name}: expected a contiguous tensor (call .contiguous())")


def _shape(name: str, t: torch.Tensor, sizes: tuple[int | None, ...], expect: str) -> None:
    """``t.shape`` matches ``sizes`` (None = any size); ``expect`` is the human-readable shape."""
    if t.dim() != len(sizes) or any(w is not None and w != s for w, s in zip(sizes, t.shape)):
        raise SnapmlaError(f"{name}: expected shape {expect}, got {tuple(t.shape)}")


def _slots(name: str, slots: object, n: int | None = None) -> torch.Tensor:
    slots = _tensor(name, slots)
    _dtype(name, slots, _SLOT_DTYPES)
    if slots.dim() != 1 or (n is not None and slots.shape[0] != n):
        want = f"[{n}]" if n is not None else "[n]"
        raise SnapmlaError(f"{name}: expected shape {want}, got {tuple(slots.shape)}")
    _contiguous(name, slots)
    return slots


def _paged_cache(k_cache: object) -> torch.Tensor:
    """uint8 ``[num_blocks, 64, 656]`` view of an FP8 cache (SPEC section 3 shapes)."""
    original = _tensor("k_cache", k_cache)
    cache = as_token_bytes(original, "k_cache")
    if cache.dim() != 3 or cache.shape[1] != PAGE_SIZE:
        raise SnapmlaError(
            f"k_cache: expected shape [num_blocks, {PAGE_SIZE}, {FP8_TOKEN_BYTES}] or "
            f"[num_blocks, {PAGE_SIZE}, 1, {FP8_TOKEN_BYTES}], got {tuple(original.shape)}"
        )
    _contiguous("k_cache", cache)
    return cache


# ---------------------------------------------------------------- launch helpers


def _grid(rows: int) -> tuple[int, int, int]:
    per_cta = _WARPS_PER_CTA * _ROWS_PER_WARP
    return (max(1, min(-(-rows // per_cta), _MAX_CTAS)), 1, 1)


def _cache_plan(plans: dict, key: tuple, plan: tuple) -> tuple:
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def _dequant_rows(rows: QuantizedRows) -> torch.Tensor:
    """The reference dequantization the kernels reproduce: float32 multiply, then bf16 RNE."""
    return rows.dequantize(torch.float32).to(torch.bfloat16)


def _valid_slots(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    return (slots >= 0) & (slots < num_slots)


# ---------------------------------------------------------------- Q-quant


@torch.no_grad()  # a quantizer has no gradient: its outputs must not join an autograd graph
def quantize_q(q: torch.Tensor, out: QuantizedRows | None = None) -> QuantizedRows:
    """Quantize query rows ``q[..., 576]`` (SPEC section 3, per row = per (request, token, head)).

    Returns :class:`QuantizedRows` with ``content`` float8_e4m3fn ``[..., 512]``, ``scale``
    float32 ``[...]`` and pre-scaled ``rope`` bf16 ``[..., 64]``; bytes identical to
    ``quantize_rows``. CUDA: bf16, contiguous. CPU: bf16, fp16 or fp32, contiguous too.

    ``out``: preallocated result (the same dtypes and shapes, contiguous, on ``q``'s device)
    written in place and returned; skips the three allocations, which are most of the host
    time of a decode-step call, and keeps the buffers fixed for CUDA graphs.
    """
    if type(q) is torch.Tensor and q.is_cuda:
        return _quantize_q_cuda(q, out)
    q = _tensor("q", q)
    device = _same_device([("q", q)])
    if device.type != "cpu":
        return _quantize_q_cuda(q, out)
    _check_q(q)
    _dtype("q", q, _CPU_FLOAT_DTYPES)
    check_quantizable("q", q)
    result = quantize_rows(q)
    if out is None:
        return result
    _check_q_out(out, tuple(q.shape[:-1]), device)
    out.content.copy_(result.content)
    out.scale.copy_(result.scale)
    out.rope.copy_(result.rope)
    return out


def _check_q(q: torch.Tensor) -> None:
    if q.dim() < 1 or q.shape[-1] != D_QK:
        raise SnapmlaError(
            f"q: expected shape [..., {D_QK}] (e.g. [b, s_q, h_q, {D_QK}]), got {tuple(q.shape)}"
        )
    _contiguous("q", q)


# Alignment the Q-quant kernel's stores need: 16-byte content chunks, 4-byte scale / RoPE words.
_Q_OUT_ALIGN = {"content": VEC_ALIGN, "scale": 4, "rope": 4}


def _check_q_out(out: object, lead: tuple[int, ...], device: torch.device) -> None:
    """Full check of a preallocated ``out`` for rows of shape ``lead`` (one-line errors)."""
    if not isinstance(out, QuantizedRows):
        raise SnapmlaError(f"out: expected QuantizedRows, got {type(out).__name__}")
    specs = (
        ("content", FP8_DTYPE, (*lead, D_CONTENT)),
        ("scale", torch.float32, lead),
        ("rope", torch.bfloat16, (*lead, D_ROPE)),
    )
    for field, dtype, shape in specs:
        name = f"out.{field}"
        t = _tensor(name, getattr(out, field))
        _dtype(name, t, (dtype,))
        if tuple(t.shape) != shape:
            raise SnapmlaError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
        if t.device != device:
            raise SnapmlaError(f"{name}: expected a tensor on {device} (like q), got {t.device}")
        _contiguous(name, t)
        require_aligned(name, t, _Q_OUT_ALIGN[field])


# (shape, dtype, device index) -> (device index, rows, launch grid, i64 rows, content shape,
# scale shape, rope shape, torch.device, what a valid `out` looks like): all that depends on the
# shape only, computed once.
_Q_PLANS: dict[tuple, tuple] = {}


def _quantize_q_plan(q: torch.Tensor, key: tuple) -> tuple:
    """Check ``q`` fully (first call for this shape, dtype and device) and build its plan."""
    _same_device([("q", q)])
    _check_q(q)
    _dtype("q", q, (torch.bfloat16,))
    require_aligned("q", q)
    lead = tuple(q.shape[:-1])
    rows = q.numel() // D_QK
    index = q.get_device()
    content_shape, rope_shape = (*lead, D_CONTENT), (*lead, D_ROPE)
    out_key = (
        content_shape, FP8_DTYPE, index,
        lead, torch.float32, index,
        rope_shape, torch.bfloat16, index,
    )  # fmt: skip
    plan = (
        index,
        rows,
        _grid(rows),
        i64(rows),
        content_shape,
        lead,
        rope_shape,
        q.device,
        out_key,
    )
    return _cache_plan(_Q_PLANS, key, plan)


def _quantize_q_cuda(q: torch.Tensor, out: QuantizedRows | None = None) -> QuantizedRows:
    """The CUDA path: after the first call for a shape, one dict lookup, two per-call checks
    (contiguity, 16-byte alignment), three allocations (or a check of ``out``) and the launch."""
    key = (q.shape, q.dtype, q.get_device())
    plan = _Q_PLANS.get(key)
    if plan is None:
        plan = _quantize_q_plan(q, key)
    index, rows, grid, rows_arg, content_shape, scale_shape, rope_shape, device, out_key = plan
    if not q.is_contiguous():
        _not_contiguous("q")
    ptr = q.data_ptr()
    if rows and ptr % VEC_ALIGN:
        misaligned("q", ptr)
    if GPU_CHECKS.on:
        check_quantizable("q", q)
    if out is None:
        # `size=` parses faster than a positional tuple (~1.5 vs ~2.3 us per call on a slow CPU)
        content = torch.empty(size=content_shape, dtype=FP8_DTYPE, device=device)
        scale = torch.empty(size=scale_shape, dtype=torch.float32, device=device)
        rope = torch.empty(size=rope_shape, dtype=torch.bfloat16, device=device)
        result = QuantizedRows(content, scale, rope)
    else:
        result = out
        content, scale, rope = _q_out_tensors(out, out_key, scale_shape, device)
    if rows:
        _QUANTIZE_Q.launch(
            index,
            grid,
            _BLOCK,
            (ptr, content.data_ptr(), scale.data_ptr(), rope.data_ptr(), rows_arg),
        )
    return result


@dataclass(frozen=True, slots=True)
class QuantizeQLaunch:
    """The Q-quant launch of one query shape writing into a caller's workspace, and where in it
    the three parts go: FP8 content at 0, the float32 scales at ``scale_offset``, the pre-scaled
    RoPE at ``rope_offset`` (each 16-byte aligned, the offsets the decode kernel reads Q at).

    Why: ``flash_mla_with_kvcache`` on an FP8 cache quantizes Q only for its own decode, so Q's
    rows need no tensors of their own; carving them (and the decode's split rows) out of one
    allocation saves three ``torch.empty`` calls of an eager call's host time
    (:mod:`.decode_launch`, ``DecodePlan.run_fused``)."""

    index: int  # the device
    rows: int
    grid: tuple[int, int, int]
    rows_arg: np.int64
    scale_offset: int
    rope_offset: int
    nbytes: int  # the three parts together

    def __call__(self, q_ptr: int, workspace_ptr: int) -> None:
        """Quantize ``q`` (bf16 ``[rows, 576]`` at ``q_ptr``) into the workspace at ``workspace_ptr``."""
        if self.rows:
            _QUANTIZE_Q.launch(self.index, self.grid, _BLOCK,
                               (q_ptr, workspace_ptr, workspace_ptr + self.scale_offset,
                                workspace_ptr + self.rope_offset, self.rows_arg))


def quantize_q_launch(q: torch.Tensor) -> QuantizeQLaunch:
    """The workspace launch of ``q``'s shape, for a ``q`` that ``quantize_q`` has checked."""
    rows = q.numel() // D_QK
    scale_offset = rows * D_CONTENT  # (FP8: one byte a value)
    rope_offset = scale_offset + aligned_up(rows * torch.float32.itemsize)
    return QuantizeQLaunch(q.get_device(), rows, _grid(rows), i64(rows), scale_offset, rope_offset,
                           aligned_up(rope_offset + rows * D_ROPE * torch.bfloat16.itemsize))


def _q_out_tensors(
    out: QuantizedRows, out_key: tuple, lead: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``out``'s tensors after a cheap check against the plan (the full one only on a mismatch,
    to raise its one-line error)."""
    try:
        content, scale, rope = out.content, out.scale, out.rope
        got = (
            content.shape, content.dtype, content.get_device(),
            scale.shape, scale.dtype, scale.get_device(),
            rope.shape, rope.dtype, rope.get_device(),
        )  # fmt: skip
        ok = (
            got == out_key
            and content.is_contiguous()
            and scale.is_contiguous()
            and rope.is_contiguous()
            and not (content.data_ptr() % VEC_ALIGN or scale.data_ptr() % 4 or rope.data_ptr() % 4)
        )
    except AttributeError:
        ok = False
    if not ok:
        _check_q_out(out, lead, device)
        content, scale, rope = out.content, out.scale, out.rope
    return content, scale, rope


# ---------------------------------------------------------------- K-append


def append_kv(kv: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
    """Quantize ``kv`` bf16 ``[n, 576]`` and write token ``i`` into slot ``slots[i]``
    (``page * 64 + row``) of the paged FP8 cache, in place. Returns ``k_cache``.

    ``k_cache``: ``[num_blocks, 64, 656]`` or ``[num_blocks, 64, 1, 656]``, uint8 or
    float8_e4m3fn, contiguous. ``slots``: int32 or int64 ``[n]`` (both read natively by the
    kernel); out-of-range slots are skipped, so nothing outside the written slots changes.
    """
    if (
        type(kv) is torch.Tensor
        and type(slots) is torch.Tensor
        and type(k_cache) is torch.Tensor
        and kv.is_cuda
    ):
        return _append_kv_cuda(kv, slots, k_cache)
    kv, slots, cache, device = _check_append(kv, slots, k_cache)
    if device.type != "cpu":
        return _append_kv_cuda(kv, slots, k_cache)
    _dtype("kv", kv, _CPU_FLOAT_DTYPES)
    n, num_slots = kv.shape[0], cache.shape[0] * PAGE_SIZE
    if n:
        valid = _valid_slots(slots, num_slots)
        check_quantizable("kv", kv, valid)
        flat = cache.view(num_slots, FP8_TOKEN_BYTES)
        flat[slots[valid].long()] = quantize_tokens(kv[valid])
    return k_cache


def _check_append(
    kv: object, slots: object, k_cache: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.device]:
    kv = _tensor("kv", kv)
    _shape("kv", kv, (None, D_QK), f"[n, {D_QK}]")
    slots = _slots("slots", slots, kv.shape[0])
    cache = _paged_cache(k_cache)
    device = _same_device([("kv", kv), ("slots", slots), ("k_cache", cache)])
    _contiguous("kv", kv)
    return kv, slots, cache, device


# (shapes, dtypes, devices of kv, slots, k_cache) -> (device index, kernel, launch grid, i64 n,
# i64 num_slots, n > 0, cache not empty).
_APPEND_PLANS: dict[tuple, tuple] = {}


def _append_kv_plan(
    kv: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, key: tuple
) -> tuple:
    """Check the arguments fully (first call for these shapes, dtypes, devices); their plan."""
    kv, slots, cache, _ = _check_append(kv, slots, k_cache)
    _dtype("kv", kv, (torch.bfloat16,))
    require_aligned("kv", kv)
    require_aligned("k_cache", cache)
    n, num_slots = kv.shape[0], cache.shape[0] * PAGE_SIZE
    plan = (
        kv.get_device(),
        _APPEND_KV[slots.dtype],
        _grid(n),
        i64(n),
        i64(num_slots),
        n > 0,
        cache.numel() > 0,
    )
    return _cache_plan(_APPEND_PLANS, key, plan)


def _append_kv_cuda(kv: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
    """The CUDA path: after the first call for these shapes, one dict lookup, the per-call
    contiguity and alignment checks, and the launch."""
    key = (
        kv.shape,
        kv.dtype,
        kv.get_device(),
        slots.shape,
        slots.dtype,
        slots.get_device(),
        k_cache.shape,
        k_cache.dtype,
        k_cache.get_device(),
    )
    plan = _APPEND_PLANS.get(key)
    if plan is None:
        plan = _append_kv_plan(kv, slots, k_cache, key)
    index, kernel, grid, n_arg, num_slots_arg, nonempty, cache_nonempty = plan
    if not kv.is_contiguous():
        _not_contiguous("kv")
    if not slots.is_contiguous():
        _not_contiguous("slots")
    if not k_cache.is_contiguous():
        _not_contiguous("k_cache")
    kv_ptr = kv.data_ptr()
    if nonempty and kv_ptr % VEC_ALIGN:
        misaligned("kv", kv_ptr)
    cache_ptr = k_cache.data_ptr()
    if cache_nonempty and cache_ptr % VEC_ALIGN:
        misaligned("k_cache", cache_ptr)
    if nonempty and GPU_CHECKS.on:  # the rows that will be written (padding slots are skipped)
        check_quantizable("kv", kv, _valid_slots(slots, k_cache.numel() // FP8_TOKEN_BYTES))
    if nonempty:
        args = (kv_ptr, slots.data_ptr(), n_arg, cache_ptr, num_slots_arg)
        kernel.launch(index, grid, _BLOCK, args)
    return k_cache


# ---------------------------------------------------------------- fetch-dequant


# The most rows a fetch may return: its offsets (cumulative lengths) are int32, as SPEC's are.
MAX_ROWS = 2**31 - 1
# Host bytes a CPU fetch holds per output row: the bf16 row and the int64 index tensors that
# address it (``_token_slots``: arange, request, offset, page, slot, mask).
_CPU_FETCH_BYTES_PER_ROW = D_QK * 2 + 6 * 8


def fetch_dequant(
    k_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """Dequantize every cached token of every request to bf16 ``[sum(n_i), 576]`` (request 0's
    tokens first). ``block_table`` int32 ``[b, max_blocks]``, ``cache_seqlens`` int32 ``[b]``
    (negative lengths count as 0).

    ``k_cache`` is the paged FP8 cache, or SGLang-FluentLLM's structure of arrays ``(content,
    scale, rope)`` (SPEC section 3; :func:`fetch_dequant_soa`'s tensors), whose slots the block
    table addresses as a paged cache's: token ``j`` of a request at slot ``page * 64 + j % 64``.

    ``total_tokens``: the output's row count, to skip the host sync that reads
    ``sum(cache_seqlens)`` (needed for CUDA graphs); rows beyond the real total are zero and
    tokens beyond ``total_tokens`` are dropped.

    A length beyond its row of the block table, or a page it reads outside the cache, is refused
    on the CPU always and on CUDA under the checks switch (``SNAPMLA_CHECK_FINITE``, as the
    decode calls: it reads the lengths back); unchecked, such rows come back as zeros.
    """
    soa = _soa_arrays(k_cache) if isinstance(k_cache, (tuple, list)) else None
    cache = _paged_cache(k_cache) if soa is None else soa[0]
    # whole pages only: a page that runs past the slot arrays' end is refused like a missing one
    num_blocks = cache.shape[0] if soa is None else cache.shape[0] // PAGE_SIZE
    block_table = _tensor("block_table", block_table)
    cache_seqlens = _tensor("cache_seqlens", cache_seqlens)
    _dtype("block_table", block_table, (torch.int32,))
    _dtype("cache_seqlens", cache_seqlens, (torch.int32,))
    if block_table.dim() != 2:
        raise SnapmlaError(
            f"block_table: expected shape [b, max_blocks], got {tuple(block_table.shape)}"
        )
    batch = block_table.shape[0]
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
        raise SnapmlaError(
            f"cache_seqlens: expected shape [{batch}] (one per block_table row), "
            f"got {tuple(cache_seqlens.shape)}"
        )
    _contiguous("block_table", block_table)
    _contiguous("cache_seqlens", cache_seqlens)
    arrays = [("k_cache", cache)] if soa is None else list(zip(("content", "scale", "rope"), soa))
    device = _same_device([*arrays, ("block_table", block_table), ("cache_seqlens", cache_seqlens)])
    if total_tokens is not None:
        if not is_integer(total_tokens) or total_tokens < 0:
            raise SnapmlaError(f"total_tokens: expected a non-negative int, got {show(total_tokens)}")
        total_tokens = int(total_tokens)
        if total_tokens > MAX_ROWS:
            raise SnapmlaError(f"total_tokens: expected at most {MAX_ROWS} (int32 row offsets), got {total_tokens}")
        total = total_tokens
    else:
        # the one read-back of the sum, in int64, so that lengths adding up past the int32 row
        # offsets are refused instead of wrapping around
        total = int(cache_seqlens.clamp(min=0).sum(dtype=torch.int64)) if batch else 0
        if total > MAX_ROWS:
            raise SnapmlaError(f"cache_seqlens: the lengths add up to {total} tokens, more than the "
                               f"{MAX_ROWS} rows int32 offsets address")

    if device.type == "cpu":  # (on a GPU, torch's OutOfMemoryError is what an engine expects)
        what = (f"total_tokens={total}: fetch_dequant's rows" if total_tokens is not None
                else f"cache_seqlens: fetch_dequant's {total} rows")
        require_host_memory(what, total * _CPU_FETCH_BYTES_PER_ROW)
    lengths = cache_seqlens.clamp(min=0)
    if batch and (device.type == "cpu" or (GPU_CHECKS.on and not capturing(block_table))):
        try:
            checked_lengths(block_table, lengths, batch, num_blocks)
        except SnapmlaError as exc:
            if soa is None:
                raise
            raise SnapmlaError(f"{exc} (the structure of arrays holds {cache.shape[0]} slots: "
                               f"{counted(num_blocks, 'whole page')} of {PAGE_SIZE}, the only pages a block "
                               "table can address)") from None
    cu = row_offsets(lengths)
    if soa is not None:
        return _fetch_soa(*soa, _token_slots(block_table, cu, total, num_blocks * PAGE_SIZE), device)
    if device.type == "cpu":
        return _fetch_paged_cpu(cache, block_table, cu, total)
    require_aligned("k_cache", cache)
    out = torch.empty((total, D_QK), dtype=torch.bfloat16, device=device)
    if total:
        num_slots = cache.shape[0] * PAGE_SIZE
        _FETCH_PAGED.launch(
            out.get_device(),
            _grid(total),
            _BLOCK,
            (
                cache.data_ptr(),
                i64(num_slots),
                block_table.data_ptr(),
                i32(block_table.shape[1]),
                cu.data_ptr(),
                i32(batch),
                out.data_ptr(),
                i64(total),
            ),
        )
    return out


def row_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """int32 ``[b + 1]`` first output row of each request (and the end) for non-negative
    ``lengths``, on their device without a host sync. Summed in int64 and capped at
    :data:`MAX_ROWS`: with ``total_tokens`` given, lengths adding up past the int32 limit would
    wrap around (rows out of order, wrong tokens); every row past the cap is dropped anyway."""
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    if lengths.shape[0]:
        cu[1:].copy_(torch.cumsum(lengths, dim=0, dtype=torch.int64).clamp_(max=MAX_ROWS))
    return cu


def _token_slots(block_table: torch.Tensor, cu: torch.Tensor, total: int, num_slots: int) -> torch.Tensor:
    """int64 ``[total]``: the cache slot of each output row (``cu`` its requests' first rows),
    -1 for a row past the last request's tokens or a token whose page is missing or outside
    ``num_slots``. Tensor operations on the table's device: no host sync."""
    slots = torch.full((total,), -1, dtype=torch.int64, device=block_table.device)
    batch, max_blocks = block_table.shape
    if total == 0 or batch == 0 or max_blocks == 0:
        return slots
    t = torch.arange(total, dtype=torch.int64, device=block_table.device)
    ends = cu[1:].to(torch.int64)
    req = torch.searchsorted(ends, t, right=True).clamp_(max=batch - 1)
    j = t - cu[req].to(torch.int64)
    blk = j // PAGE_SIZE
    page = block_table[req, blk.clamp(max=max_blocks - 1)].to(torch.int64)
    slot = page * PAGE_SIZE + j % PAGE_SIZE
    valid = (t < cu[-1].to(torch.int64)) & (blk < max_blocks) & (page >= 0) & (slot < num_slots)
    return torch.where(valid, slot, slots)


def _fetch_paged_cpu(
    cache: torch.Tensor, block_table: torch.Tensor, cu: torch.Tensor, total: int
) -> torch.Tensor:
    out = torch.zeros((total, D_QK), dtype=torch.bfloat16)
    num_slots = cache.shape[0] * PAGE_SIZE
    slot = _token_slots(block_table, cu, total, num_slots)
    valid = slot >= 0
    if bool(valid.any()):
        flat = cache.view(num_slots, FP8_TOKEN_BYTES)
        out[valid] = _dequant_rows(unpack_tokens(flat[slot[valid]]))
    return out


def fetch_dequant_slots(k_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Dequantize the tokens at ``slots`` (int32 or int64 ``[n]``, ``page * 64 + row``) of a
    paged FP8 cache to bf16 ``[n, 576]``; an out-of-range slot gives a row of zeros."""
    cache = _paged_cache(k_cache)
    slots = _slots("slots", slots)
    device = _same_device([("k_cache", cache), ("slots", slots)])
    n, num_slots = slots.shape[0], cache.shape[0] * PAGE_SIZE
    if device.type == "cpu":
        out = torch.zeros((n, D_QK), dtype=torch.bfloat16)
        valid = _valid_slots(slots, num_slots)
        flat = cache.view(num_slots, FP8_TOKEN_BYTES)
        out[valid] = _dequant_rows(unpack_tokens(flat[slots[valid].long()]))
        return out
    require_aligned("k_cache", cache)
    out = torch.empty((n, D_QK), dtype=torch.bfloat16, device=device)
    if n:
        _FETCH_SLOTS[slots.dtype].launch(
            out.get_device(),
            _grid(n),
            _BLOCK,
            (cache.data_ptr(), i64(num_slots), slots.data_ptr(), i64(n), out.data_ptr()),
        )
    return out


def _soa_arrays(k_cache: tuple | list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(content, scale, rope)`` of a structure-of-arrays cache given as ``k_cache``."""
    if len(k_cache) != 3:
        raise SnapmlaError(f"k_cache: expected the paged FP8 cache or a structure of arrays (content, scale, "
                           f"rope), got a {type(k_cache).__name__} of {len(k_cache)}")
    content, scale, rope = k_cache
    return _checked_soa(content, scale, rope)


def _checked_soa(content: object, scale: object, rope: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    content = _tensor("content", content)
    scale = _tensor("scale", scale)
    rope = _tensor("rope", rope)
    _dtype("content", content, FP8_CACHE_DTYPES)
    _dtype("scale", scale, (torch.float32,))
    _dtype("rope", rope, (torch.bfloat16,))
    _shape("content", content, (None, D_CONTENT), f"[slots, {D_CONTENT}]")
    num_slots = content.shape[0]
    _shape("scale", scale, (num_slots,), f"[{num_slots}]")
    _shape("rope", rope, (num_slots, D_ROPE), f"[{num_slots}, {D_ROPE}]")
    for name, t in (("content", content), ("scale", scale), ("rope", rope)):
        _contiguous(name, t)
    return content, scale, rope


def fetch_dequant_soa(
    content: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Dequantize the tokens at ``slots`` (int32 or int64 ``[n]``) of a structure-of-arrays cache
    (SGLang-FluentLLM: content uint8/float8_e4m3fn ``[S, 512]``, scale float32 ``[S]``, rope bf16
    ``[S, 64]``) to bf16 ``[n, 576]``; an out-of-range slot gives a row of zeros."""
    content, scale, rope = _checked_soa(content, scale, rope)
    slots = _slots("slots", slots)
    device = _same_device(
        [("content", content), ("scale", scale), ("rope", rope), ("slots", slots)]
    )
    return _fetch_soa(content, scale, rope, slots, device)


def _fetch_soa(content: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor,
               device: torch.device) -> torch.Tensor:
    """:func:`fetch_dequant_soa` on checked arrays and slots, all on ``device``."""
    num_slots = content.shape[0]
    n = slots.shape[0]
    if device.type == "cpu":
        out = torch.zeros((n, D_QK), dtype=torch.bfloat16)
        valid = _valid_slots(slots, num_slots)
        idx = slots[valid].long()
        out[valid] = _dequant_rows(soa_to_rows(content[idx], scale[idx], rope[idx]))
        return out
    content_u8 = content.view(torch.uint8)
    for name, t in (("content", content_u8), ("scale", scale), ("rope", rope)):
        require_aligned(name, t)
    out = torch.empty((n, D_QK), dtype=torch.bfloat16, device=device)
    if n:
        _FETCH_SOA[slots.dtype].launch(
            out.get_device(),
            _grid(n),
            _BLOCK,
            (
                content_u8.data_ptr(),
                scale.data_ptr(),
                rope.data_ptr(),
                i64(num_slots),
                slots.data_ptr(),
                i64(n),
                out.data_ptr(),
            ),
        )
    return out
