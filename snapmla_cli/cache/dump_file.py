"""KV dump files (SPEC section 8): read with validation, write atomically.

A dump holds, per layer, the cached latent ``kv`` ``[tokens, 576]`` (content first, RoPE last),
optional ``positions`` and optional absorbed decode ``queries`` ``[n, h_q, 576]``. Reading checks
everything a later stage relies on, so that a bad file fails here with one line naming the
layer and the problem rather than deep inside a decode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from ..errors import SnapmlaError
from ..numerics.formats import D_CONTENT, D_QK, D_ROPE
from .atomic import check_writable, write_atomic

DUMP_FORMAT = "snapmla-kv-dump"
FP8_CACHE_FORMAT = "snapmla-fp8-cache"
FORMAT_VERSION = "1"
_ACCEPTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KEY = re.compile(r"^layers\.(\d+)\.(kv|positions|queries)$")


@dataclass
class LayerDump:
    """One layer of a dump. ``kv`` keeps the file's dtype; ``queries`` may be None."""

    index: int
    kv: torch.Tensor
    positions: torch.Tensor | None = None
    queries: torch.Tensor | None = None


@dataclass
class KVDump:
    layers: list[LayerDump]
    model: str = "unknown"
    extra_metadata: dict[str, str] = field(default_factory=dict)

    def metadata(self) -> dict[str, str]:
        meta = dict(self.extra_metadata)
        meta.update(
            format=DUMP_FORMAT,
            version=FORMAT_VERSION,
            kv_lora_rank=str(D_CONTENT),
            rope_dim=str(D_ROPE),
            model=self.model,
        )
        return meta


def _read_metadata(path: Path) -> dict[str, str]:
    if path.is_dir():
        raise SnapmlaError(f"dump {path}: is a folder, expected a KV dump file (.safetensors)")
    if not path.is_file():
        raise SnapmlaError(f"dump {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise SnapmlaError(f"dump {path}: not a safetensors file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _check_format(path: Path, meta: dict[str, str], expected: str) -> None:
    if meta.get("format") != expected:
        raise SnapmlaError(
            f"{path}: not a {expected} file (metadata format={meta.get('format')!r})"
        )
    for key, want in (("kv_lora_rank", str(D_CONTENT)), ("rope_dim", str(D_ROPE))):
        if key in meta and meta[key] != want:
            raise SnapmlaError(f"{path}: {key}={meta[key]} but snapmla supports {want}")


def load_layers(path: Path, key_pattern: re.Pattern[str], what: str) -> dict[int, dict[str, torch.Tensor]]:
    """The file's tensors grouped by layer index, ``layers.{i}.{part}`` -> ``{i: {part: t}}``;
    an unexpected key or a file without layers is a one-line error naming ``what`` it should be."""
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path)).items():
        match = key_pattern.match(key)
        if match is None:
            raise SnapmlaError(f"{path}: unexpected tensor {key!r} in {what}")
        by_layer.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    if not by_layer:
        raise SnapmlaError(f"{path}: {what} holds no layers")
    return by_layer


def _validate_layer(path: Path, layer: LayerDump) -> None:
    where = f"{path}: layer {layer.index}"
    kv = layer.kv
    if kv.dim() != 2 or kv.shape[1] != D_QK:
        raise SnapmlaError(f"{where}: kv has shape {tuple(kv.shape)}, expected [tokens, {D_QK}]")
    if kv.dtype not in _ACCEPTED_DTYPES:
        raise SnapmlaError(f"{where}: kv dtype {kv.dtype}, expected bf16, fp16 or fp32")
    if kv.shape[0] == 0:
        raise SnapmlaError(f"{where}: kv is empty (0 tokens)")
    if not bool(torch.isfinite(kv).all()):
        bad = int((~torch.isfinite(kv)).any(dim=1).nonzero()[0])
        raise SnapmlaError(f"{where}: kv holds NaN/inf (first at token {bad})")
    if layer.positions is not None and tuple(layer.positions.shape) != (kv.shape[0],):
        raise SnapmlaError(
            f"{where}: positions has shape {tuple(layer.positions.shape)}, expected [{kv.shape[0]}]"
        )
    q = layer.queries
    if q is not None:
        if q.dim() != 3 or q.shape[2] != D_QK or q.shape[0] == 0:
            raise SnapmlaError(f"{where}: queries has shape {tuple(q.shape)}, expected [n, h_q, {D_QK}]")
        if not bool(torch.isfinite(q).all()):
            raise SnapmlaError(f"{where}: queries hold NaN/inf")


def read_dump(path: Path) -> KVDump:
    """Load and validate a KV dump; every problem is a one-line :class:`SnapmlaError`."""
    path = Path(path)
    meta = _read_metadata(path)
    _check_format(path, meta, DUMP_FORMAT)
    by_layer = load_layers(path, _KEY, "a KV dump")
    layers = []
    for index in sorted(by_layer):
        parts = by_layer[index]
        if "kv" not in parts:
            raise SnapmlaError(f"{path}: layer {index} has no 'layers.{index}.kv' tensor")
        layer = LayerDump(index, parts["kv"], parts.get("positions"), parts.get("queries"))
        _validate_layer(path, layer)
        layers.append(layer)
    extra = {k: v for k, v in meta.items() if k not in {"format", "version", "kv_lora_rank", "rope_dim", "model"}}
    return KVDump(layers=layers, model=meta.get("model", "unknown"), extra_metadata=extra)


def write_dump(dump: KVDump, path: Path, force: bool = False) -> None:
    """Write ``dump`` atomically as SPEC section 8 describes."""
    path = Path(path)
    check_writable(path, force)
    tensors: dict[str, torch.Tensor] = {}
    for layer in dump.layers:
        _validate_layer(path, layer)
        tensors[f"layers.{layer.index}.kv"] = layer.kv.contiguous()
        if layer.positions is not None:
            tensors[f"layers.{layer.index}.positions"] = layer.positions.to(torch.int64).contiguous()
        if layer.queries is not None:
            tensors[f"layers.{layer.index}.queries"] = layer.queries.contiguous()
    meta = dump.metadata()
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
