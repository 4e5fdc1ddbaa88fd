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

from ..errors import SnapmlaError, dtype_name
from ..numerics.formats import (
    D_QK,
    FP8_TOKEN_BYTES,
    KV_SCALE_FLOOR,
    PAD_OFFSET,
    PAGE_SIZE,
    ROPE_OFFSET,
)
from ..numerics.quant import as_e4m3
from .atomic import check_writable, write_atomic
from .dump_file import (
    FP8_CACHE_FORMAT,
    REQUIRED_METADATA,
    _check_format,
    _read_metadata,
    check_float_dtype,
    check_layer_indices,
    check_values,
    file_metadata,
    load_layers,
)
from .layout import pages_needed, quantize_tokens, unpack_tokens

_KEY = re.compile(r"layers\.(\d+)\.(cache|seqlen)")  # matched whole: layer_keys uses fullmatch
_E4M3_NAN_BITS = 0x7F  # S.1111.111: the only NaN encodings of float8_e4m3fn (0x7F, 0xFF)


def quantize_layer_cache(kv: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """``kv`` ``[n, 576]`` -> the layer's paged FP8 cache, uint8 ``[ceil(n/64), 64, 656]`` on the
    CPU, tokens in order, the tail of the last page zero.

    The single seam between the reference quantizer and the GPU kernel: on a CUDA ``device``
    the K-append kernel (``snapmla_cli.ops.prep.append_kv``, bytes identical to the reference by
    SPEC section 3) writes the pages; otherwise ``cache.layout.quantize_tokens`` does. The kernel
    reads bf16 only, so fp16 / fp32 dumps are quantized by the reference from their own values
    (rounding them to bf16 first would change the bytes).

    ``kv`` is checked as :func:`~.dump_file.read_dump` checks it (a dump's dtypes, finite values
    within ``MAX_ABS_VALUE``) because the CUDA path does not check, and a NaN row would give a
    NaN cache on one device and an error on the other; a CUDA ``device`` without a GPU is a
    :class:`~snapmla_cli.errors.NoGpuError`."""
    from ..ops.decode import requested_device  # lazy, like append_kv: ops pulls in the kernels

    if kv.dim() != 2 or kv.shape[1] != D_QK or kv.shape[0] == 0:
        raise SnapmlaError(f"quantize: expected kv [tokens >= 1, {D_QK}], got {tuple(kv.shape)}")
    check_float_dtype("quantize", "kv", kv)
    check_values("quantize", "kv", kv)
    target = requested_device(device)
    n = kv.shape[0]
    num_blocks = pages_needed(n)
    if target.type == "cuda" and kv.dtype == torch.bfloat16:
        from ..ops.prep import append_kv

        shape = (num_blocks, PAGE_SIZE, FP8_TOKEN_BYTES)
        cache = torch.zeros(shape, dtype=torch.uint8, device=target)
        slots = torch.arange(n, dtype=torch.int32, device=target)
        append_kv(kv.to(target).contiguous(), slots, cache)
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
        return file_metadata(FP8_CACHE_FORMAT, self.model, self.extra_metadata)


def _validate(path: Path, layer: FP8CacheLayer) -> None:
    where = f"{path}: layer {layer.index}"
    cache = layer.cache
    if cache.dtype != torch.uint8 or cache.dim() != 3 or tuple(cache.shape[1:]) != (PAGE_SIZE, FP8_TOKEN_BYTES):
        raise SnapmlaError(
            f"{where}: cache is {dtype_name(cache.dtype)} {tuple(cache.shape)}, expected uint8 "
            f"[num_blocks, {PAGE_SIZE}, {FP8_TOKEN_BYTES}]"
        )
    if not 0 < layer.seqlen <= cache.shape[0] * PAGE_SIZE or pages_needed(layer.seqlen) != cache.shape[0]:
        raise SnapmlaError(f"{where}: seqlen {layer.seqlen} does not fit {cache.shape[0]} pages")
    _check_tokens(where, cache.reshape(-1, FP8_TOKEN_BYTES), layer.seqlen)


def _check_tokens(where: str, tokens: torch.Tensor, seqlen: int) -> None:
    """The used tokens ``[:seqlen]`` must decode to finite values with a scale the quantizer can
    produce (finite, >= 2^-32) and zero pad bytes (SPEC section 3), and the tail of the last page
    must be zero (SPEC section 8): a NaN byte would poison every decode over the layer, non-zero
    pad bytes mean a writer that is not SPEC's (another layout, or a corrupted row), and a
    non-zero tail means ``seqlen`` is not where the quantizer stopped.

    "Decode to finite values" is checked on the dequantized token (SPEC section 3: content
    ``s * c_q`` and RoPE ``s * r'``, both multiplied by the scale, in float32 as the kernel's
    accumulator): a finite but huge scale (e.g. 3e38) times E4M3 content up to 448 or a finite
    bf16 RoPE value is inf."""
    used = unpack_tokens(tokens[:seqlen])
    content_nan = (used.content.view(torch.uint8) & _E4M3_NAN_BITS) == _E4M3_NAN_BITS
    scale_ok = torch.isfinite(used.scale) & (used.scale >= KV_SCALE_FLOOR)
    # the largest |value| of each part times s: float32 rounding is monotone, so the product is
    # finite exactly when every dequantized value of the part is (and no [n, 576] copy is made)
    content_max = as_e4m3(used.content).float().abs().amax(dim=1)
    rope_max = used.rope.float().abs().amax(dim=1)
    checks = (
        (content_nan.any(dim=1), "content holds an E4M3 NaN byte"),
        (~scale_ok, f"scale is not a finite value >= {KV_SCALE_FLOOR:g}"),
        (tokens[:seqlen, PAD_OFFSET:ROPE_OFFSET].ne(0).any(dim=1),
         f"pad bytes {PAD_OFFSET}..{ROPE_OFFSET - 1} are not zero"),
        (~torch.isfinite(used.rope).all(dim=1), "RoPE holds NaN/inf"),
        (~torch.isfinite(content_max * used.scale),
         "content * scale is not finite in float32 (the scale is too large for the content)"),
        (~torch.isfinite(rope_max * used.scale),
         "RoPE * scale is not finite in float32 (the scale is too large for the RoPE values)"),
    )
    for bad, what in checks:
        if bool(bad.any()):
            raise SnapmlaError(f"{where}: token {int(bad.nonzero()[0])} of seqlen {seqlen}: {what}")
    tail = tokens[seqlen:].ne(0).any(dim=1)
    if bool(tail.any()):
        raise SnapmlaError(
            f"{where}: token {seqlen + int(tail.nonzero()[0])} is past seqlen {seqlen} but not "
            "zero (the tail of the last page must be zero)"
        )


def _read_seqlen(path: Path, index: int, seqlen: torch.Tensor) -> int:
    """``layers.{i}.seqlen`` is one integer element (int64 as written; any integer dtype read):
    an empty tensor, a float (99.7 would be truncated) or several values (only one would be
    used) is refused rather than guessed at. The range is checked by :func:`_validate`; the value
    is read through ``tolist`` because ``int()`` of a uint64 above 2^63 - 1 raises torch's
    int64 overflow instead of giving the (out of range) number."""
    name = f"{path}: layer {index}: layers.{index}.seqlen"
    if seqlen.dtype.is_floating_point or seqlen.dtype.is_complex or seqlen.dtype == torch.bool:
        raise SnapmlaError(f"{name} has dtype {dtype_name(seqlen.dtype)}, expected an integer (int64)")
    if seqlen.numel() != 1:
        raise SnapmlaError(
            f"{name} has shape {tuple(seqlen.shape)}, expected one integer (the token count)"
        )
    return int(seqlen.reshape(-1).tolist()[0])


def write_fp8_cache(cache_file: FP8CacheFile, path: Path, force: bool = False) -> None:
    """Write atomically; refuses to overwrite ``path`` without ``force``, also when the file
    appeared while the cache was being made."""
    path = Path(path)
    check_writable(path, force)
    check_layer_indices(path, "an FP8 cache file", [layer.index for layer in cache_file.layers])
    tensors: dict[str, torch.Tensor] = {}
    for layer in cache_file.layers:
        _validate(path, layer)
        tensors[f"layers.{layer.index}.cache"] = layer.cache.contiguous()
        tensors[f"layers.{layer.index}.seqlen"] = torch.tensor(layer.seqlen, dtype=torch.int64)
    meta = cache_file.metadata()
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), replace=force)


def read_fp8_cache(path: Path) -> FP8CacheFile:
    """Load and validate a quantized-cache file; every problem is a one-line :class:`SnapmlaError`."""
    path = Path(path)
    meta = _read_metadata(path, "FP8 cache", "an FP8 cache file (.safetensors)")
    _check_format(path, meta, FP8_CACHE_FORMAT)
    by_layer = load_layers(path, _KEY, "an FP8 cache file")
    layers = []
    for index in sorted(by_layer):
        parts = by_layer[index]
        if set(parts) != {"cache", "seqlen"}:
            raise SnapmlaError(f"{path}: layer {index} needs both 'cache' and 'seqlen' tensors")
        layer = FP8CacheLayer(index, parts["cache"], _read_seqlen(path, index, parts["seqlen"]))
        _validate(path, layer)
        layers.append(layer)
    extra = {k: v for k, v in meta.items() if k not in REQUIRED_METADATA}
    return FP8CacheFile(layers=layers, model=meta["model"], extra_metadata=extra)
