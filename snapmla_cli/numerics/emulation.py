"""Emulation of the SnapMLA FP8 decode pipeline (SPEC section 5): the definition of the algorithm.

Every rounding decision the kernel makes (FP8 operands, float32 logits, the running max per
64-token block, the per-(row, block) P scale ``sigma_k`` and the E4M3 rounding of P) is made here
the same way. The online recurrence ``O = gamma O + P V`` is evaluated in its telescoped closed
form in float64 (the product of the gammas from block k to the last block is
``exp(m_k - m_K) sigma_k / sigma_K``), so the emulation runs vectorised over all blocks at once
instead of as a Python loop, while meaning exactly the same thing.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..cache.layout import gather_from_pages, unpack_tokens
from ..errors import SnapmlaError, dtype_name
from .decode_args import (
    check_finite_keys,
    check_key_pads,
    check_key_scales,
    checked_paged_decode,
    first_overflowing_row,
    is_integer,
    require_finite,
    require_readable,
)
from .formats import (
    D_CONTENT,
    D_ROPE,
    D_V,
    E4M3_MAX,
    FP8_CACHE_DTYPES,
    FP8_DTYPE,
    FP8_TOKEN_BYTES,
    P_BLOCK_TOKENS,
    P_SCALE_FLOOR,
)
from .quant import QuantizedRows, as_e4m3, divide_by, e4m3_round
from .visibility import visible_counts

# Rows of one request handled per vectorised step; bounds the [rows, tokens] temporaries.
_ROW_CHUNK_ELEMS = 1 << 24


@dataclass(frozen=True)
class PartialResult:
    """One split's result for some rows: normalised ``out`` ``[rows, 512]`` float64 and ``lse``
    ``[rows]`` float64, -inf where the split had no visible key for that row."""

    out: torch.Tensor
    lse: torch.Tensor


def _split_rows(
    q_c: torch.Tensor,
    q_s: torch.Tensor,
    q_r: torch.Tensor,
    k_c: torch.Tensor,
    k_s: torch.Tensor,
    k_r: torch.Tensor,
    visible: torch.Tensor,
    start: int,
    softmax_scale: float,
) -> PartialResult:
    """Run the section-5 recurrence for ``rows`` query rows over keys ``start .. start+len-1``
    (``start`` a multiple of 64; ``visible[r]`` is the row's absolute visible-key count)."""
    rows, n = q_c.shape[0], k_c.shape[0]
    pad = (-n) % P_BLOCK_TOKENS
    # Logits: exact products, float32 result (the kernel's float32 accumulator, order aside).
    raw = (q_c.double() @ k_c.double().T + q_r.double() @ k_r.double().T).float()
    scale_row = (torch.tensor(softmax_scale, dtype=torch.float32) * q_s)[:, None]
    logits = scale_row * k_s[None, :] * raw
    pos = start + torch.arange(n, device=q_c.device)
    mask = pos[None, :] < visible[:, None]
    logits = logits.masked_fill(~mask, -math.inf)
    logits = torch.nn.functional.pad(logits, (0, pad), value=-math.inf)
    nblk = logits.shape[1] // P_BLOCK_TOKENS
    blocks = logits.view(rows, nblk, P_BLOCK_TOKENS)
    block_max = blocks.amax(dim=-1)
    active = block_max > -math.inf
    running_max = torch.cummax(block_max, dim=1).values
    safe_max = torch.where(active, running_max, torch.zeros_like(running_max))
    e = torch.exp(blocks - safe_max[..., None])  # 0 for masked (-inf) entries
    k_s_blocks = torch.nn.functional.pad(k_s, (0, pad), value=0.0).view(1, nblk, P_BLOCK_TOKENS)
    e_tilde = e * k_s_blocks
    sigma = torch.clamp(divide_by(e_tilde.amax(dim=-1), E4M3_MAX), min=P_SCALE_FLOOR)
    p = e4m3_round(e_tilde / sigma[..., None]).float()
    final_max = running_max[:, -1]
    has_keys = torch.isfinite(final_max)
    final_safe = torch.where(has_keys, final_max, torch.zeros_like(final_max)).double()
    weight = torch.where(active, torch.exp(safe_max.double() - final_safe[:, None]), 0.0)
    p_weighted = (p.double() * (weight * sigma.double())[..., None]).reshape(rows, -1)[:, :n]
    numer = p_weighted @ k_c[:, :D_V].double()
    denom = (e.double().sum(dim=-1) * weight).sum(dim=-1)
    safe_denom = torch.where(has_keys, denom, torch.ones_like(denom))
    out = torch.where(has_keys[:, None], numer / safe_denom[:, None], 0.0)
    lse = torch.where(has_keys, final_safe + torch.log(safe_denom), -math.inf)
    return PartialResult(out=out, lse=lse)


def combine_partials(parts: list[PartialResult]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split results by log-sum-exp weighting; rows with no key anywhere get out 0 and
    lse +inf (FlashMLA's convention)."""
    lses = torch.stack([p.lse for p in parts])  # [splits, rows]
    outs = torch.stack([p.out for p in parts])  # [splits, rows, 512]
    total = torch.logsumexp(lses, dim=0)
    has_keys = torch.isfinite(total)
    safe_total = torch.where(has_keys, total, torch.zeros_like(total))
    weights = torch.where(torch.isfinite(lses), torch.exp(lses - safe_total[None]), 0.0)
    out = (weights[..., None] * outs).sum(dim=0)
    return out, torch.where(has_keys, total, math.inf)


def emulate_fp8_decode(
    q: QuantizedRows,
    fp8_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    split_bounds: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Emulate the FP8 kernel. ``q`` holds quantized rows of shape ``[b, s_q, h_q]``;
    ``fp8_cache`` is ``[num_blocks, 64, 656]`` (or ``[num_blocks, 64, 1, 656]``) bytes, uint8 or a
    float8_e4m3fn view as the decode kernels take it (SPEC section 2). ``softmax_scale`` None is
    ``576 ** -0.5``. ``split_bounds[i]`` optionally lists
    the token boundaries (multiples of 64, from 0 to ``n_i``) of request ``i``'s KV splits.
    Returns ``out`` ``[b, s_q, h_q, 512]`` and ``lse`` ``[b, h_q, s_q]``, float64. Arguments are
    checked first: a NaN here would otherwise read as a block with no visible key."""
    b, s_q, h_q = _checked_queries(q)
    fp8_cache, softmax_scale, causal, seqlens = checked_paged_decode(
        "fp8_cache", fp8_cache, FP8_TOKEN_BYTES, FP8_CACHE_DTYPES, block_table, cache_seqlens, b,
        softmax_scale, causal)
    fp8_cache = fp8_cache.view(torch.uint8)  # the token bytes, whichever view was given
    if split_bounds is not None and (not isinstance(split_bounds, (list, tuple)) or len(split_bounds) != b):
        got = len(split_bounds) if isinstance(split_bounds, (list, tuple)) else type(split_bounds).__name__
        raise SnapmlaError(f"split_bounds: expected one list of bounds per request ({b}), got {got}")
    device = q.scale.device
    out = torch.zeros(b, s_q, h_q, D_V, dtype=torch.float64, device=device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64, device=device)
    for i, n in enumerate(seqlens):
        if n == 0:
            continue
        tokens = gather_from_pages(fp8_cache, block_table[i], n)
        keys = unpack_tokens(tokens)
        k_c, k_s, k_r = keys.content.float(), keys.scale.float(), keys.rope.float()
        check_finite_keys("fp8_cache", i, k_c, k_s, k_r)
        check_key_scales("fp8_cache", i, k_s)
        check_key_pads("fp8_cache", i, tokens)
        if s_q * h_q == 0:
            continue  # no query rows: empty outputs, as the reference gives (the keys were checked)
        q_c = as_e4m3(q.content[i]).reshape(s_q * h_q, D_CONTENT).float()
        q_s = q.scale[i].reshape(s_q * h_q).float()
        q_r = q.rope[i].reshape(s_q * h_q, D_ROPE).float()
        visible = visible_counts(n, s_q, causal, device).repeat_interleave(h_q)
        bounds = split_bounds[i] if split_bounds is not None else [0, n]
        _check_bounds(bounds, n)
        row_chunk = max(1, _ROW_CHUNK_ELEMS // max(n, 1))
        row_out, row_lse = [], []
        for r0 in range(0, s_q * h_q, row_chunk):
            r1 = min(r0 + row_chunk, s_q * h_q)
            parts = [
                _split_rows(q_c[r0:r1], q_s[r0:r1], q_r[r0:r1], k_c[a:z], k_s[a:z], k_r[a:z],
                            visible[r0:r1], a, softmax_scale)
                for a, z in itertools.pairwise(bounds)
            ]
            o, l = combine_partials(parts)
            row_out.append(o)
            row_lse.append(l)
        request_out, request_lse = torch.cat(row_out), torch.cat(row_lse)
        _check_overflow(i, visible, request_out, request_lse)
        out[i] = request_out.reshape(s_q, h_q, D_V)
        lse[i] = request_lse.reshape(s_q, h_q).T
    return out, lse


def _check_overflow(request: int, visible: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Every row of ``request`` that sees a key ends with a finite ``lse`` and ``out``. Finite
    queries and keys can still give logits beyond float32 (SPEC section 5's ``softmax_scale * s_q *
    s_k * (q_cq . k_cq + q_r' . k_r')``: values near 1e20, or a pre-scaled RoPE dot product when
    the content is near zero and its scale at the 2^-32 floor); an infinite block maximum then
    reads as "no visible key" (out 0, lse +inf) and a NaN one as NaN, a wrong result with no
    word of why."""
    row = first_overflowing_row(visible > 0, out, lse)
    if row is not None:
        raise SnapmlaError(f"q, fp8_cache: request {request}'s logits overflow float32 (row {row} of its s_q * h_q; "
                           "softmax_scale * s_q * s_k * (q_cq . k_cq + q_r' . k_r'), SPEC section 5): values too "
                           "large for the FP8 pipeline")


def _check_bounds(bounds: object, n: int) -> None:
    """One request's split bounds: whole numbers (a float or None would fail as a slice index, far
    from the argument) from 0 to ``n``, increasing, each split starting on a P block."""
    ok = isinstance(bounds, (list, tuple)) and all(is_integer(x) for x in bounds) and len(bounds) >= 2 and (
        bounds[0] == 0 and bounds[-1] == n
        and all(a < z and a % P_BLOCK_TOKENS == 0 for a, z in itertools.pairwise(bounds)))
    if not ok:
        raise SnapmlaError(f"split_bounds {bounds}: expected 0 to {n} in increasing multiples of {P_BLOCK_TOKENS}")


# the dtypes of quantized query rows, as quantize_q makes them and the FP8 decode call takes them
# (content also as raw uint8 bytes): anything else is not E4M3 data and would be read as numbers
_QUERY_DTYPES = {"q.content": (FP8_DTYPE, torch.uint8), "q.scale": (torch.float32,), "q.rope": (torch.bfloat16,)}


def _checked_queries(q: object) -> tuple[int, int, int]:
    """(batch, s_q, h_q) of quantized query rows whose three parts agree in shape and dtype, are
    finite (an E4M3 NaN byte, a NaN or infinite scale or RoPE) and have positive scales."""
    if not isinstance(q, QuantizedRows) or not all(
            isinstance(t, torch.Tensor) for t in (q.content, q.scale, q.rope)):
        raise SnapmlaError(f"q: expected QuantizedRows of tensors (quantize_rows / quantize_q), got {type(q).__name__}")
    for name, t in (("q.content", q.content), ("q.scale", q.scale), ("q.rope", q.rope)):
        require_readable(name, t)
        if t.dtype not in _QUERY_DTYPES[name]:
            want = " or ".join(dtype_name(d) for d in _QUERY_DTYPES[name])
            raise SnapmlaError(f"{name}: expected dtype {want}, got {dtype_name(t.dtype)}")
    if q.scale.dim() != 3:
        raise SnapmlaError(f"q.scale: expected shape [batch, s_q, h_q], got {tuple(q.scale.shape)}")
    lead = tuple(q.scale.shape)
    for name, t, width in (("q.content", q.content, D_CONTENT), ("q.rope", q.rope, D_ROPE)):
        if tuple(t.shape) != (*lead, width):
            raise SnapmlaError(f"{name}: expected shape {(*lead, width)}, got {tuple(t.shape)}")
    for name, t in (("q.content", as_e4m3(q.content)), ("q.scale", q.scale), ("q.rope", q.rope)):
        require_finite(f"{name}: expected finite values, found NaN or inf", t)
    if q.scale.numel() and not bool((q.scale > 0).all()):
        raise SnapmlaError(f"q.scale: expected positive scales (at least 2^-32, SPEC section 3), "
                           f"got {float(q.scale.min())}")
    b, s_q, h_q = lead
    return b, s_q, h_q


assert FP8_DTYPE is torch.float8_e4m3fn
