"""Gap (audit of the GPU suite): the cluster merge (ops/cluster_fold.py, decode_common.cuh
cluster_fold) of every layout the tuner can store, not just the heuristics'.

Where every split request has the same 2, 4 or 8 splits (the tuner's equal-length timing batches,
and an engine's b 64 step: 64 clusters of 2 at h16-h64, 2k-16k tokens), a cluster-capable
wgmma build is swapped for its CLUSTER_FOLD build. tests/gpu/test_split_fold_gpu.py runs that
build for 4 FP8 layouts (alternate pages at 16 rows / 4 stages, the 32-row RoPE ring at 5 stages,
rows = M at 64 rows / 4 stages) and the BF16 kernel (clusters of 2 and 4); of the 28 CLUSTER_FOLD
builds the tuner compiles and times (tuning/space.kernel_keys) 24 are never run by a test: every dims
split (WG_MODE 0: both warpgroups store lse rows, from qk_row0 of their own half, into the
cluster's shared rows), every RoPE ring at 16 rows, the 2-CTA-per-SM builds, stages 2, 3 and 5,
and clusters of 8 over 64-row tiles. The split rows go into the stages' shared memory after the
page loop; a layout whose pipeline or exchange buffers overlap them, or whose epilogue stores a
row at another offset, gives wrong output only here. The tuner's gate plans no cluster for most
candidates (its check lengths 0/1/64/777/1500 give mixed split counts: 68 of 2836 candidate x
problem plans on 132 SMs reach one), while its timing then runs the cluster build.

Each case: the same step merged by the cluster, by the fold (SNAPMLA_CLUSTER_FOLD=0) and by the
combine (a copy of the work list), the same bits, matching the emulation of the split bounds,
NaN-poisoned outputs and cache rows, an empty request among them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from sibling_modules import load

pytestmark = pytest.mark.gpu

G = load("test_coverage_gaps")  # _check_against_reference
S = load("test_split_fold_gpu")  # _Step, _plan_cluster, CLUSTER_LENS


def _cluster_cases() -> list[tuple[bool, object, int, int, int, str]]:
    """(fp8, kernel, s_q, h_q, n, id): every cluster-capable kernel variant of the search space,
    with clusters of 2 and 4 over two row tiles (the second partial) and of 8 over one partial
    tile (checked on the host to plan that cluster size with CLUSTER_LENS on 400 SMs)."""
    from snapmla_cli.ops.decode_config import cluster_capable
    from snapmla_cli.tuning.space import config_id, kernel_variants

    cases = []
    for fmt in ("fp8", "bf16"):
        fp8 = fmt == "fp8"
        for kernel in kernel_variants(128, fmt)[0]:
            if not cluster_capable(kernel, fp8):
                continue
            name = f"{fmt}-{config_id(kernel, fmt).split('/')[0]}"
            for n, s_q, h_q in ((2, 2, kernel.block_m // 2 + 3), (4, 2, kernel.block_m // 2 + 3),
                                (8, 1, kernel.block_m - 3)):
                cases.append((fp8, kernel, s_q, h_q, n, f"{name}-n{n}-rows{s_q * h_q}"))
    return cases


CASES = _cluster_cases()


@pytest.mark.parametrize("fp8,kernel,s_q,h_q,n", [c[:5] for c in CASES], ids=[c[5] for c in CASES])
def test_every_cluster_build_of_the_tuner_gives_the_fold_and_combine_bits(fp8, kernel, s_q, h_q, n, monkeypatch):
    from snapmla_cli.ops.schedule import SplitPolicy

    device = torch.device("cuda")
    policy = SplitPolicy(ctas_per_sm=kernel.min_ctas_per_sm, min_blocks_per_split=1, max_splits_per_request=n)
    cfg = replace(kernel, split=policy).with_sms(S.FINE_SMS)
    step = S._Step(fp8, cfg, s_q, h_q, seed=7 * n + h_q + kernel.stages, lens=S.CLUSTER_LENS)
    out, lse = S.cluster_merge_matches_fold_and_combine(step, n, monkeypatch)
    G._check_against_reference(step.prob, fp8, out, lse, step.cache, step.meta, step.splits, device)
