"""A once-per-cache check that a cache passed with FlashMLA's ``is_fp8_kvcache=True`` holds
SnapMLA's FP8 encoding.

Why: FlashMLA's FP8 cache for DeepSeek-V3.2 (``fp8_ds_mla``) has the same 656 bytes per token as
SnapMLA's, with four float32 scales at bytes 512..527 and a RoPE that is not pre-scaled. An
engine moving from FlashMLA that passes ``is_fp8_kvcache=True`` most likely holds that layout,
and the kernels would decode it to plausible numbers. SnapMLA's pad bytes 516..527 are zero
(SPEC section 3) and a V3.2 token's three extra scales are not, so the first token of each
request's first page tells the two apart. The check reads those tokens back (a synchronization),
so it runs once per cache (address and shape), never inside a CUDA graph capture; the full check
of every token read is the checks switch's (``SNAPMLA_CHECK_FINITE=1``).
"""

from __future__ import annotations

import torch

from ..numerics.decode_args import check_key_pads
from ..numerics.formats import FP8_CACHE_DTYPES, FP8_TOKEN_BYTES, PAD_OFFSET, PAGE_SIZE, ROPE_OFFSET
from .finite import capturing

MAX_CHECKED_CACHES = 4096  # forgotten all at once beyond this (a re-check costs one small read)

_checked: set[tuple[object, ...]] = set()


def _checkable(k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> bool:
    """Whether the arguments have the shapes the check reads (else the decode's own checks name
    what is wrong)."""
    return (k_cache.dim() > 0 and k_cache.is_cuda and k_cache.dtype in FP8_CACHE_DTYPES
            and k_cache.is_contiguous()
            and k_cache.numel() % (PAGE_SIZE * FP8_TOKEN_BYTES) == 0 and k_cache.shape[-1] == FP8_TOKEN_BYTES
            and block_table.dim() == 2 and block_table.shape[1] > 0 and block_table.device == k_cache.device
            and not block_table.is_floating_point() and cache_seqlens.dim() == 1
            and cache_seqlens.shape[0] == block_table.shape[0] and cache_seqlens.device == k_cache.device)


def check_snapmla_encoding_once(k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
    """Refuse (one line, naming the request) a cache whose requests' first tokens have nonzero
    pad bytes; once per cache."""
    key = (k_cache.device, k_cache.data_ptr(), tuple(k_cache.shape))
    if key in _checked:  # (first: a replayed decode call pays only this lookup)
        return
    if not _checkable(k_cache, block_table, cache_seqlens) or capturing(k_cache):
        return
    pages = k_cache.view(torch.uint8).view(-1, PAGE_SIZE, FP8_TOKEN_BYTES)
    first_page = block_table[:, 0].long()
    readable = (cache_seqlens > 0) & (first_page >= 0) & (first_page < pages.shape[0])
    requests = readable.nonzero().flatten()
    first_tokens = pages[first_page[requests], 0]  # [requests read, 656]
    nonzero_pads = first_tokens[:, PAD_OFFSET:ROPE_OFFSET].ne(0).any(dim=1)
    written, padded = torch.stack((first_tokens.ne(0).any(), nonzero_pads.any())).tolist()  # one read
    if padded:
        j = int(nonzero_pads.nonzero()[0, 0])
        check_key_pads("k_cache", int(requests[j]), first_tokens[j : j + 1])
    if not written:  # nothing written to judge by: an engine's warm-up (all lengths 0) or a
        return  # zeroed cache; a later call checks it (once marked, never)
    if len(_checked) >= MAX_CHECKED_CACHES:
        _checked.clear()
    _checked.add(key)
