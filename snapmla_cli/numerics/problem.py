"""Decode problems: queries plus a paged cache in both formats, built the same way for the
tests, ``snapmla verify``, the tuner's correctness gate and the benchmarks.

Unused cache rows are poisoned (NaN bytes) and unused block-table entries hold garbage, so any
kernel that reads past ``cache_seqlens`` shows it in its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.layout import (
    PagedLayout,
    nan_token_bytes,
    pack_tokens,
    random_paged_layout,
    scatter_to_pages,
)
from .formats import D_QK, FP8_TOKEN_BYTES, default_softmax_scale
from .quant import QuantizedRows, quantize_rows


@dataclass
class DecodeProblem:
    """All inputs of one decode call. ``tokens[i]`` is request ``i``'s bf16 ``[n_i, 576]`` KV."""

    q: torch.Tensor  # [b, s_q, h_q, 576] bf16
    tokens: list[torch.Tensor]
    layout: PagedLayout
    causal: bool
    softmax_scale: float

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    def bf16_cache(self) -> torch.Tensor:
        """``[num_blocks, 64, 1, 576]`` bf16 with NaN in every unused row (FlashMLA's shape)."""
        fill = torch.full((D_QK,), float("nan"), dtype=torch.bfloat16)
        return scatter_to_pages(self.tokens, self.layout, fill).unsqueeze(2)

    def fp8_cache(self) -> torch.Tensor:
        """``[num_blocks, 64, 656]`` uint8 SnapMLA cache, 0xFF (NaN) bytes in unused rows."""
        packed = [pack_tokens(quantize_rows(t)) if t.shape[0] else t.new_zeros((0, FP8_TOKEN_BYTES), dtype=torch.uint8)
                  for t in self.tokens]
        return scatter_to_pages(packed, self.layout, nan_token_bytes())

    def q_quantized(self) -> QuantizedRows:
        return quantize_rows(self.q)

    def to(self, device: torch.device | str) -> DecodeProblem:
        layout = PagedLayout(self.layout.block_table.to(device), self.layout.cache_seqlens.to(device),
                             self.layout.num_blocks)
        return DecodeProblem(self.q.to(device), [t.to(device) for t in self.tokens], layout,
                             self.causal, self.softmax_scale)


def random_kv(n: int, generator: torch.Generator, content_std: float = 1.0, rope_std: float = 30.0) -> torch.Tensor:
    """Random bf16 ``[n, 576]`` KV with per-token magnitude spread and a wide RoPE range."""
    token_gain = torch.exp(torch.randn(n, 1, generator=generator) * 0.5)
    content = torch.randn(n, 512, generator=generator) * content_std * token_gain
    rope = torch.randn(n, 64, generator=generator) * rope_std
    return torch.cat([content, rope], dim=1).to(torch.bfloat16)


def random_problem(
    seqlens: list[int],
    s_q: int,
    h_q: int,
    causal: bool = False,
    seed: int = 0,
    q_std: float = 1.0,
    softmax_scale: float | None = None,
) -> DecodeProblem:
    """Fresh random data (never zeros) on the CPU; move with :meth:`DecodeProblem.to`."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(len(seqlens), s_q, h_q, D_QK, generator=gen) * q_std).to(torch.bfloat16)
    tokens = [random_kv(n, gen) for n in seqlens]
    layout = random_paged_layout(seqlens, generator=gen)
    scale = default_softmax_scale() if softmax_scale is None else softmax_scale
    return DecodeProblem(q, tokens, layout, causal, scale)
