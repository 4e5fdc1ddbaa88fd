"""RoPE-aware per-token FP8 quantization (SPEC section 3): the bit-exact reference.

The same function quantizes cached tokens (K-append) and query rows (Q-quant): content is
divided by its per-row scale and rounded to E4M3, the RoPE part is divided by the same scale
and rounded to bf16 ("pre-scaled domain alignment"), so that ``q . k = s_q * s_k * (q_cq . k_cq +
q_r' . k_r')``. The GPU quantizers must produce bytes identical to this code, so every step is
an explicitly rounded float32 operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SnapmlaError
from .formats import D_CONTENT, D_QK, D_ROPE, E4M3_MAX, FP8_DTYPE, KV_SCALE_FLOOR


@dataclass(frozen=True)
class QuantizedRows:
    """Per-row quantized MLA vectors: ``content`` E4M3 ``[..., 512]``, ``scale`` float32 ``[...]``,
    ``rope`` pre-scaled bf16 ``[..., 64]``."""

    content: torch.Tensor
    scale: torch.Tensor
    rope: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[..., 576]`` in ``dtype``: content * s and RoPE * s (the values the kernel 'sees').
        Content given as raw bytes (uint8, as the decode calls accept it) is read as E4M3, not
        as the integers 0..255."""
        s = self.scale.to(dtype).unsqueeze(-1)
        content = as_e4m3(self.content).to(dtype) * s
        rope = self.rope.to(dtype) * s
        return torch.cat([content, rope], dim=-1)


def as_e4m3(content: torch.Tensor) -> torch.Tensor:
    """E4M3 content as float8_e4m3fn: raw bytes (uint8) viewed, anything else unchanged."""
    return content.view(FP8_DTYPE) if content.dtype == torch.uint8 else content


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3, round to nearest even, saturating at +-448 (NaN stays NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def divide_by(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, the IEEE quotient on every device. PyTorch's CUDA division by a CPU scalar
    (a Python number or a 0-d CPU tensor) multiplies by the divisor's reciprocal instead, which is
    one bit off for some values (ATen's ``div_true_kernel_cuda``): ``amax / 448`` on the GPU gave
    another scale than on the CPU for 72,100 of 131,264 synthetic tokens, so the references that
    verify and the GPU tests build on the GPU differed from SPEC section 3. The divisor therefore
    goes to ``x``'s device as a tensor, which takes the true division."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def row_scale(content: torch.Tensor) -> torch.Tensor:
    """``s = max(amax(c) / 448, 2^-32)`` in float32 over the last dimension."""
    amax = content.float().abs().amax(dim=-1)
    return torch.clamp(divide_by(amax, E4M3_MAX), min=KV_SCALE_FLOOR)


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """Quantize ``x[..., 576]`` (any float dtype) row by row, as SPEC section 3 defines.

    The definition, not a checked entry point: a row holding NaN or inf gets a non-finite scale.
    The callers that take user data check it first (``quantize_q``, ``append_kv``, the dump
    reader behind ``snapmla quantize``), so the whole-cache path pays no second pass."""
    if x.shape[-1] != D_QK:
        raise SnapmlaError(f"quantize_rows: expected last dim {D_QK}, got {tuple(x.shape)}")
    x32 = x.float()
    content, rope = x32[..., :D_CONTENT], x32[..., D_CONTENT:]
    scale = row_scale(content)
    s = scale.unsqueeze(-1)
    content_q = e4m3_round(content / s)
    rope_q = (rope / s).to(torch.bfloat16)
    assert rope_q.shape[-1] == D_ROPE
    return QuantizedRows(content=content_q, scale=scale, rope=rope_q)
