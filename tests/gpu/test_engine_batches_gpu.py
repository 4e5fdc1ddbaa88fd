"""Gap (audit of the GPU suite): an engine's batch sizes, and the split rows' workspace.

1. No decode test has more than 10 requests (COLUMN_LENS), yet b 64 is the regime the kernels
   are tuned and benchmarked for. There the default configurations run one thread-block cluster
   per request (64 clusters of 2 at h16-h64 on 2k-16k tokens: 128 CTAs, the whole GPU in one
   wave), the combine works 4 rows per CTA (``combine_rows_per_cta``: b x s_q x h_q > 1024), and
   request indices, partial slots and arrival counters reach the batch's far end. The 4-row
   combine has run only at 128 rows (a multiple of 4): a row count like 13 or 21 leaves its last
   CTA 1 row (``n_rows = min(4, rows - row0)``), which no test reaches, for any kernel.
2. The split rows (``partial_out`` / ``partial_lse``, DecodePlan.run's ``torch.empty``) are
   NaN-poisoned only on flash_mla_with_kvcache's fused FP8 path. Every other call gets whatever
   the caching allocator hands back, often the block a previous identical call freed, holding
   that call's right partials: a kernel that stopped writing some partial rows (the second row
   tile's, a column item's slot) would still pass the suite's repeat-bitwise checks. Here the
   workspace (and out / lse when the call allocates them) are filled with NaN bytes before each
   launch, for every kernel kind, under the fold, the cluster and the combine.

Fresh random data, NaN-poisoned cache rows, checked against the emulation of the split bounds
(FP8) or float64 (BF16), empty requests exactly 0 / +inf.
"""

from __future__ import annotations

import random

import pytest
import torch
from sibling_modules import load

from snapmla_cli.numerics.problem import random_problem

pytestmark = pytest.mark.gpu

G = load("test_coverage_gaps")  # _operands, _decode, _nan_outputs, _check_against_reference, _sms


def _mixed_lengths(b: int, seed: int) -> list[int]:
    """b requests of 1-3000 tokens, every eleventh empty, a long one (many splits: beyond the
    fold's limit, so the combine merges it) and the page edges."""
    rng = random.Random(seed)
    lens = [0 if i % 11 == 0 else rng.randint(1, 3000) for i in range(b)]
    lens[5], lens[7], lens[8], lens[9], lens[10] = 20_000, 64, 65, 63, 1
    return lens


EQUAL = [2048] * 64
MIXED = _mixed_lengths(96, seed=5)
# (fp8, kernel version: None = the default path, lengths, s_q, h_q, cluster size the default plans
# on a 132-SM GPU with no database entry: 0 = none)
BATCH_CASES = [
    (True, None, EQUAL, 1, 16, 2),    # alternate pages, 16-row tiles: 64 clusters of 2 (1024 rows)
    (True, None, EQUAL, 2, 32, 2),    # rows = M, 64-row tiles, 4096 rows: the 4-row combine (copy)
    (False, None, EQUAL, 1, 64, 2),   # the BF16 wgmma kernel's clusters
    (True, None, MIXED, 1, 13, 0),    # balanced columns; 4-row combine over 13 rows
    (False, None, MIXED, 1, 13, 0),
    (True, 2, MIXED[:64], 3, 7, 0),   # mma.sync: the combine merges everything, 21 rows
    (False, 2, MIXED[:64], 3, 7, 0),
]
BATCH_IDS = ["fp8-h16-b64-equal", "fp8-h32-s2-b64-equal", "bf16-h64-b64-equal", "fp8-h13-b96-mixed",
             "bf16-h13-b96-mixed", "fp8-mma-sync-h7-s3-b64-mixed", "bf16-mma-sync-h7-s3-b64-mixed"]


@pytest.mark.parametrize("fp8,version,lens,s_q,h_q,cluster", BATCH_CASES, ids=BATCH_IDS)
def test_engine_sized_batches_match_reference_merged_every_way(fp8, version, lens, s_q, h_q, cluster, monkeypatch):
    from snapmla_cli.ops.decode import get_mla_metadata, metadata_plan
    from snapmla_cli.ops.decode_config import heuristic_config
    from snapmla_cli.tuning import lookup

    device = torch.device("cuda")
    sms = G._sms(device)
    monkeypatch.setattr(lookup, "lookup_decode_config", lambda **kw: None)  # the heuristic runs
    rows = s_q * h_q
    prob = random_problem(lens, s_q, h_q, causal=s_q > 1, seed=len(lens) + rows)
    q, cache = G._operands(prob, fp8, device)
    table = prob.layout.block_table.to(device)
    lens_t = prob.layout.cache_seqlens.to(device)
    requested = None if version is None else heuristic_config(rows, fp8, version).with_sms(sms)
    meta, splits = get_mla_metadata(lens_t, rows, 1, fp8=fp8, config=requested)
    plan = metadata_plan(meta)
    assert plan is not None
    if sms == 132 and version is None:
        assert plan.fold is not None and plan.fold.cluster == cluster
    decode = G._decode(fp8)

    def call(work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = G._nan_outputs(len(lens), s_q, h_q, device)
        decode(q, cache, table, lens_t, work, splits, prob.softmax_scale, prob.causal, config=plan.config,
               out=out, lse=lse)
        return out, lse

    planned = call(meta)          # the cluster / the fold, the combine for what they leave
    again = call(meta)
    combined = call(meta.clone())  # a copy: the combine merges every split request
    torch.cuda.synchronize()
    assert planned[0].isfinite().all()
    G._check_against_reference(prob, fp8, *planned, cache, meta, splits, device)
    for other in (again, combined):
        assert torch.equal(planned[0], other[0]) and torch.equal(planned[1], other[1])


class _PoisonedEmpty:
    """decode_launch's ``torch`` with ``empty`` returning CUDA memory filled with 0xFF bytes (NaN
    in float32 and bf16): the split rows' workspace, and out / lse when the call allocates them."""

    def __init__(self, real) -> None:
        self._real = real
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def empty(self, *args, **kwargs):
        t = self._real.empty(*args, **kwargs)
        if t.is_cuda and t.numel():
            t.view(-1).view(self._real.uint8).fill_(0xFF)
            self.calls += 1
        return t


POISON_KINDS = [(True, 3), (True, 2), (False, 3), (False, 2)]
POISON_IDS = ["fp8-wgmma", "fp8-mma-sync", "bf16-wgmma", "bf16-mma-sync"]


@pytest.mark.parametrize("fp8,version", POISON_KINDS, ids=POISON_IDS)
@pytest.mark.parametrize("merge", ["planned", "combine", "cluster"])
def test_split_rows_workspace_poisoned_with_nan_never_reaches_the_output(fp8, version, merge, monkeypatch):
    from dataclasses import replace

    from snapmla_cli.ops import decode_launch
    from snapmla_cli.ops.decode import get_mla_metadata, metadata_plan
    from snapmla_cli.ops.decode_config import heuristic_config

    device = torch.device("cuda")
    if merge == "cluster" and version != 3:
        pytest.skip("the mma.sync kernels have no cluster merge")
    s_q, h_q = 2, 20  # 40 rows: a partial 64-row tile, two full 16-row ones and a partial third
    lens = [513, 0, 4097, 9000, 700, 2500, 1000, 4600] if merge == "cluster" else [0, 1, 63, 65, 4097, 9000, 300, 2500]
    prob = random_problem(lens, s_q, h_q, causal=True, seed=version + 10 * fp8 + len(merge))
    cfg = heuristic_config(s_q * h_q, fp8, version).with_sms(G._sms(device))
    if merge == "cluster":  # every request with keys cut into exactly 2 splits
        cfg = replace(cfg, split=replace(cfg.split, auto_balance=False, balanced=False, min_blocks_per_split=1,
                                         max_splits_per_request=2)).with_sms(400)
    q, cache = G._operands(prob, fp8, device)
    table = prob.layout.block_table.to(device)
    lens_t = prob.layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(lens_t, s_q * h_q, 1, fp8=fp8, config=cfg)
    assert int((splits[1:] - splits[:-1]).max()) > 1  # split requests: the workspace is used
    settled = metadata_plan(meta).config
    if merge == "cluster":
        assert metadata_plan(meta).fold.cluster == 2
    work = meta.clone() if merge == "combine" else meta
    poisoned = _PoisonedEmpty(torch)
    monkeypatch.setattr(decode_launch, "torch", poisoned)
    decode_launch.clear_plans()
    results = []
    for give_outputs in (True, False, False):  # caller buffers; the call's own (poisoned); its replay
        out, lse = G._nan_outputs(len(lens), s_q, h_q, device) if give_outputs else (None, None)
        results.append(G._decode(fp8)(q, cache, table, lens_t, work, splits, prob.softmax_scale, True,
                                      config=settled, out=out, lse=lse))
    torch.cuda.synchronize()
    monkeypatch.undo()
    assert poisoned.calls >= 3  # every call's workspace came through the poisoned allocation
    out, lse = results[0]
    assert out.isfinite().all()
    G._check_against_reference(prob, fp8, out, lse, cache, work, splits, device)
    for other in results[1:]:
        assert torch.equal(out, other[0]) and torch.equal(lse, other[1])
