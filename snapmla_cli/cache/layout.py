"""The 656-byte FP8 token layout and the paged cache built from it (SPEC section 3).

``pack_tokens`` / ``unpack_tokens`` convert between :class:`QuantizedRows` and raw bytes;
``build_paged_cache`` lays a list of per-request token sequences into pages through a block
table, the way an engine's allocator would, so tests and the CLI can make realistic caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SnapmlaError, dtype_name
from ..numerics.formats import (
    CONTENT_OFFSET,
    D_CONTENT,
    D_QK,
    D_ROPE,
    FP8_DTYPE,
    FP8_TOKEN_BYTES,
    PAGE_SIZE,
    ROPE_OFFSET,
    SCALE_OFFSET,
)
from ..numerics.quant import QuantizedRows, quantize_rows


def pack_tokens(rows: QuantizedRows) -> torch.Tensor:
    """``QuantizedRows`` with leading shape ``[n]`` -> uint8 ``[n, 656]`` (pad bytes zero)."""
    n = rows.scale.shape[0]
    out = torch.zeros(n, FP8_TOKEN_BYTES, dtype=torch.uint8, device=rows.scale.device)
    out[:, CONTENT_OFFSET : CONTENT_OFFSET + D_CONTENT] = rows.content.view(torch.uint8)
    out[:, SCALE_OFFSET : SCALE_OFFSET + 4] = rows.scale.contiguous().view(torch.uint8).view(n, 4)
    rope_bytes = rows.rope.contiguous().view(torch.uint8).view(n, 2 * D_ROPE)
    out[:, ROPE_OFFSET:] = rope_bytes
    return out


def unpack_tokens(raw: torch.Tensor) -> QuantizedRows:
    """uint8 ``[..., 656]`` -> ``QuantizedRows`` with the same leading shape."""
    raw = as_token_bytes(raw, "raw")
    lead = raw.shape[:-1]
    flat = raw.reshape(-1, FP8_TOKEN_BYTES)
    content = flat[:, :D_CONTENT].contiguous().view(FP8_DTYPE)
    scale = flat[:, SCALE_OFFSET : SCALE_OFFSET + 4].contiguous().view(torch.float32).reshape(-1)
    rope = flat[:, ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return QuantizedRows(
        content=content.reshape(*lead, D_CONTENT),
        scale=scale.reshape(lead),
        rope=rope.reshape(*lead, D_ROPE),
    )


def as_token_bytes(cache: torch.Tensor, name: str = "k_cache") -> torch.Tensor:
    """Accept ``[blocks, 64, 656]`` or ``[blocks, 64, 1, 656]`` uint8 / float8_e4m3fn views and
    return a uint8 view ``[..., 656]`` without the head axis."""
    if cache.dtype == FP8_DTYPE:
        cache = cache.view(torch.uint8)
    if cache.dtype != torch.uint8:
        raise SnapmlaError(f"{name}: expected uint8 or float8_e4m3fn, got {dtype_name(cache.dtype)}")
    if cache.dim() == 0 or cache.shape[-1] != FP8_TOKEN_BYTES:
        raise SnapmlaError(f"{name}: expected last dim {FP8_TOKEN_BYTES}, got {tuple(cache.shape)}")
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            raise SnapmlaError(f"{name}: expected one KV head, got shape {tuple(cache.shape)}")
        cache = cache.squeeze(2)
    return cache


def quantize_tokens(kv: torch.Tensor) -> torch.Tensor:
    """bf16/float ``[n, 576]`` -> packed uint8 ``[n, 656]`` (the reference K-append)."""
    return pack_tokens(quantize_rows(kv))


def dequantize_cache(cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 cache ``[..., 656]`` -> ``[..., 576]`` dequantized in ``dtype``."""
    return unpack_tokens(cache).dequantize(dtype)


@dataclass(frozen=True)
class PagedLayout:
    """Where each request's tokens live: ``block_table`` int32 ``[b, max_blocks]`` (unused
    entries hold garbage indices), ``cache_seqlens`` int32 ``[b]`` and the page count."""

    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    num_blocks: int


def pages_needed(seqlen: int) -> int:
    return (seqlen + PAGE_SIZE - 1) // PAGE_SIZE


def random_paged_layout(
    seqlens: list[int],
    generator: torch.Generator | None = None,
    spare_blocks: int = 3,
    garbage: int = -7,
) -> PagedLayout:
    """A random page assignment for ``seqlens``; unused block-table entries are ``garbage``
    (never read by a correct kernel) and ``spare_blocks`` pages belong to nobody."""
    need = [pages_needed(n) for n in seqlens]
    max_blocks = max(1, max(need, default=1))
    total = sum(need) + spare_blocks
    perm = torch.randperm(total, generator=generator).to(torch.int32)
    table = torch.full((len(seqlens), max_blocks), garbage, dtype=torch.int32)
    cursor = 0
    for i, k in enumerate(need):
        table[i, :k] = perm[cursor : cursor + k]
        cursor += k
    return PagedLayout(table, torch.tensor(seqlens, dtype=torch.int32), total)


def scatter_to_pages(
    tokens: list[torch.Tensor], layout: PagedLayout, fill: torch.Tensor
) -> torch.Tensor:
    """Lay per-request token rows ``[n_i, W]`` into a ``[num_blocks, 64, W]`` cache whose other
    rows are ``fill`` (broadcast to ``[W]``: NaN bytes in tests, zeros in files)."""
    width = fill.shape[-1]
    dtype = fill.dtype
    device = tokens[0].device if tokens else fill.device
    cache = fill.to(device=device, dtype=dtype).expand(layout.num_blocks, PAGE_SIZE, width).clone()
    for i, rows in enumerate(tokens):
        n = rows.shape[0]
        if n == 0:
            continue
        pages = layout.block_table[i, : pages_needed(n)].long().to(device)
        pos = torch.arange(n, device=device)
        cache[pages[pos // PAGE_SIZE], pos % PAGE_SIZE] = rows.to(dtype)
    return cache


def gather_from_pages(cache: torch.Tensor, block_table_row: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``0..n-1`` of one request from a ``[num_blocks, 64, W]`` cache."""
    if n == 0:
        return cache.new_zeros((0, cache.shape[-1]))
    pos = torch.arange(n, device=cache.device)
    pages = block_table_row[: pages_needed(n)].long().to(cache.device)
    return cache[pages[pos // PAGE_SIZE], pos % PAGE_SIZE]


def nan_token_bytes() -> torch.Tensor:
    """A 656-byte poison row: every byte 0xFF (E4M3 NaN content, NaN scale, NaN RoPE)."""
    return torch.full((FP8_TOKEN_BYTES,), 0xFF, dtype=torch.uint8)


def soa_to_rows(content: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor) -> QuantizedRows:
    """SGLang-FluentLLM structure-of-arrays (uint8 ``[slots,512]``, float32 ``[slots]``, bf16
    ``[slots,64]``) -> ``QuantizedRows``."""
    if content.dtype == torch.uint8:
        content = content.view(FP8_DTYPE)
    if content.shape[-1] != D_CONTENT or rope.shape[-1] != D_ROPE:
        raise SnapmlaError(
            f"soa cache: expected content [slots, {D_CONTENT}] and rope [slots, {D_ROPE}], "
            f"got {tuple(content.shape)} and {tuple(rope.shape)}"
        )
    return QuantizedRows(content=content, scale=scale.float().reshape(-1), rope=rope)


assert D_QK == D_CONTENT + D_ROPE
