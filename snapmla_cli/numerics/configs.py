"""The KV quantization configurations that ``snapmla quantize`` compares (SPEC section 4).

Each configuration is a fake-quantizer: ``[tokens, 576]`` (any float dtype) -> the dequantized
float32 ``[tokens, 576]`` the attention would see. All use E4M3 with ``scale = max(amax / 448,
2^-32)`` over their scaling group and IEEE float32 division, like the reference quantizer; the
configurations differ only in the group and in what happens to the RoPE part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import SnapmlaError
from ..sizes import unique_values
from .formats import D_CONTENT, D_QK, E4M3_MAX, KV_SCALE_FLOOR, PAGE_SIZE
from .quant import divide_by, e4m3_round, quantize_rows

GROUP_CHANNELS = 128  # channels per scale for configs D and G
BLOCK_TOKENS = PAGE_SIZE  # tokens per scale block for config D


def _fake_e4m3(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``e4m3(x / s) * s`` with ``s = max(amax / 448, 2^-32)`` (``amax`` broadcasts to ``x``)."""
    scale = torch.clamp(divide_by(amax.float(), E4M3_MAX), min=KV_SCALE_FLOOR)
    return e4m3_round(x / scale).float() * scale


def _split(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if kv.dim() != 2 or kv.shape[1] != D_QK:
        raise SnapmlaError(f"quantization config: expected [tokens, {D_QK}], got {tuple(kv.shape)}")
    x = kv.float()
    return x[:, :D_CONTENT], x[:, D_CONTENT:]


def _amax_over_tokens(content: torch.Tensor, keepdim_channels: bool) -> torch.Tensor:
    """The layer's |x| maximum over its tokens (per channel when ``keepdim_channels``), 0 for a
    layer with no tokens: ``amax`` has no identity element, so an empty reduction raises."""
    if content.shape[0] == 0:
        return torch.zeros((1, content.shape[1]) if keepdim_channels else (), dtype=content.dtype, device=content.device)
    if keepdim_channels:
        return content.abs().amax(dim=0, keepdim=True)
    return content.abs().amax()


def _rope_bf16(rope: torch.Tensor) -> torch.Tensor:
    return rope.to(torch.bfloat16).float()


def fake_snap(kv: torch.Tensor) -> torch.Tensor:
    """SnapMLA: per-token E4M3 content, RoPE pre-scaled bf16 (the reference quantizer itself)."""
    _split(kv)
    return quantize_rows(kv).dequantize(torch.float32)


def fake_per_token_all(kv: torch.Tensor) -> torch.Tensor:
    """Config A: per-token E4M3 over all 576 dims, RoPE quantized with the content."""
    x = torch.cat(_split(kv), dim=1)
    return _fake_e4m3(x, x.abs().amax(dim=1, keepdim=True))


def fake_per_tensor(kv: torch.Tensor) -> torch.Tensor:
    """Config B: one content scale for the whole layer, RoPE bf16."""
    content, rope = _split(kv)
    return torch.cat([_fake_e4m3(content, _amax_over_tokens(content, False)), _rope_bf16(rope)], dim=1)


def fake_per_channel(kv: torch.Tensor) -> torch.Tensor:
    """Config C: one content scale per channel over the layer's tokens, RoPE bf16."""
    content, rope = _split(kv)
    return torch.cat([_fake_e4m3(content, _amax_over_tokens(content, True)), _rope_bf16(rope)], dim=1)


def fake_per_block(kv: torch.Tensor) -> torch.Tensor:
    """Config D: one content scale per block of 64 tokens x 128 channels (the last block of
    tokens may be partial), RoPE bf16."""
    content, rope = _split(kv)
    n = content.shape[0]
    pad = (-n) % BLOCK_TOKENS
    padded = torch.nn.functional.pad(content, (0, 0, 0, pad))
    blocks = padded.view(-1, BLOCK_TOKENS, D_CONTENT // GROUP_CHANNELS, GROUP_CHANNELS)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    deq = _fake_e4m3(blocks, amax).view(-1, D_CONTENT)[:n]
    return torch.cat([deq, _rope_bf16(rope)], dim=1)


def fake_per_token_group(kv: torch.Tensor) -> torch.Tensor:
    """Config G: per token, one content scale per 128 channels (DeepSeek-V3.2 style), RoPE bf16."""
    content, rope = _split(kv)
    groups = content.reshape(-1, D_CONTENT // GROUP_CHANNELS, GROUP_CHANNELS)
    deq = _fake_e4m3(groups, groups.abs().amax(dim=2, keepdim=True)).reshape(-1, D_CONTENT)
    return torch.cat([deq, _rope_bf16(rope)], dim=1)


@dataclass(frozen=True)
class QuantConfig:
    id: str
    content: str
    rope: str
    fake_quant: Callable[[torch.Tensor], torch.Tensor]


CONFIGS: dict[str, QuantConfig] = {
    c.id: c
    for c in (
        QuantConfig("snap", "per-token E4M3", "bf16 pre-scaled", fake_snap),
        QuantConfig("A", "per-token E4M3 over all 576 dims", "E4M3", fake_per_token_all),
        QuantConfig("B", "per-tensor E4M3", "bf16", fake_per_tensor),
        QuantConfig("C", "per-channel E4M3", "bf16", fake_per_channel),
        QuantConfig("D", "per-block E4M3 (64 tokens x 128 ch)", "bf16", fake_per_block),
        QuantConfig("G", "per-token-group E4M3 (128 ch)", "bf16", fake_per_token_group),
    )
}


def get_configs(ids: list[str] | None = None, what: str | None = None) -> list[QuantConfig]:
    """The named configurations in the given order (all of them by default); an empty list, an
    unknown name or a name given twice (measuring a config twice would only repeat its table
    column and its JSON key, and the repeat is most often a typo for another name) is a
    one-line error, prefixed with ``what`` (the option that gave the names)."""
    if ids is None:
        return list(CONFIGS.values())
    prefix = f"{what}: " if what else ""
    if not ids:
        raise SnapmlaError(f"{prefix}expected names among {', '.join(CONFIGS)}, got none")
    unknown = [i for i in ids if i not in CONFIGS]
    if unknown:
        raise SnapmlaError(f"{prefix}unknown quantization config {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    return [CONFIGS[i] for i in unique_values(what or "configs", ((i, i) for i in ids))]
