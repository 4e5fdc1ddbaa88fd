"""Python faces of the token-preparation kernels (``kernels/prep.cu``), with CPU fallbacks.

One function per operation; each runs the CUDA kernel when its tensors live on a CUDA device and
the reference implementation (``numerics.quant`` / ``cache.layout``) when they are on the CPU, so
``snapmla quantize`` and the tests call the same function everywhere. Arguments are checked up
front and a bad one raises a one-line :class:`SnapmlaError` naming it. The CUDA paths never
synchronize with the host (``fetch_dequant`` only when it must size its output and
``total_tokens`` is not given), so they can be captured in CUDA graphs.

Semantics shared by both paths:
- a slot outside ``[0, num_blocks * 64)`` (``-1`` padding, garbage) is skipped by ``append_kv``
  and reads as a row of zeros in the fetch functions; so does a block-table entry outside the
  cache for a token below ``cache_seqlens``. Duplicate slots in one ``append_kv``: one row wins.
- dequantized values are ``bf16(float32(e4m3) * s)`` and ``bf16(float32(rope) * s)``, i.e.
  ``QuantizedRows.dequantize(torch.float32).to(torch.bfloat16)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.layout import as_token_bytes, quantize_tokens, soa_to_rows, unpack_tokens
from ..errors import SnapmlaError
from ..numerics.formats import D_CONTENT, D_QK, D_ROPE, FP8_DTYPE, FP8_TOKEN_BYTES, PAGE_SIZE
from ..numerics.quant import QuantizedRows, quantize_rows
from ..runtime.launch import get_kernel, i32, i64, launch
from ..runtime.registry import PREP_DEFINES, PREP_SOURCE

_VEC_ALIGN = 16  # bytes: the kernels use 16-byte vector accesses
_CPU_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)
_WARPS_PER_CTA = PREP_DEFINES["PREP_WARPS_PER_CTA"]
_ROWS_PER_WARP = PREP_DEFINES["PREP_ROWS_PER_WARP"]
_THREADS = 32 * _WARPS_PER_CTA
_MAX_CTAS = 1 << 18  # beyond this the kernels' grid-stride loops take over


# ---------------------------------------------------------------- argument checks


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SnapmlaError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """All tensors on one device (CPU or one CUDA device); that device."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise SnapmlaError(
                f"{name}: expected a tensor on {first.device} (like {first_name}), got {t.device}"
            )
    if first.device.type not in ("cpu", "cuda"):
        raise SnapmlaError(f"{first_name}: expected a CPU or CUDA tensor, got {first.device}")
    return first.device


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise SnapmlaError(
            f"{name}: expected dtype {names}, got {str(t.dtype).replace('torch.', '')}"
        )


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise SnapmlaError(f"{name}: expected a contiguous tensor (call .contiguous())")


def _aligned(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.data_ptr() % _VEC_ALIGN:
        raise SnapmlaError(
            f"{name}: data must start on a {_VEC_ALIGN}-byte boundary (got a view at offset "
            f"{t.data_ptr() % _VEC_ALIGN}); pass a fresh tensor or .clone()"
        )


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


def _slots_i32(slots: torch.Tensor) -> torch.Tensor:
    """int32 slots for the kernels; int64 values outside int32 clamp to values that are skipped."""
    if slots.dtype == torch.int32:
        return slots
    return slots.clamp(-1, 2**31 - 1).to(torch.int32)


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


def _grid(rows: int) -> int:
    per_cta = _WARPS_PER_CTA * _ROWS_PER_WARP
    return max(1, min(-(-rows // per_cta), _MAX_CTAS))


def _run(device: torch.device, kernel_name: str, rows: int, args: Sequence[object]) -> None:
    kernel = get_kernel(PREP_SOURCE, kernel_name, PREP_DEFINES, device=device)
    with torch.cuda.device(device):
        launch(kernel, _grid(rows), _THREADS, args)


def _dequant_rows(rows: QuantizedRows) -> torch.Tensor:
    """The reference dequantization the kernels reproduce: float32 multiply, then bf16 RNE."""
    return rows.dequantize(torch.float32).to(torch.bfloat16)


def _valid_slots(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    return (slots >= 0) & (slots < num_slots)


# ---------------------------------------------------------------- Q-quant


def quantize_q(q: torch.Tensor) -> QuantizedRows:
    """Quantize query rows ``q[..., 576]`` (SPEC section 3, per row = per (request, token, head)).

    Returns :class:`QuantizedRows` with ``content`` float8_e4m3fn ``[..., 512]``, ``scale``
    float32 ``[...]`` and pre-scaled ``rope`` bf16 ``[..., 64]``; bytes identical to
    ``quantize_rows``. CUDA: bf16, contiguous. CPU: bf16, fp16 or fp32.
    """
    q = _tensor("q", q)
    device = _same_device([("q", q)])
    if q.dim() < 1 or q.shape[-1] != D_QK:
        raise SnapmlaError(
            f"q: expected shape [..., {D_QK}] (e.g. [b, s_q, h_q, {D_QK}]), got {tuple(q.shape)}"
        )
    _contiguous("q", q)
    if device.type == "cpu":
        _dtype("q", q, _CPU_FLOAT_DTYPES)
        return quantize_rows(q)
    _dtype("q", q, (torch.bfloat16,))
    _aligned("q", q)
    lead = q.shape[:-1]
    rows = q.numel() // D_QK
    content = torch.empty((*lead, D_CONTENT), dtype=torch.uint8, device=device)
    scale = torch.empty(lead, dtype=torch.float32, device=device)
    rope = torch.empty((*lead, D_ROPE), dtype=torch.bfloat16, device=device)
    if rows:
        _run(device, "snapmla_quantize_q", rows, [q, content, scale, rope, i64(rows)])
    return QuantizedRows(content=content.view(FP8_DTYPE), scale=scale, rope=rope)


# ---------------------------------------------------------------- K-append


def append_kv(kv: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
    """Quantize ``kv`` bf16 ``[n, 576]`` and write token ``i`` into slot ``slots[i]``
    (``page * 64 + row``) of the paged FP8 cache, in place. Returns ``k_cache``.

    ``k_cache``: ``[num_blocks, 64, 656]`` or ``[num_blocks, 64, 1, 656]``, uint8 or
    float8_e4m3fn, contiguous. ``slots``: int32 (or int64) ``[n]``; out-of-range slots are
    skipped, so nothing outside the written slots changes.
    """
    kv = _tensor("kv", kv)
    _shape("kv", kv, (None, D_QK), f"[n, {D_QK}]")
    slots = _slots("slots", slots, kv.shape[0])
    cache = _paged_cache(k_cache)
    device = _same_device([("kv", kv), ("slots", slots), ("k_cache", cache)])
    _contiguous("kv", kv)
    n, num_slots = kv.shape[0], cache.shape[0] * PAGE_SIZE
    if device.type == "cpu":
        _dtype("kv", kv, _CPU_FLOAT_DTYPES)
        if n:
            valid = _valid_slots(slots, num_slots)
            flat = cache.view(num_slots, FP8_TOKEN_BYTES)
            flat[slots[valid].long()] = quantize_tokens(kv[valid])
        return k_cache
    _dtype("kv", kv, (torch.bfloat16,))
    _aligned("kv", kv)
    _aligned("k_cache", cache)
    if n:
        _run(device, "snapmla_append_kv", n, [kv, _slots_i32(slots), i64(n), cache, i64(num_slots)])
    return k_cache


# ---------------------------------------------------------------- fetch-dequant


def fetch_dequant(
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """Dequantize every cached token of every request to bf16 ``[sum(n_i), 576]`` (request 0's
    tokens first). ``block_table`` int32 ``[b, max_blocks]``, ``cache_seqlens`` int32 ``[b]``
    (negative lengths count as 0).

    ``total_tokens``: the output's row count, to skip the host sync that reads
    ``sum(cache_seqlens)`` (needed for CUDA graphs); rows beyond the real total are zero and
    tokens beyond ``total_tokens`` are dropped.
    """
    cache = _paged_cache(k_cache)
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
    device = _same_device(
        [("k_cache", cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens)]
    )
    if total_tokens is not None and (not isinstance(total_tokens, int) or total_tokens < 0):
        raise SnapmlaError(f"total_tokens: expected a non-negative int, got {total_tokens!r}")

    cu = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    if batch:
        torch.cumsum(cache_seqlens.clamp(min=0), dim=0, dtype=torch.int32, out=cu[1:])
    total = int(cu[-1]) if total_tokens is None else total_tokens
    if device.type == "cpu":
        return _fetch_paged_cpu(cache, block_table, cu, total)
    _aligned("k_cache", cache)
    out = torch.empty((total, D_QK), dtype=torch.bfloat16, device=device)
    if total:
        num_slots = cache.shape[0] * PAGE_SIZE
        _run(
            device,
            "snapmla_fetch_dequant_paged",
            total,
            [
                cache,
                i64(num_slots),
                block_table,
                i32(block_table.shape[1]),
                cu,
                i32(batch),
                out,
                i64(total),
            ],
        )
    return out


def _fetch_paged_cpu(
    cache: torch.Tensor, block_table: torch.Tensor, cu: torch.Tensor, total: int
) -> torch.Tensor:
    out = torch.zeros((total, D_QK), dtype=torch.bfloat16)
    m = min(total, int(cu[-1]))
    max_blocks, num_slots = block_table.shape[1], cache.shape[0] * PAGE_SIZE
    if m == 0 or max_blocks == 0:
        return out
    t = torch.arange(m, dtype=torch.int64)
    req = torch.searchsorted(cu[1:].to(torch.int64), t, right=True)
    j = t - cu[req].to(torch.int64)
    blk = j // PAGE_SIZE
    in_table = blk < max_blocks
    page = block_table[req, blk.clamp(max=max_blocks - 1)].to(torch.int64)
    slot = page * PAGE_SIZE + j % PAGE_SIZE
    valid = in_table & (page >= 0) & (slot < num_slots)
    flat = cache.view(num_slots, FP8_TOKEN_BYTES)
    out[:m][valid] = _dequant_rows(unpack_tokens(flat[slot[valid]]))
    return out


def fetch_dequant_slots(k_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Dequantize the tokens at ``slots`` (int32 ``[n]``) of a paged FP8 cache to bf16
    ``[n, 576]``; an out-of-range slot gives a row of zeros."""
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
    _aligned("k_cache", cache)
    out = torch.empty((n, D_QK), dtype=torch.bfloat16, device=device)
    if n:
        _run(
            device,
            "snapmla_fetch_dequant_slots",
            n,
            [cache, i64(num_slots), _slots_i32(slots), i64(n), out],
        )
    return out


def fetch_dequant_soa(
    content: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Dequantize the tokens at ``slots`` of a structure-of-arrays cache (SGLang-FluentLLM:
    content uint8/float8_e4m3fn ``[S, 512]``, scale float32 ``[S]``, rope bf16 ``[S, 64]``) to
    bf16 ``[n, 576]``; an out-of-range slot gives a row of zeros."""
    content = _tensor("content", content)
    scale = _tensor("scale", scale)
    rope = _tensor("rope", rope)
    _dtype("content", content, (torch.uint8, FP8_DTYPE))
    _dtype("scale", scale, (torch.float32,))
    _dtype("rope", rope, (torch.bfloat16,))
    _shape("content", content, (None, D_CONTENT), f"[slots, {D_CONTENT}]")
    num_slots = content.shape[0]
    _shape("scale", scale, (num_slots,), f"[{num_slots}]")
    _shape("rope", rope, (num_slots, D_ROPE), f"[{num_slots}, {D_ROPE}]")
    slots = _slots("slots", slots)
    for name, t in (("content", content), ("scale", scale), ("rope", rope)):
        _contiguous(name, t)
    device = _same_device(
        [("content", content), ("scale", scale), ("rope", rope), ("slots", slots)]
    )
    n = slots.shape[0]
    if device.type == "cpu":
        out = torch.zeros((n, D_QK), dtype=torch.bfloat16)
        valid = _valid_slots(slots, num_slots)
        idx = slots[valid].long()
        out[valid] = _dequant_rows(soa_to_rows(content[idx], scale[idx], rope[idx]))
        return out
    content_u8 = content.view(torch.uint8)
    for name, t in (("content", content_u8), ("scale", scale), ("rope", rope)):
        _aligned(name, t)
    out = torch.empty((n, D_QK), dtype=torch.bfloat16, device=device)
    if n:
        _run(
            device,
            "snapmla_fetch_dequant_soa",
            n,
            [content_u8, scale, rope, i64(num_slots), _slots_i32(slots), i64(n), out],
        )
    return out
