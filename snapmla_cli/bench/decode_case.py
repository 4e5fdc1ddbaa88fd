"""One decode case on the GPU for the kernel benchmarks (``scripts/bench_*.py``): a random paged
cache in both formats, the queries, and decode calls on them with their split metadata built
once, as an engine builds it once per step.

A call object keeps the case alive: a CUDA graph captured from it reads the case's tensors
without holding them, so the case must outlive every replay (a freed cache whose memory is
reused turns the graph's TMA descriptors into garbage: the replay fails with
cudaErrorInvalidAddressSpace)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..cache.layout import random_paged_layout
from ..numerics.formats import D_QK, FP8_TOKEN_BYTES, PAGE_SIZE
from ..numerics.quant import QuantizedRows
from ..ops import decode as decode_ops
from ..ops.decode import decode_bf16, decode_fp8, get_mla_metadata
from ..ops.decode_config import DecodeConfig
from ..ops.decode_launch import clear_plans
from ..ops.prep import append_kv, quantize_q

Q_STD = 0.5  # query values ~ N(0, 0.25): logits of the order real models give


@dataclass
class DecodeCall:
    """One decode call of a case (FP8 or BF16, a configuration or the default path)."""

    run: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # (out, lse)
    work_items: int  # columns of the split-KV work list (CTA rows of the grid)
    case: DecodeCase

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run()


@dataclass
class DecodeCase:
    s_q: int
    h_q: int
    seqlens: list[int]
    table: torch.Tensor
    lens: torch.Tensor
    q: torch.Tensor  # bf16 [b, s_q, h_q, 576]
    q8: QuantizedRows
    cache8: torch.Tensor  # uint8 [blocks, 64, 656]
    cache16: torch.Tensor  # bf16 [blocks, 64, 1, 576]

    @classmethod
    def build(cls, seqlens: list[int], s_q: int, h_q: int, device: torch.device, seed: int = 0) -> DecodeCase:
        """Random pages (a seeded permutation of the pool), random latents quantized into the
        FP8 cache by the fused append kernel, the same latents as the BF16 cache."""
        layout = random_paged_layout(seqlens, generator=torch.Generator().manual_seed(seed), spare_blocks=0)
        q = (torch.randn(len(seqlens), s_q, h_q, D_QK, device=device) * Q_STD).to(torch.bfloat16)
        kv = torch.randn(layout.num_blocks * PAGE_SIZE, D_QK, device=device).to(torch.bfloat16)
        cache8 = torch.empty(layout.num_blocks, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8, device=device)
        append_kv(kv, torch.arange(kv.shape[0], device=device, dtype=torch.int32), cache8)
        return cls(s_q, h_q, list(seqlens), layout.block_table.to(device), layout.cache_seqlens.to(device),
                   q, quantize_q(q), cache8, kv.view(layout.num_blocks, PAGE_SIZE, 1, D_QK))

    @property
    def rows(self) -> int:
        return self.s_q * self.h_q

    def fp8(self, config: DecodeConfig | None = None) -> DecodeCall:
        """The FP8 decode (config None: the tuning database's or the heuristic's choice)."""
        meta, splits = get_mla_metadata(self.lens, self.rows, 1, fp8=True, config=config, s_q=self.s_q)
        return DecodeCall(lambda: decode_fp8(self.q8, self.cache8, self.table, self.lens, meta, splits, None,
                                             True, config=config), meta.shape[0], self)

    def bf16(self, config: DecodeConfig | None = None) -> DecodeCall:
        meta, splits = get_mla_metadata(self.lens, self.rows, 1, fp8=False, config=config, s_q=self.s_q)
        return DecodeCall(lambda: decode_bf16(self.q, self.cache16, self.table, self.lens, meta, splits, None,
                                              True, config=config), meta.shape[0], self)


@contextmanager
def extra_defines(defines: dict[str, int], bf16: bool = False) -> Iterator[None]:
    """FP8 kernels (``bf16``: the BF16 kernels instead) compiled inside this block get
    ``defines`` on top of their configuration's: a kernel switch that is not a DecodeConfig field
    (an A/B such as ``PV_PAIRS=0`` or ``HANDOVER_FIRST=0``, or the ``TRACE_PHASES`` diagnostic
    build). The kernel cache keys on the defines, so the other builds stay as they are."""
    name = "bf16_defines" if bf16 else "fp8_defines"
    plain = getattr(decode_ops, name)
    setattr(decode_ops, name, lambda cfg: {**plain(cfg), **defines})
    clear_plans()  # the decode calls' prepared launches hold the kernels built without them
    try:
        yield
    finally:
        setattr(decode_ops, name, plain)
        clear_plans()
