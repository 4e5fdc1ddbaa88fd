"""The quantized-cache file written by ``snapmla quantize`` (SPEC section 8), and the one function
that turns a layer's tokens into its paged FP8 cache.

Per layer ``i``: ``layers.{i}.cache`` uint8 ``[num_blocks, 64, 656]`` holding the layer's tokens
in order (token ``j`` in page ``j // 64``, row ``j % 64``; the tail of the last page zero) and
``layers.{i}.seqlen`` (int64 scalar). Metadata as in a KV dump, with ``format =
"snapmla-fp8-cache"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import SnapmlaError
from ..numerics.formats import D_CONTENT, D_QK, D_ROPE, FP8_TOKEN_BYTES, PAGE_SIZE
from .atomic import check_writable, write_atomic
from .dump_file import FORMAT_VERSION, FP8_CACHE_FORMAT, _check_format, _read_metadata, load_layers
from .layout import pages_needed, quantize_tokens

_KEY = re.compile(r"^layers\.(\d+)\.(cache|seqlen)$")


def quantize_layer_cache(kv: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """``kv`` ``[n, 576]`` -> the layer's paged FP8 cache, uint8 ``[ceil(n/64), 64, 656]`` on the
    CPU, tokens in order, the tail of the last page zero.

    The single seam between the reference quantizer and the GPU kernel: on a CUDA ``device``
    the K-append kernel (``snapmla_cli.ops.prep.append_kv``, bytes identical to the reference by
    SPEC section 3) writes the pages; otherwise ``cache.layout.quantize_tokens`` does. The kernel
    reads bf16 only, so fp16 / fp32 dumps are quantized by the reference from their own values
    (rounding them to bf16 first would change the bytes)."""
    if kv.dim() != 2 or kv.shape[1] != D_QK:
        raise SnapmlaError(f"quantize: expected kv [tokens, {D_QK}], got {tuple(kv.shape)}")
    n = kv.shape[0]
    num_blocks = pages_needed(n)
    if torch.device(device).type == "cuda" and kv.dtype == torch.bfloat16:
        from ..ops.prep import append_kv

        cache = torch.zeros(num_blocks, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8, device=device)
        slots = torch.arange(n, dtype=torch.int32, device=device)
        append_kv(kv.to(device).contiguous(), slots, cache)
        return cache.cpu()
    flat = torch.zeros(num_blocks * PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    flat[:n] = quantize_tokens(kv)
    return flat.view(num_blocks, PAGE_SIZE, FP8_TOKEN_BYTES)


@dataclass
class FP8CacheLayer:
    index: int
    cache: torch.Tensor  # uint8 [num_blocks, 64, 656]
    seqlen: int


@dataclass
class FP8CacheFile:
    layers: list[FP8CacheLayer]
    model: str = "unknown"
    extra_metadata: dict[str, str] = field(default_factory=dict)

    def metadata(self) -> dict[str, str]:
        meta = dict(self.extra_metadata)
        meta.update(format=FP8_CACHE_FORMAT, version=FORMAT_VERSION, kv_lora_rank=str(D_CONTENT),
                    rope_dim=str(D_ROPE), model=self.model)
        return meta


def _validate(path: Path, layer: FP8CacheLayer) -> None:
    where = f"{path}: layer {layer.index}"
    cache = layer.cache
    if cache.dtype != torch.uint8 or cache.dim() != 3 or tuple(cache.shape[1:]) != (PAGE_SIZE, FP8_TOKEN_BYTES):
        raise SnapmlaError(
            f"{where}: cache is {cache.dtype} {tuple(cache.shape)}, expected uint8 "
            f"[num_blocks, {PAGE_SIZE}, {FP8_TOKEN_BYTES}]"
        )
    if not 0 < layer.seqlen <= cache.shape[0] * PAGE_SIZE or pages_needed(layer.seqlen) != cache.shape[0]:
        raise SnapmlaError(f"{where}: seqlen {layer.seqlen} does not fit {cache.shape[0]} pages")


def write_fp8_cache(cache_file: FP8CacheFile, path: Path, force: bool = False) -> None:
    """Write atomically; refuses to overwrite ``path`` without ``force``."""
    path = Path(path)
    check_writable(path, force)
    tensors: dict[str, torch.Tensor] = {}
    for layer in cache_file.layers:
        _validate(path, layer)
        tensors[f"layers.{layer.index}.cache"] = layer.cache.contiguous()
        tensors[f"layers.{layer.index}.seqlen"] = torch.tensor(layer.seqlen, dtype=torch.int64)
    meta = cache_file.metadata()
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_fp8_cache(path: Path) -> FP8CacheFile:
    """Load and validate a quantized-cache file; every problem is a one-line :class:`SnapmlaError`."""
    path = Path(path)
    meta = _read_metadata(path)
    _check_format(path, meta, FP8_CACHE_FORMAT)
    by_layer = load_layers(path, _KEY, "an FP8 cache file")
    layers = []
    for index in sorted(by_layer):
        parts = by_layer[index]
        if set(parts) != {"cache", "seqlen"}:
            raise SnapmlaError(f"{path}: layer {index} needs both 'cache' and 'seqlen' tensors")
        layer = FP8CacheLayer(index, parts["cache"], int(parts["seqlen"].reshape(-1)[0]))
        _validate(path, layer)
        layers.append(layer)
    keep = {"format", "version", "kv_lora_rank", "rope_dim", "model"}
    extra = {k: v for k, v in meta.items() if k not in keep}
    return FP8CacheFile(layers=layers, model=meta.get("model", "unknown"), extra_metadata=extra)
