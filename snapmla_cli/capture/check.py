"""``recompute_check``: the dumped cache and queries must reproduce the model's own attention.

For one layer, the absorbed queries attend over the dumped rows of the last prompt with
:func:`decode_reference` (float64, SPEC's default ``576**-0.5`` scale, ``causal=True`` with
``s_q`` = the number of queries, which are that prompt's last tokens). The latent output goes
through ``W_UV`` (read from ``kv_b_proj``) and the model's ``o_proj``, and is compared with the
attention module's output captured during the forward pass. Passing means the dumped ``c_kv``,
RoPE-rotated ``k_pe``, query absorption and the query pre-scale are all what the model computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.dump_file import LayerDump
from ..cache.layout import PagedLayout, pages_needed, scatter_to_pages
from ..errors import SnapmlaError
from ..numerics.decode_ref import decode_reference
from ..numerics.formats import D_QK, default_softmax_scale
from ..numerics.metrics import compare
from .mla import MlaAttention

# rel L2 gates of the check by model dtype, about 3-100x the error of a correct dump on the tests'
# tiny models (fp32 1.5e-7 to 4e-7: exact up to summation order; fp16 3e-4 to 5e-4 and bf16
# 2.1e-3 to 4.6e-3: the model rounds K_nope / V / P to 11 or 8 bits inside its own attention).
# The sixty-sixth session's audit shifted k_pe by one RoPE position: every row gave 1.9e-2 and
# more in bf16, which the former 3e-2 passed; the last decoded row alone 1.4e-4 in fp32, which
# the former 1e-3 passed. In bf16 a shift of the decoded rows alone (3e-3 to 5e-2) can sit
# within the model's own rounding: `--dtype fp32` is the strict check.
CHECK_TOLERANCE = {torch.float32: 3e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@dataclass(frozen=True)
class CheckResult:
    layer: int
    queries: int
    tokens: int
    rel_l2: float
    max_abs: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_l2 <= self.tolerance


def last_segment_start(layer: LayerDump) -> int:
    """Row where the layer's last prompt starts (positions restart at 0 per prompt)."""
    if layer.positions is None:
        return 0
    zeros = (layer.positions == 0).nonzero()
    return int(zeros[-1]) if zeros.numel() else 0


def recompute_check(
    layer: LayerDump,
    attention: MlaAttention,
    expected: torch.Tensor,
    tolerance: float | None = None,
) -> CheckResult:
    """Recompute ``layer``'s attention output for its queries from the dump and compare it with
    ``expected`` ``[n, hidden]`` (the model's attention output for the same tokens)."""
    if layer.queries is None:
        raise SnapmlaError(f"layer {layer.index}: the check needs dumped queries (--queries >= 1)")
    q = layer.queries
    s_q, heads = q.shape[0], q.shape[1]
    if heads != attention.num_heads or tuple(expected.shape[:1]) != (s_q,):
        raise SnapmlaError(
            f"layer {layer.index}: queries {tuple(q.shape)} do not fit {attention.num_heads} heads "
            f"and {tuple(expected.shape)} expected outputs"
        )
    kv = layer.kv[last_segment_start(layer) :].to(torch.float64)
    n = kv.shape[0]
    pages = pages_needed(n)
    layout = PagedLayout(
        torch.arange(pages, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32), pages
    )
    cache = scatter_to_pages([kv], layout, torch.zeros(D_QK, dtype=torch.float64))
    latent, _ = decode_reference(
        q[None].to(torch.float64),
        cache,
        layout.block_table,
        layout.cache_seqlens,
        default_softmax_scale(),
        causal=True,
    )
    _, w_uv = attention.absorbed_weights()
    values = torch.einsum("shc,hvc->shv", latent[0], w_uv.to("cpu", torch.float64))
    o_proj = attention.module.o_proj
    ref = next(o_proj.parameters())
    with torch.no_grad():
        out = o_proj(values.reshape(s_q, -1).to(ref.device, ref.dtype))
    metrics = compare(out, expected)
    if tolerance is None:
        tolerance = CHECK_TOLERANCE.get(expected.dtype, 3e-2)
    return CheckResult(layer.index, s_q, n, metrics.rel_l2, metrics.max_abs, tolerance)
