"""TMA tensor maps of the paged caches for the Hopper (wgmma) decode kernels.

Why this module: the wgmma kernels load each 64-token page with the Tensor Memory Accelerator,
which needs a ``CUtensorMap`` built by the CUDA driver (``cuTensorMapEncodeTiled``). Neither
torch nor CuPy exposes that call, and cuda-bindings is not a dependency, so it is called through
``ctypes`` on ``libcuda`` (always present where a GPU is). The two 128-byte maps are copied once
to device memory and passed to the kernel as a pointer (a TMA may read its map from global
memory); they are cached per (device, cache address, cache size), so the decode hot path does a
dict lookup only. A map depends on the address and shape alone, so a cache tensor freed and
reallocated at the same address with the same size reuses a still-correct map.

The cache keeps the maps of the last MAX_CACHED_MAPS caches: more than an engine's layers (one
cache each, 61 in DeepSeek-V3, plus MTP layers and a second model), since a miss rebuilds the
maps with a blocking copy to the GPU. A CUDA graph holds the maps' device address, so maps used
while a graph is captured are pinned and never freed: an evicted buffer reused by the caching
allocator would make the replay's TMA read garbage as its map.

The FP8 cache is viewed as a 2-D byte tensor ``[num_blocks * 64 rows, 656 bytes]``:
  * map 0: boxes of 64 rows x 128 bytes with 128-byte swizzle (the four content tiles at
    columns 0, 128, 256, 384 and the RoPE tile at column 528), the layout wgmma reads;
  * map 1: boxes of 64 rows x 16 bytes, unswizzled (the float32 scale + pad at column 512).
The bf16 cache as ``[num_blocks * 64 rows, 1152 bytes]`` with one map: 64 rows x 128 bytes,
128-byte swizzle (nine 64-dim tiles per page).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache

import torch

from ..errors import NoGpuError, SnapmlaError
from ..numerics.formats import BF16_TOKEN_BYTES, FP8_TOKEN_BYTES, PAGE_SIZE
from ..ops.finite import capturing as _capturing
from . import pdl

TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
TENSOR_MAP_ALIGN = 64
TILE_BOX_BYTES = 128  # content / RoPE box width: one 128-byte swizzle span
SCALE_BOX_BYTES = 16  # scale + pad
MAX_CACHED_MAPS = 1024  # 256 B of device memory each (a 512 B block of the caching allocator)

# CUDA driver enums (cuda.h)
_DTYPE_UINT8 = 0
_INTERLEAVE_NONE = 0
_SWIZZLE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_NONE = 0

_maps: OrderedDict[tuple[int, int, int, int], torch.Tensor] = OrderedDict()
# maps a captured CUDA graph reads: kept for the life of the process (graphs outlive any cache)
_pinned: dict[tuple[int, int, int, int], torch.Tensor] = {}


class _TensorMap(ctypes.Structure):
    _fields_ = [("opaque", ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8))]


@lru_cache(maxsize=1)
def _encode_tiled() -> Callable[..., int]:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise NoGpuError("libcuda.so.1 not found: the TMA decode kernel needs the NVIDIA driver") from None
    fn = libcuda.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_TensorMap), ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def encode_byte_map(address: int, rows: int, row_bytes: int, box_bytes: int, box_rows: int,
                    swizzle_128b: bool) -> bytes:
    """One 2-D uint8 tensor map over ``rows x row_bytes`` at ``address`` (driver call)."""
    tmap = _TensorMap()
    dims = (ctypes.c_uint64 * 2)(row_bytes, rows)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_bytes, box_rows)
    elem_strides = (ctypes.c_uint32 * 2)(1, 1)
    status = _encode_tiled()(ctypes.byref(tmap), _DTYPE_UINT8, 2, ctypes.c_void_p(address), dims,
                             strides, box, elem_strides, _INTERLEAVE_NONE,
                             _SWIZZLE_128B if swizzle_128b else _SWIZZLE_NONE,
                             _L2_PROMOTION_256B, _OOB_FILL_NONE)
    if status != pdl.CUDA_SUCCESS:
        raise SnapmlaError(f"k_cache: cuTensorMapEncodeTiled failed with CUresult {status} "
                           f"({rows} rows x {row_bytes} B at 0x{address:x})")
    return bytes(tmap)


def _device_maps(cache: torch.Tensor, token_bytes: int, boxes: tuple[tuple[int, bool], ...],
                 what: str) -> torch.Tensor:
    """Device buffer holding one tensor map per ``(box_bytes, swizzle_128b)`` over the contiguous
    cache viewed as ``[pages * 64 rows, token_bytes]``; cached per device, address and size."""
    total_bytes = cache.numel() * cache.element_size()
    rows = total_bytes // token_bytes
    if rows % PAGE_SIZE or total_bytes % token_bytes:
        raise SnapmlaError(f"k_cache: {total_bytes} bytes is not whole 64-token pages of {token_bytes} B ({what})")
    address = cache.data_ptr()
    key = (cache.device.index or 0, address, rows, token_bytes)
    cached = _maps.get(key)
    if cached is not None:
        _maps.move_to_end(key)
    else:
        cached = _pinned.get(key)  # (evicted, still held by a graph: the same maps again)
    capturing = _capturing(cache)
    if cached is not None:
        if capturing:
            _pinned[key] = cached
        return cached
    if capturing:
        raise SnapmlaError("k_cache: its TMA tensor maps are built (and copied to the GPU) on first "
                           "use; run one decode call on this cache before CUDA graph capture")
    blob = b"".join(encode_byte_map(address, rows, token_bytes, box, PAGE_SIZE, swizzle) for box, swizzle in boxes)
    host = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    device_maps = host.to(cache.device)
    if device_maps.data_ptr() % TENSOR_MAP_ALIGN:
        raise SnapmlaError("tensor map buffer is not 64-byte aligned")
    _remember(key, device_maps)
    return device_maps


def _remember(key: tuple[int, int, int, int], device_maps: torch.Tensor) -> None:
    """Cache ``device_maps`` under ``key``, forgetting the least recently used beyond the limit.
    A forgotten buffer is freed only after its GPU has finished every queued kernel: one on
    another stream than the maps were made on may still read them, and the caching allocator
    would hand the memory to that stream's next allocation at once (never inside a capture:
    maps are not built there)."""
    _maps[key] = device_maps
    while len(_maps) > MAX_CACHED_MAPS:
        _, forgotten = _maps.popitem(last=False)
        if forgotten.is_cuda:
            torch.cuda.synchronize(forgotten.device)


def fp8_cache_tensor_maps(cache_rows: torch.Tensor) -> torch.Tensor:
    """Device buffer holding the two tensor maps of a contiguous uint8 FP8 cache
    (``[blocks, 64, 656]`` or ``[blocks, 64, 1, 656]``)."""
    return _device_maps(cache_rows, FP8_TOKEN_BYTES, ((TILE_BOX_BYTES, True), (SCALE_BOX_BYTES, False)), "FP8")


def bf16_cache_tensor_map(cache: torch.Tensor) -> torch.Tensor:
    """Device buffer holding the tensor map of a contiguous bf16 cache ``[blocks, 64, 1, 576]``."""
    return _device_maps(cache, BF16_TOKEN_BYTES, ((TILE_BOX_BYTES, True),), "bf16")
