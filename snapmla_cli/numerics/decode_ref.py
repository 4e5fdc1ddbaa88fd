"""Plain (non-quantized) absorbed-MLA decode over a paged cache: the ``ref64`` / ``floor``
references of SPEC section 6, in float64 (or float32 for speed), written so a reader can check
it against SPEC section 2 line by line."""

from __future__ import annotations

import math

import torch

from ..cache.layout import gather_from_pages
from ..errors import SnapmlaError, dtype_name, show
from .decode_args import (
    check_finite_keys,
    checked_paged_decode,
    checked_softmax_scale,
    first_overflowing_row,
    require_finite,
    require_readable,
)
from .formats import D_QK, D_V
from .visibility import visibility_mask

# the dtypes a reference may compute in (float16 overflows the logits, bfloat16 is the error measured)
REFERENCE_DTYPES = (torch.float64, torch.float32)


def decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[b, s_q, h_q, 576]`` and a dense ``[num_blocks, 64, 576]`` cache (bf16, or
    dequantized FP8) -> ``out`` ``[b, s_q, h_q, 512]`` and ``lse`` ``[b, h_q, s_q]`` in ``dtype``;
    ``softmax_scale`` None is ``576 ** -0.5`` (SPEC section 2).
    Arguments are checked first (one-line errors naming the argument; non-finite queries or keys
    a request reads are refused)."""
    _check_float_input("q", q, f"[batch, s_q, h_q, {D_QK}]", 4)
    _check_reference_dtype(dtype)
    b, s_q, h_q, d = q.shape
    kv_cache, softmax_scale, causal, seqlens = checked_paged_decode(
        "kv_cache", kv_cache, D_QK, (torch.bfloat16, torch.float16, torch.float32, torch.float64),
        block_table, cache_seqlens, b, softmax_scale, causal)
    device = q.device
    out = torch.zeros(b, s_q, h_q, D_V, dtype=dtype, device=device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=dtype, device=device)
    for i, n in enumerate(seqlens):
        if n == 0:
            continue
        keys = gather_from_pages(kv_cache, block_table[i], n).to(dtype)
        mask = visibility_mask(n, s_q, h_q, causal, device)
        row_out, row_lse = _attend(i, q[i].reshape(s_q * h_q, d), keys, mask, softmax_scale, dtype)
        out[i] = row_out.reshape(s_q, h_q, D_V)
        lse[i] = row_lse.reshape(s_q, h_q).T
    return out, lse


def _attend(request: int, rows: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, softmax_scale: float,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's attention: query ``rows`` ``[r, 576]`` over its ``keys`` ``[n, 576]`` (in
    ``dtype``) where ``mask`` ``[r, n]`` lets them see -> output ``[r, 512]`` and lse ``[r]``
    (+inf for a row that sees no key), both in ``dtype``."""
    check_finite_keys("kv_cache", request, keys)
    rows = rows.to(dtype)
    logits = (rows @ keys.T) * softmax_scale
    logits = logits.masked_fill(~mask, -math.inf)
    row_lse = torch.logsumexp(logits, dim=-1)
    has_keys = mask.any(dim=-1)
    probs = torch.where(has_keys[:, None], torch.exp(logits - row_lse[:, None]), 0.0)
    row_out = probs @ keys[:, :D_V]
    # finite inputs whose logits overflow ``dtype`` (|q . k| beyond float32's 3.4e38, or a
    # float64 q beyond float32's range cast down) made the row NaN, a result with no word of why
    bad_row = first_overflowing_row(has_keys, row_out, row_lse)
    if bad_row is not None:
        raise SnapmlaError(f"q, kv_cache: request {request}'s logits overflow {dtype_name(dtype)} (row "
                           f"{bad_row} of its s_q * h_q: softmax_scale * q . k beyond the "
                           f"range{'; compute in float64' if dtype != torch.float64 else ''})")
    return row_out, torch.where(has_keys, row_lse, math.inf)


def attend_all_tokens(q: torch.Tensor, kv: torch.Tensor, softmax_scale: float | None,
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """:func:`decode_reference`'s output for one request whose queries ``q`` ``[n, h_q, 576]``
    (finite) all see every token of ``kv`` ``[tokens, 576]`` (non-causal): ``[n, h_q, 512]`` in
    ``dtype`` (``softmax_scale`` None: SPEC's default; arguments checked with the reference's
    words). The same arithmetic without the paged cache, whose copy and gather had taken twice
    ``kv``'s size beside the keys in ``dtype`` (``quantize`` attends every layer seven times)."""
    _check_float_input("q", q, f"[n, h_q, {D_QK}]", 3)
    _check_float_input("kv", kv, f"[tokens, {D_QK}]", 2, finite=False)  # (keys: _attend's own words)
    _check_reference_dtype(dtype)
    scale = checked_softmax_scale(softmax_scale)
    n, h_q, d = q.shape
    tokens = kv.shape[0]
    mask = torch.ones(n * h_q, tokens, dtype=torch.bool, device=q.device)
    # (contiguous as the paged reference's gathered copy, so that its matmuls sum alike)
    row_out, _ = _attend(0, q.reshape(n * h_q, d), kv.to(dtype).contiguous(), mask, scale, dtype)
    return row_out.reshape(n, h_q, D_V)


def _check_float_input(name: str, t: object, shape: str, dims: int, finite: bool = True) -> None:
    """``t`` is a readable real float tensor of ``dims`` dimensions, the last of 576 (``shape`` as
    the error spells it), and with ``finite`` holds no NaN or inf."""
    if isinstance(t, torch.Tensor):
        require_readable(name, t)
    if (not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[-1] != D_QK
            or not t.dtype.is_floating_point):
        got = f"{tuple(t.shape)} {dtype_name(t.dtype)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise SnapmlaError(f"{name}: expected a float tensor {shape}, got {got}")
    if finite:
        require_finite(f"{name}: expected finite values, found NaN or inf", t)


def _check_reference_dtype(dtype: object) -> None:
    if dtype not in REFERENCE_DTYPES:  # float16 / bfloat16 were accepted and went wrong silently
        raise SnapmlaError(f"dtype: expected torch.float64 or torch.float32 for the reference, got {show(dtype)}")
