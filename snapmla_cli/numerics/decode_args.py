"""Argument checks shared by the CPU decode definitions (the float64 reference and the FP8
emulation) and the GPU decode API's scale.

The reference and the emulation are what every kernel is judged against, and `verify` runs them
on user dumps, so a bad argument must fail there with the argument's name rather than as an
``IndexError`` deep in a gather, and non-finite inputs must fail rather than be read as "no key
visible" (the emulation's block maxima would turn a NaN logit into an inactive block).
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import NamedTuple

import torch

from ..errors import SnapmlaError, dtype_name, show
from .finiteness import all_finite
from .formats import PAD_OFFSET, PAGE_SIZE, ROPE_OFFSET, default_softmax_scale

LOG2E = 1.4426950408889634
"""log2(e): the kernels take the logit scale times this as one float32 (exponentials in base 2)."""


def first_overflowing_row(sees_keys: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> int | None:
    """The first row of a request that sees a key yet ends with a non-finite ``lse`` or ``out``
    (rows ``[s_q * h_q]``; ``out`` ``[rows, 512]``), else None. Finite queries and keys can give
    logits beyond the computing dtype's range; the reference and the emulation refuse such a
    request instead of returning NaN or a row read as "no visible key"."""
    bad = sees_keys & ~(torch.isfinite(lse) & torch.isfinite(out).all(dim=-1))
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def checked_softmax_scale(softmax_scale: object) -> float:
    """The logit scale: SPEC section 2's default for None, else a finite number (a NaN or infinite
    scale would make every output NaN, which a caller should hear about as the argument it passed)
    that is not negative: the 64-row wgmma layouts take a block's largest ``s x s_k`` before the
    scale, the running maximum only for a scale >= 0; with a negative one, logits more than about
    89 apart overflowed the exponentials to NaN (a scale < 0 is no attention anyone runs)."""
    if softmax_scale is None:
        return default_softmax_scale()
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise SnapmlaError(f"softmax_scale: expected a number or None, got {type(softmax_scale).__name__}")
    try:
        scale = float(softmax_scale)
    except OverflowError:  # (an int or Fraction beyond the float range)
        raise SnapmlaError(f"softmax_scale: expected a finite number, got one beyond the float range "
                           f"({str(softmax_scale)[:20]}...)") from None
    if not math.isfinite(scale):
        raise SnapmlaError(f"softmax_scale: expected a finite number, got {scale}")
    if scale < 0:
        raise SnapmlaError(f"softmax_scale: expected a number >= 0 (the logits' scale, "
                           f"{default_softmax_scale():.6g} by default), got {scale}")
    if not _fits_float32(scale * LOG2E):
        raise SnapmlaError(f"softmax_scale: expected at most {_FLOAT32_MAX / LOG2E:.7g} (the kernels take "
                           f"scale x log2(e) as a float32), got {scale:.6g}")
    return scale


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _fits_float32(value: float) -> bool:
    """Whether ``value`` stays finite once rounded to float32 (``struct`` rounds as the GPU's
    conversion does and refuses what rounds to infinity). A finite scale beyond that became an
    infinite exponent scale in the kernels: every output NaN, while the CPU definitions, in
    float64, returned finite values for the same call."""
    try:
        struct.pack("<f", value)
    except OverflowError:
        return False
    return True


def is_integer(value: object) -> bool:
    """An integer count (Python or NumPy int; not a bool, not a float, and not a tensor: a
    tensor's comparisons are elementwise, a 0-d float or bool tensor has ``__index__`` too, and a
    CUDA one would be read back to the host; nor a NumPy array, whose ``__index__`` exists too and
    whose comparisons raised "the truth value of an array ... is ambiguous")."""
    return (not isinstance(value, (bool, torch.Tensor)) and hasattr(value, "__index__")
            and getattr(value, "ndim", 0) == 0)


def checked_flag(name: str, value: object) -> bool:
    """A switch given as a real bool: ``causal="false"`` is truthy, so a string would silently mean
    the opposite of what it says."""
    if not isinstance(value, bool):
        raise SnapmlaError(f"{name}: expected True or False, got {show(value)}")
    return value


def paged_cache(name: str, cache: object, width: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """``cache`` as ``[num_blocks, 64, width]``; SPEC's ``[num_blocks, 64, 1, width]`` is taken too."""
    if not isinstance(cache, torch.Tensor):
        raise SnapmlaError(f"{name}: expected a tensor, got {type(cache).__name__}")
    require_readable(name, cache)
    if cache.dim() == 4 and cache.shape[2] == 1:
        cache = cache.squeeze(2)
    if cache.dim() != 3 or cache.shape[1] != PAGE_SIZE or cache.shape[2] != width:
        raise SnapmlaError(f"{name}: expected shape [num_blocks, {PAGE_SIZE}, {width}] "
                           f"(or [num_blocks, {PAGE_SIZE}, 1, {width}]), got {tuple(cache.shape)}")
    if cache.dtype not in dtypes:
        names = " or ".join(dtype_name(d) for d in dtypes)
        raise SnapmlaError(f"{name}: expected dtype {names}, got {dtype_name(cache.dtype)}")
    return cache


# unsigned integer types wider than a byte: torch has no CPU comparison or gather for them
_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def checked_lengths(block_table: object, cache_seqlens: object, batch: int, num_blocks: int) -> list[int]:
    """The requests' key counts, after checking that ``block_table`` ``[batch, max_pages]`` and
    ``cache_seqlens`` ``[batch]`` are integer tensors that agree with the queries' batch, that no
    length is negative or longer than its table row covers, and that every page a request reads
    is a block of the cache."""
    for name, t, rank in (("block_table", block_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        if not isinstance(t, torch.Tensor):
            raise SnapmlaError(f"{name}: expected a tensor, got {type(t).__name__}")
        require_readable(name, t)
        if t.dim() != rank or t.shape[0] != batch:
            want = "[batch, max_pages]" if rank == 2 else "[batch]"
            raise SnapmlaError(f"{name}: expected shape {want} with batch {batch}, got {tuple(t.shape)}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise SnapmlaError(f"{name}: expected an integer tensor, got {dtype_name(t.dtype)}")
    assert isinstance(block_table, torch.Tensor) and isinstance(cache_seqlens, torch.Tensor)
    if block_table.dtype in _WIDE_UNSIGNED:  # (torch's CPU comparisons and gathers lack them)
        raise SnapmlaError(f"block_table: expected a signed integer tensor (int32, as FlashMLA's), "
                           f"got {dtype_name(block_table.dtype)}")
    lengths = [int(n) for n in cache_seqlens.tolist()]
    capacity = block_table.shape[1] * PAGE_SIZE
    table = block_table.cpu()
    for i, n in enumerate(lengths):
        if not 0 <= n <= capacity:
            raise SnapmlaError(f"cache_seqlens[{i}]: expected 0..{capacity} (the block table's "
                               f"{block_table.shape[1]} pages of {PAGE_SIZE}), got {n}")
        pages = table[i, : -(-n // PAGE_SIZE)]
        bad = ((pages < 0) | (pages >= num_blocks)).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            # (a cache of no blocks has no index to expect: "0..-1" read as a typo)
            want = f"a block index in 0..{num_blocks - 1}" if num_blocks else "no page (the cache has 0 blocks)"
            raise SnapmlaError(f"block_table[{i}, {j}]: expected {want} (the request's {n} tokens read it), "
                               f"got {int(pages[j])}")
    return lengths


class PagedDecodeArgs(NamedTuple):
    """The checked arguments both CPU decode definitions share."""

    cache: torch.Tensor  # [num_blocks, 64, width]
    softmax_scale: float
    causal: bool
    seqlens: list[int]


def checked_paged_decode(cache_name: str, cache: object, width: int, dtypes: tuple[torch.dtype, ...],
                         block_table: object, cache_seqlens: object, batch: int,
                         softmax_scale: object, causal: object) -> PagedDecodeArgs:
    """The cache, scale, switch and lengths of a paged decode, checked in one place so that the
    reference and the emulation refuse the same inputs with the same words."""
    cache = paged_cache(cache_name, cache, width, dtypes)
    return PagedDecodeArgs(cache, checked_softmax_scale(softmax_scale), checked_flag("causal", causal),
                           checked_lengths(block_table, cache_seqlens, batch, cache.shape[0]))


def require_readable(name: str, t: torch.Tensor) -> None:
    """A tensor whose values the CPU definitions and the scheduler can read: on the CPU or a CUDA
    GPU (a 'meta' tensor has no data), and a plain strided one (not nested)."""
    if t.device.type not in ("cpu", "cuda"):
        raise SnapmlaError(f"{name}: expected a CPU or CUDA tensor, got device {t.device}")
    require_strided(name, t)


def require_strided(name: str, t: torch.Tensor) -> None:
    """A plain strided tensor: a nested one has no single shape, a sparse one no dense storage to
    index (torch raises a RuntimeError at its first ``data_ptr``)."""
    if t.is_nested:
        raise SnapmlaError(f"{name}: expected a regular (strided) tensor, got a nested tensor")
    if t.layout is not torch.strided:
        raise SnapmlaError(f"{name}: expected a regular (strided) tensor, got layout "
                           f"{dtype_name(t.layout)}")


def require_finite(message: str, *parts: torch.Tensor) -> None:
    """Raise ``message`` when any of ``parts`` holds NaN or inf (E4M3 NaN bytes included). Only
    float8 parts are widened (:func:`all_finite`): a float64 one widened to float32 would call
    values above 3.4e38 inf, refusing inputs the float64 reference can compute."""
    for part in parts:
        if not all_finite(part):
            raise SnapmlaError(message)


def check_finite_keys(name: str, request: int, *parts: torch.Tensor) -> None:
    """The keys a request reads must be finite: NaN or inf there is a corrupt cache, not data."""
    require_finite(f"{name}: request {request} reads non-finite values in its keys", *parts)


def check_key_pads(name: str, request: int, tokens: torch.Tensor) -> None:
    """The FP8 tokens a request reads (``[n, 656]`` bytes) must have zero pad bytes (SPEC section
    3): a cache of the same size in another encoding (DeepSeek-V3.2's ``fp8_ds_mla``, whose bytes
    516..527 hold three more scales and whose RoPE is not pre-scaled) would otherwise decode to
    plausible numbers."""
    bad = tokens[:, PAD_OFFSET:ROPE_OFFSET].ne(0).any(dim=1)
    if bool(bad.any()):
        token = int(bad.nonzero()[0, 0])
        raise SnapmlaError(f"{name}: request {request} reads token {token} with nonzero pad bytes "
                           f"{PAD_OFFSET}..{ROPE_OFFSET - 1}: not a SnapMLA cache (write it with append_kv; "
                           "a DeepSeek-V3.2 fp8_ds_mla cache has the same size and another encoding)")


def check_key_scales(name: str, request: int, scales: torch.Tensor) -> None:
    """The FP8 token scales a request reads must be positive (SPEC section 3: at least 2^-32): a
    zero or negative scale is a corrupt cache, which would otherwise decode to plausible numbers."""
    if scales.numel() and not bool((scales > 0).all()):
        token = int((scales <= 0).nonzero()[0, 0])
        raise SnapmlaError(f"{name}: request {request} reads token {token} with scale {float(scales[token])} "
                           f"(expected positive scales, at least 2^-32, SPEC section 3)")
