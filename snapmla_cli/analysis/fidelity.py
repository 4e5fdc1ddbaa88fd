"""Layer-wise numerical fidelity of the KV quantization configurations (paper Appendix G, Fig. 5).

For each layer and configuration: the attention output of probe queries over the layer's tokens
on the fake-quantized cache, against the same attention on the original cache (both float64
``decode_reference``, queries unquantized, so only the KV quantization is measured), plus the
error of the dequantized KV itself (all 576 dims, content only, RoPE only; over at most
``KV_METRIC_TOKENS`` evenly spaced tokens of the layer, which keeps a 32k-token layer fast and
changes the KV numbers only in the third digit).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..cache.dump_file import LayerDump
from ..cache.synth import probe_queries
from ..errors import SnapmlaError
from ..numerics.configs import QuantConfig
from ..numerics.decode_ref import attend_all_tokens
from ..numerics.formats import D_CONTENT, default_softmax_scale
from ..numerics.metrics import ErrorMetrics, compare

PROBE_QUERIES = 4  # probe queries per layer when the dump has none
PROBE_HEADS = 16  # their heads
KV_METRIC_TOKENS = 8192  # KV metrics use at most this many evenly spaced tokens per layer
PARTS = ("output", "kv", "kv_content", "kv_rope")
METRICS = ("rmse", "cos_diff", "rel_l2")


@dataclass
class LayerFidelity:
    layer: int
    tokens: int
    query_rows: int  # queries x heads
    probes: str  # "dump": the dump's own queries; "synthetic": probe_queries()
    metrics: dict[str, dict[str, ErrorMetrics]]  # part -> config id -> metrics

    def as_dict(self) -> dict:
        return {
            "layer": self.layer,
            "tokens": self.tokens,
            "query_rows": self.query_rows,
            "probes": self.probes,
            **{part: {c: m.as_dict() for c, m in by_cfg.items()} for part, by_cfg in self.metrics.items()},
        }


@dataclass
class FidelityReport:
    configs: list[str]
    layers: list[LayerFidelity]

    def mean(self, part: str, config: str, metric: str) -> float:
        """Mean over layers of one metric."""
        values = [getattr(layer.metrics[part][config], metric) for layer in self.layers]
        return sum(values) / len(values)

    def as_dict(self) -> dict:
        return {
            "configs": self.configs,
            "mean": {
                part: {c: {m: self.mean(part, c, m) for m in METRICS} for c in self.configs}
                for part in PARTS
            },
            "layers": [layer.as_dict() for layer in self.layers],
        }


def check_query_count(layers: Iterable[LayerDump], count: int | None) -> None:
    """Refuse a ``--queries`` beyond what a layer of the dump holds (not silently fewer): checked
    on every layer before any is analysed, since a short layer late in a 61-layer dump was found
    only after minutes of work on the ones before it."""
    if count is None:
        return
    for layer in layers:
        if layer.queries is not None and count > layer.queries.shape[0]:
            raise SnapmlaError(f"--queries {count}: layer {layer.index} of the dump holds "
                               f"{layer.queries.shape[0]} queries")


def layer_queries(layer: LayerDump, count: int | None, seed: int = 0) -> tuple[torch.Tensor, str]:
    """The probe queries ``[n, h_q, 576]`` of a layer: the dump's own (the first ``count`` if
    given), else ``count or PROBE_QUERIES`` synthetic ones of ``PROBE_HEADS`` heads."""
    if layer.queries is not None:
        check_query_count((layer,), count)
        q = layer.queries if count is None else layer.queries[:count]
        return q, "dump"
    n = PROBE_QUERIES if count is None else count
    return probe_queries(layer.kv, n, PROBE_HEADS, seed * 7919 + layer.index), "synthetic"


def attention_over_tokens(q: torch.Tensor, kv: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """float64 attention output ``[n, h_q, 512]`` of queries ``[n, h_q, 576]`` over all tokens of
    ``kv`` ``[tokens, 576]`` (non-causal): :func:`decode_reference`'s arithmetic on one request."""
    return attend_all_tokens(q, kv, softmax_scale)


def analyze_layer(
    layer: LayerDump,
    configs: list[QuantConfig],
    queries: torch.Tensor,
    probes: str = "dump",
    device: str | torch.device = "cpu",
    softmax_scale: float | None = None,
) -> LayerFidelity:
    """Fidelity of every configuration on one layer (module docstring)."""
    scale = default_softmax_scale() if softmax_scale is None else softmax_scale
    kv = layer.kv.to(device)
    q = queries.to(device)
    reference = attention_over_tokens(q, kv, scale)
    metrics: dict[str, dict[str, ErrorMetrics]] = {part: {} for part in PARTS}
    sample = torch.linspace(0, kv.shape[0] - 1, min(kv.shape[0], KV_METRIC_TOKENS), device=kv.device).round().long()
    original = kv[sample].float()
    for config in configs:
        full = config.fake_quant(kv)
        metrics["output"][config.id] = compare(attention_over_tokens(q, full, scale), reference)
        fake = full[sample]
        metrics["kv"][config.id] = compare(fake, original)
        metrics["kv_content"][config.id] = compare(fake[:, :D_CONTENT], original[:, :D_CONTENT])
        metrics["kv_rope"][config.id] = compare(fake[:, D_CONTENT:], original[:, D_CONTENT:])
    return LayerFidelity(layer.index, kv.shape[0], q.shape[0] * q.shape[1], probes, metrics)
