"""Find the MLA attention modules of a Hugging Face model and describe what snapmla needs of them.

An attention module counts as MLA when it has the DeepSeek-V2/V3 sub-modules
``kv_a_proj_with_mqa`` (hidden -> latent + RoPE), ``kv_a_layernorm`` (the latent's RMSNorm) and
``kv_b_proj`` (latent -> per-head K_nope and V): transformers' DeepSeek-V3 and DeepSeek-V2 (tested),
LongCat-Flash (two MLA modules per decoder layer, its extra latent/query factors honoured; tested)
and other families that reuse those module names (best effort: ``--check`` tells whether the capture
is exact). The dump's layer index is the module's ``layer_idx``, the model's cache layer index.

Nothing of transformers' code is copied: the RoPE rotation is the modeling module's own function,
looked up next to the attention class, and the absorbed weights ``W_UK`` / ``W_UV`` are read by
running ``kv_b_proj`` on the identity (so a quantized ``kv_b_proj`` that dequantizes in its
forward works too).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import SnapmlaError
from ..numerics.formats import D_CONTENT, D_ROPE, default_softmax_scale

_MLA_CHILDREN = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")

Rotate = Callable[[torch.Tensor, torch.Tensor, object], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class MlaAttention:
    """One MLA attention module: its cache layer index (``layer_idx``), shapes and scales."""

    index: int
    name: str
    # the model's attention module; Any because its children (kv_b_proj, o_proj, ...) differ by
    # model class and are read by name, which nn.Module's __getattr__ types as Tensor | Module
    module: Any
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # the model's own (1/sqrt(qk_head_dim), times YaRN mscale^2 if any)
    kv_scale: float  # extra factor on the normalised latent (LongCat-Flash's mla_scale_kv_lora)
    q_scale: float  # extra factor on q (LongCat-Flash's mla_scale_q_lora)
    rotate: Rotate
    q_module: Any  # q_b_proj, or q_proj for checkpoints without a q LoRA
    _weights: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def query_prescale(self) -> float:
        """Factor folded into the dumped queries so that SPEC's default ``576**-0.5`` reproduces
        the model's logits: ``model_scale * q.k == 576**-0.5 * (prescale * q).k``."""
        return self.softmax_scale / default_softmax_scale()

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` ``[h, qk_nope, 512]`` and ``W_UV`` ``[h, v, 512]`` in float32 on the module's
        device: ``k_nope[h] = W_UK[h] @ c`` and ``v[h] = W_UV[h] @ c``."""
        if self._weights is None:
            proj = self.module.kv_b_proj
            ref = _first_param(proj)
            dtype = (
                ref.dtype
                if ref.dtype.is_floating_point and ref.element_size() >= 2
                else torch.bfloat16
            )
            eye = torch.eye(D_CONTENT, dtype=dtype, device=ref.device)
            with torch.no_grad():
                cols = proj(eye) - proj(torch.zeros_like(eye[:1]))  # drops a bias if there is one
            w = cols.float().T.reshape(
                self.num_heads, self.qk_nope_head_dim + self.v_head_dim, D_CONTENT
            )
            self._weights = (
                w[:, : self.qk_nope_head_dim].contiguous(),
                w[:, self.qk_nope_head_dim :].contiguous(),
            )
        return self._weights


def _first_param(module: nn.Module) -> torch.Tensor:
    for p in module.parameters():
        return p
    for b in module.buffers():
        return b
    raise SnapmlaError(f"MLA module {type(module).__name__} has no weights")


def is_mla(module: nn.Module) -> bool:
    return all(getattr(module, name, None) is not None for name in _MLA_CHILDREN)


def _rotation(module: nn.Module, config: object) -> Rotate:
    """The modeling file's own RoPE function, chosen the way its attention forward chooses it."""
    home = sys.modules[type(module).__module__]
    complex_fn = getattr(home, "apply_rotary_emb", None)  # DeepSeek-V2: freqs_cis, complex
    interleave_fn = getattr(home, "apply_rotary_pos_emb_interleave", None)
    plain_fn = getattr(home, "apply_rotary_pos_emb", None)
    interleave = bool(getattr(config, "rope_interleave", False)) or plain_fn is None

    def rotate(
        q: torch.Tensor, k: torch.Tensor, pos_emb: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(pos_emb, torch.Tensor) and pos_emb.is_complex():
            if complex_fn is None:
                raise SnapmlaError(
                    f"{home.__name__}: complex position embeddings but no apply_rotary_emb"
                )
            return complex_fn(q, k, pos_emb)
        if not (isinstance(pos_emb, tuple | list) and len(pos_emb) == 2):
            raise SnapmlaError(
                f"{type(module).__name__}: unrecognised position embeddings {type(pos_emb).__name__}"
            )
        cos, sin = pos_emb
        fn = interleave_fn if interleave else plain_fn
        if fn is None:
            raise SnapmlaError(
                f"{home.__name__}: no RoPE function to re-apply (apply_rotary_pos_emb*)"
            )
        return fn(q, k, cos, sin)

    return rotate


def _scalar(module: nn.Module, name: str) -> float:
    value = getattr(module, name, 1.0)
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def check_mla_config(config: object, model: str) -> None:
    """One-line errors for a config without MLA or with latent/RoPE widths snapmla cannot store."""
    rank = getattr(config, "kv_lora_rank", None)
    rope = getattr(config, "qk_rope_head_dim", None)
    kind = getattr(config, "model_type", "?")
    if rank is None or rope is None:
        raise SnapmlaError(
            f"model {model} (model_type={kind}) has no MLA attention: its config has no "
            "kv_lora_rank/qk_rope_head_dim (snapmla dump reads DeepSeek-V2/V3-style models)"
        )
    if int(rank) != D_CONTENT or int(rope) != D_ROPE:
        raise SnapmlaError(
            f"model {model}: kv_lora_rank={rank}, qk_rope_head_dim={rope}, but the snapmla KV format "
            f"is fixed at {D_CONTENT} + {D_ROPE}"
        )


def find_mla_attention(model: nn.Module, model_name: str) -> list[MlaAttention]:
    """Every MLA attention module of ``model``, sorted by cache layer index."""
    config = getattr(model, "config", None)
    found: list[MlaAttention] = []
    for name, module in model.named_modules():
        if not is_mla(module):
            continue
        q_module = getattr(module, "q_b_proj", None)
        if q_module is None:
            q_module = getattr(module, "q_proj", None)
        if q_module is None:
            raise SnapmlaError(f"{name}: MLA attention without q_b_proj or q_proj")
        nope = getattr(module, "qk_nope_head_dim", None) or getattr(
            config, "qk_nope_head_dim", None
        )
        v_dim = getattr(module, "v_head_dim", None) or getattr(config, "v_head_dim", None)
        heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None)
        scale = getattr(module, "scaling", None)
        if scale is None:  # (not `or`: a scaling of 0 is the model's, and refused below by name)
            scale = getattr(module, "softmax_scale", None)
        if nope is None or v_dim is None or heads is None or scale is None:
            raise SnapmlaError(
                f"{name}: cannot read qk_nope_head_dim/v_head_dim/num_heads/scaling of {type(module).__name__}"
            )
        rank = getattr(module, "kv_lora_rank", D_CONTENT)
        rope = getattr(module, "qk_rope_head_dim", D_ROPE)
        if int(rank) != D_CONTENT or int(rope) != D_ROPE:
            check_mla_config(module, model_name)
        index = getattr(module, "layer_idx", None)
        found.append(
            MlaAttention(
                index=len(found) if index is None else int(index),
                name=name,
                module=module,
                num_heads=int(heads),
                qk_nope_head_dim=int(nope),
                v_head_dim=int(v_dim),
                softmax_scale=float(scale),
                kv_scale=_scalar(module, "mla_scale_kv_lora"),
                q_scale=_scalar(module, "mla_scale_q_lora"),
                rotate=_rotation(module, config),
                q_module=q_module,
            )
        )
    if not found:
        raise SnapmlaError(
            f"model {model_name} has no MLA attention (no module with {', '.join(_MLA_CHILDREN)})"
        )
    found.sort(key=lambda a: a.index)
    indices = [a.index for a in found]
    if len(set(indices)) != len(indices):
        raise SnapmlaError(f"model {model_name}: MLA modules share layer indices {indices}")
    bad = [a for a in found if not (math.isfinite(a.softmax_scale) and a.softmax_scale > 0)]
    if bad:
        raise SnapmlaError(f"model {model_name}: {bad[0].name}: attention scaling {bad[0].softmax_scale!r}, "
                           "expected a finite number > 0")
    return found
