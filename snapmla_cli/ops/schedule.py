"""Split-KV scheduling (``get_mla_metadata``): which CTA column processes which KV blocks.

FlashMLA's contract is kept: ``get_mla_metadata(cache_seqlens, s_q * h_q, 1)`` returns
``(tile_scheduler_metadata, num_splits)`` with ``num_splits`` int32 ``[b + 1]`` cumulative split
counts. snapmla's metadata is a plain work list, int32 ``[num_work, 4]`` = (request, first block,
end block, partial slot or -1), computed on the host from the sequence lengths: one small copy
per decode step (shared by every layer), and the decode kernel then needs no scheduling logic.
Requests are cut into splits of nearly equal block counts so that the CTA count fills the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SnapmlaError
from ..numerics.formats import PAGE_SIZE

WORK_FIELDS = 4  # request, block_begin, block_end, partial slot


@dataclass(frozen=True)
class SplitPolicy:
    """How finely to split the KV sequence. ``ctas_per_sm`` is how many CTAs the decode kernel
    keeps resident per SM; ``waves`` how many rounds of those the split count aims at;
    ``min_blocks_per_split`` stops splitting short sequences (each split costs a combine)."""

    num_sms: int = 132
    ctas_per_sm: int = 1
    waves: int = 1
    min_blocks_per_split: int = 4
    max_splits_per_request: int = 64


def rows_per_cta_tiles(rows: int, block_m: int) -> int:
    return (rows + block_m - 1) // block_m


def plan_splits(seqlens: list[int], rows: int, block_m: int, policy: SplitPolicy) -> list[list[int]]:
    """Block boundaries per request, e.g. ``[[0, 12, 24], [0, 3], []]`` (empty: no keys).

    The CTA count (splits x row tiles) should fill whole waves: a grid of 1.45 waves leaves
    most SMs idle for the last 45%. Each request gets ``floor(blocks / chunk)`` splits (at least
    one), with ``chunk`` the block count that gives ``num_sms * ctas_per_sm * waves`` CTAs.
    """
    blocks = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in seqlens]
    total = sum(blocks)
    if total == 0:
        return [[] for _ in seqlens]
    m_tiles = rows_per_cta_tiles(rows, block_m)
    target_ctas = policy.num_sms * policy.ctas_per_sm * policy.waves
    target_pieces = max(1, target_ctas // m_tiles)
    chunk = max(policy.min_blocks_per_split, -(-total // target_pieces))
    plans: list[list[int]] = []
    for nb in blocks:
        if nb == 0:
            plans.append([])
            continue
        parts = min(max(1, nb // chunk), policy.max_splits_per_request, nb)
        plans.append([round(i * nb / parts) for i in range(parts + 1)])
    return plans


def host_seqlens(cache_seqlens: torch.Tensor) -> list[int]:
    """``cache_seqlens`` checked (int32 ``[b]``, lengths >= 0) and read to the host. This is the
    one device-to-host copy of a decode step's scheduling: ``get_mla_metadata`` reads it once and
    uses the list both for the configuration choice (the context) and for the work list."""
    if cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        raise SnapmlaError(
            f"cache_seqlens: expected int32 [b], got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    seqlens = cache_seqlens.tolist()
    if any(n < 0 for n in seqlens):
        raise SnapmlaError("cache_seqlens: lengths must be >= 0")
    return seqlens


def build_metadata(
    cache_seqlens: torch.Tensor, rows: int, block_m: int, policy: SplitPolicy,
    seqlens: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Work list int32 ``[num_work, 4]`` and cumulative ``num_splits`` int32 ``[b + 1]``, both on
    the device of ``cache_seqlens``. Partial slot of split ``s`` of request ``i`` is
    ``num_splits[i] + s``; a request with one split writes its output directly (slot -1).
    ``seqlens``: ``host_seqlens(cache_seqlens)`` when the caller has read it already (no second
    device-to-host copy); read here otherwise."""
    if seqlens is None:
        seqlens = host_seqlens(cache_seqlens)
    plans = plan_splits(seqlens, rows, block_m, policy)
    work: list[tuple[int, int, int, int]] = []
    cumulative = [0]
    for req, bounds in enumerate(plans):
        count = max(len(bounds) - 1, 0)
        for s in range(count):
            slot = cumulative[-1] + s if count > 1 else -1
            work.append((req, bounds[s], bounds[s + 1], slot))
        cumulative.append(cumulative[-1] + count)
    device = cache_seqlens.device
    work_t = torch.tensor(work, dtype=torch.int32).reshape(-1, WORK_FIELDS)
    return work_t.to(device), torch.tensor(cumulative, dtype=torch.int32).to(device)


def split_token_bounds(num_splits: torch.Tensor, metadata: torch.Tensor, seqlens: list[int]) -> list[list[int]]:
    """Token boundaries of each request's splits (for the emulation of a split-KV run)."""
    work = metadata.cpu().tolist()
    bounds: list[list[int]] = [[] for _ in seqlens]
    for req, begin, end, _slot in work:
        if not bounds[req]:
            bounds[req].append(begin * PAGE_SIZE)
        bounds[req].append(min(end * PAGE_SIZE, seqlens[req]))
    return [b if b else [0, 0] for b in bounds]
