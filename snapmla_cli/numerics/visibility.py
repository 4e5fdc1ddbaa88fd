"""Which cache tokens each query row sees (SPEC section 2), shared by every reference."""

from __future__ import annotations

import torch


def visible_counts(seqlen: int, s_q: int, causal: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 ``[s_q]``: query token ``t`` sees cache tokens ``0 .. n - s_q + t`` when causal,
    all ``n`` otherwise (clamped to ``[0, n]``)."""
    t = torch.arange(s_q, device=device)
    if causal:
        return torch.clamp(seqlen - s_q + t + 1, min=0, max=seqlen)
    return torch.full((s_q,), seqlen, dtype=torch.int64, device=device)


def visibility_mask(seqlen: int, s_q: int, h_q: int, causal: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool ``[s_q * h_q, seqlen]``, rows ordered (token, head) like ``q.reshape(s_q*h_q, -1)``."""
    counts = visible_counts(seqlen, s_q, causal, device).repeat_interleave(h_q)
    return torch.arange(seqlen, device=device)[None, :] < counts[:, None]
