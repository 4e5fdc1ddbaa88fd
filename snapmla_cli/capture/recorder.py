"""Forward hooks that record, per MLA layer, what an absorbed-MLA engine caches.

Per attention call the hooks see: the position embeddings the decoder layer hands the attention
(pre-hook), the raw ``kv_a_proj_with_mqa`` output (its last 64 columns are the un-rotated
``k_pe``), the ``kv_a_layernorm`` output (the normalised latent ``c_kv``), the query projection's
output, and the attention's own output (post-hook). At the post-hook the model's own RoPE
function rotates ``k_pe`` (and ``q_pe``) with the same position embeddings, so the recorded rows
equal the model's cache entries bit for bit. Everything recorded moves to the CPU at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import SnapmlaError
from ..numerics.formats import D_CONTENT, D_ROPE
from .mla import MlaAttention


@dataclass
class StepState:
    """What the runner tells the hooks about the forward call in flight: which rows of it
    (a slice over the call's tokens) are probe queries to absorb and keep, if any."""

    query_rows: slice | None = None


class LayerRecorder:
    """Hooks on one MLA attention module; ``kv`` / ``queries`` / ``outputs`` are CPU chunks."""

    def __init__(
        self, attention: MlaAttention, state: StepState, dtype: torch.dtype, keep_outputs: bool
    ):
        self.attention = attention
        self.state = state
        self.dtype = dtype
        self.keep_outputs = keep_outputs
        self.kv: list[torch.Tensor] = []
        self.queries: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self._pending: dict[str, object] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._signature = inspect.signature(attention.module.forward)

    def attach(self) -> None:
        m = self.attention.module
        self._handles = [
            m.register_forward_pre_hook(self._on_enter, with_kwargs=True),
            m.kv_a_proj_with_mqa.register_forward_hook(self._keep("kv_a")),
            m.kv_a_layernorm.register_forward_hook(self._keep("c_kv")),
            self.attention.q_module.register_forward_hook(self._keep("q")),
            m.register_forward_hook(self._on_exit, with_kwargs=True),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _keep(self, key: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self._pending[key] = output

        return hook

    def _on_enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._pending = {}
        bound: Mapping[str, Any]
        try:
            bound = self._signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        pos = bound.get("position_embeddings")
        if pos is None:
            raise SnapmlaError(
                f"{self.attention.name}: the attention gets no position_embeddings "
                "(remote-code modeling files are not supported)"
            )
        self._pending["pos"] = pos

    def _on_exit(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        att = self.attention
        got = self._pending
        self._pending = {}
        missing = [k for k in ("pos", "kv_a", "c_kv", "q") if k not in got]
        if missing:
            raise SnapmlaError(f"{att.name}: capture hooks did not fire for {', '.join(missing)}")
        c_kv: torch.Tensor = got["c_kv"]  # type: ignore[assignment]
        raw: torch.Tensor = got["kv_a"]  # type: ignore[assignment]
        if raw.dim() != 3 or raw.shape[0] != 1:
            raise SnapmlaError(
                f"{att.name}: expected kv_a_proj output [1, tokens, 576], got {tuple(raw.shape)}"
            )
        s = raw.shape[1]
        k_pe = raw[..., D_CONTENT : D_CONTENT + D_ROPE].reshape(1, 1, s, D_ROPE)
        rows = self.state.query_rows
        if rows is None:
            _, k_rot = att.rotate(k_pe, k_pe, got["pos"])
        else:
            q: torch.Tensor = got["q"]  # type: ignore[assignment]
            nope = att.qk_nope_head_dim
            q = q.reshape(1, s, att.num_heads, nope + D_ROPE).transpose(1, 2)
            q_nope, q_pe = torch.split(q, [nope, D_ROPE], dim=-1)
            q_pe, k_rot = att.rotate(q_pe, k_pe, got["pos"])
            self._record_queries(q_nope[0, :, rows], q_pe[0, :, rows])
            if self.keep_outputs:
                out = output[0] if isinstance(output, tuple | list) else output
                self.outputs.append(out[0, rows].detach().to("cpu"))
        content = c_kv.reshape(s, D_CONTENT)
        if att.kv_scale != 1.0:
            content = content * att.kv_scale
        kv = torch.cat([content, k_rot.reshape(s, D_ROPE).to(content.dtype)], dim=-1)
        self.kv.append(kv.detach().to("cpu", self.dtype))

    def _record_queries(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> None:
        """``q_nope`` ``[h, n, nope]``, rotated ``q_pe`` ``[h, n, 64]`` -> absorbed ``[n, h, 576]``
        scaled by ``q_scale * query_prescale`` (see :attr:`MlaAttention.query_prescale`)."""
        att = self.attention
        w_uk, _ = att.absorbed_weights()
        content = torch.einsum("hnd,hdc->nhc", q_nope.float(), w_uk.to(q_nope.device))
        rope = q_pe.float().transpose(0, 1)
        q = torch.cat([content, rope], dim=-1) * (att.q_scale * att.query_prescale)
        self.queries.append(q.detach().to("cpu", self.dtype))
