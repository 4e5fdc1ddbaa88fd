"""Plain (non-quantized) absorbed-MLA decode over a paged cache: the ``ref64`` / ``floor``
references of SPEC section 6, in float64 (or float32 for speed), written so a reader can check
it against SPEC section 2 line by line."""

from __future__ import annotations

import math

import torch

from ..cache.layout import gather_from_pages
from .formats import D_V
from .visibility import visibility_mask


def decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool = False,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[b, s_q, h_q, 576]`` and a dense ``[num_blocks, 64, 576]`` cache (bf16, or
    dequantized FP8) -> ``out`` ``[b, s_q, h_q, 512]`` and ``lse`` ``[b, h_q, s_q]`` in ``dtype``."""
    b, s_q, h_q, d = q.shape
    device = q.device
    out = torch.zeros(b, s_q, h_q, D_V, dtype=dtype, device=device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=dtype, device=device)
    seqlens = cache_seqlens.tolist()
    for i in range(b):
        n = int(seqlens[i])
        if n == 0:
            continue
        keys = gather_from_pages(kv_cache, block_table[i], n).to(dtype)
        rows = q[i].reshape(s_q * h_q, d).to(dtype)
        logits = (rows @ keys.T) * softmax_scale
        mask = visibility_mask(n, s_q, h_q, causal, device)
        logits = logits.masked_fill(~mask, -math.inf)
        row_lse = torch.logsumexp(logits, dim=-1)
        has_keys = mask.any(dim=-1)
        probs = torch.where(has_keys[:, None], torch.exp(logits - row_lse[:, None]), 0.0)
        row_out = probs @ keys[:, :D_V]
        out[i] = row_out.reshape(s_q, h_q, D_V)
        row_lse = torch.where(has_keys, row_lse, math.inf)
        lse[i] = row_lse.reshape(s_q, h_q).T
    return out, lse
