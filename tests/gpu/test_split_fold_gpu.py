"""GPU checks of the split merge folded into the wgmma decode kernels (ops/split_fold.py).

The fold must give the separate combine's bits: the same decode on the same work list, once as
``get_mla_metadata`` returned it (its plan carries the arrival counters: the kernel merges) and
once as a copy (no plan: the combine merges). Outputs are NaN-poisoned, lengths mix empty
requests, partial pages and long ones cut into many splits; the counters must be back at zero
after every call, also when the step is replayed from a CUDA graph. Where every split request
has the same 2, 4 or 8 splits the wgmma kernels run them as thread-block clusters that merge
through each other's shared memory (ops/cluster_fold.py): the same bits again.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from snapmla_cli.numerics.problem import random_problem
from snapmla_cli.numerics.quant import quantize_rows

pytestmark = pytest.mark.gpu

LENS = [0, 1, 63, 65, 4097, 9000, 300, 2500]
FINE_SMS = 400  # many splits per request (up to 64 at 16 rows)


def _fp8_config(rows: int, device: torch.device, **kernel):
    from snapmla_cli.ops.decode_config import fp8_config_valid, variant_config

    cfg = variant_config(rows, 3, **kernel)
    assert fp8_config_valid(cfg)
    cfg = replace(cfg, split=replace(cfg.split, ctas_per_sm=cfg.min_ctas_per_sm, min_blocks_per_split=1))
    return cfg.with_sms(FINE_SMS)


def _bf16_config(rows: int):
    from snapmla_cli.ops.decode_config import heuristic_config

    cfg = heuristic_config(rows, False, 3)
    return replace(cfg, split=replace(cfg.split, min_blocks_per_split=1)).with_sms(FINE_SMS)


def _columns(cfg):
    from snapmla_cli.ops.decode_config import balanced

    return balanced(cfg).with_sms(11)


class _Step:
    """One decode step of a random problem in one format and configuration."""

    def __init__(self, fp8: bool, cfg, s_q: int, h_q: int, seed: int, lens: list[int] = LENS):
        from snapmla_cli.ops.decode import get_mla_metadata

        self.device = torch.device("cuda")
        self.fp8, self.cfg, self.lens_host = fp8, cfg, lens
        self.prob = random_problem(lens, s_q, h_q, causal=True, seed=seed)
        self.table = self.prob.layout.block_table.to(self.device)
        self.lens = self.prob.layout.cache_seqlens.to(self.device)
        if fp8:
            self.q, self.cache = quantize_rows(self.prob.q.to(self.device)), self.prob.fp8_cache().to(self.device)
        else:
            self.q, self.cache = self.prob.q.to(self.device), self.prob.bf16_cache().to(self.device)
        self.meta, self.splits = get_mla_metadata(self.lens, s_q * h_q, 1, fp8=fp8, config=cfg)

    def run(self, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from snapmla_cli.ops.decode import decode_bf16, decode_fp8

        b, s_q, h_q = len(self.lens_host), self.prob.q.shape[1], self.prob.q.shape[2]
        out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=self.device)
        lse = torch.full((b, h_q, s_q), float("nan"), dtype=torch.float32, device=self.device)
        decode = decode_fp8 if self.fp8 else decode_bf16
        return decode(self.q, self.cache, self.table, self.lens, meta, self.splits, self.prob.softmax_scale,
                      True, config=self.cfg, out=out, lse=lse)

    def arrivals(self) -> torch.Tensor:
        from snapmla_cli.ops.decode import metadata_plan

        plan = metadata_plan(self.meta)
        assert plan is not None and plan.fold is not None and plan.fold.arrivals is not None
        return plan.fold.arrivals


STEPS = [  # (fp8, config maker, s_q, h_q)
    (True, lambda d: _fp8_config(16, d, wg_mode=0, row_groups=1), 1, 16),
    (True, lambda d: _fp8_config(16, d, wg_mode=3, row_groups=1, stages=5), 1, 16),
    (True, lambda d: _fp8_config(32, d, wg_mode=3, row_groups=2), 2, 16),
    (True, lambda d: _fp8_config(20, d, wg_mode=3, row_groups=2), 1, 20),
    (True, lambda d: _fp8_config(64, d, wg_mode=4, row_groups=4), 1, 64),
    (True, lambda d: _fp8_config(128, d, wg_mode=4, row_groups=4), 2, 64),
    (True, lambda d: _columns(_fp8_config(32, d, wg_mode=3, row_groups=2)), 1, 32),
    (True, lambda d: _columns(_fp8_config(64, d, wg_mode=4, row_groups=4)), 2, 32),
    (False, lambda d: _bf16_config(64), 1, 64),
    (False, lambda d: _bf16_config(48), 3, 16),
    (False, lambda d: _columns(_bf16_config(128)), 1, 128),
]
IDS = ["fp8-dims16", "fp8-alt16-st5", "fp8-alt32", "fp8-alt20", "fp8-rows-m64", "fp8-rows-m128", "fp8-alt32-columns",
       "fp8-rows-m64-columns", "bf16-64", "bf16-48", "bf16-128-columns"]


@pytest.mark.parametrize("fp8,make,s_q,h_q", STEPS, ids=IDS)
def test_fold_gives_the_combine_bits_and_resets_its_counters(fp8, make, s_q, h_q):
    step = _Step(fp8, make(torch.device("cuda")), s_q, h_q, seed=h_q * 3 + s_q)
    counts = (step.splits[1:] - step.splits[:-1]).tolist()
    assert max(counts) >= 4 and 0 in counts  # many splits, and an empty request
    folded = step.run(step.meta)
    again = step.run(step.meta)
    combined = step.run(step.meta.clone())  # a copy: no plan, the combine merges
    torch.cuda.synchronize()
    assert folded[0].isfinite().all() and folded[1][~torch.isinf(folded[1])].isfinite().all()
    for other in (again, combined):
        assert torch.equal(folded[0], other[0]) and torch.equal(folded[1], other[1])
    assert int(step.arrivals().abs().sum()) == 0
    empty = [i for i, n in enumerate(LENS) if n == 0]
    assert torch.all(folded[0][empty] == 0) and torch.all(folded[1][empty] == float("inf"))


def test_fold_replays_from_a_cuda_graph():
    """A captured step keeps its counters' address: every replay merges and leaves them at zero
    (a capture declared to replay the contents it saw, as the benchmarks' are)."""
    from snapmla_cli.ops.config_choice import captures_replay_fixed_contents
    from snapmla_cli.ops.decode_launch import stored_plans

    device = torch.device("cuda")
    step = _Step(True, _fp8_config(32, device, wg_mode=3, row_groups=2), 1, 32, seed=5)
    reference = step.run(step.meta.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), captures_replay_fixed_contents():
        out, lse = step.run(step.meta)
    (plan,) = [p for p in stored_plans() if p.metadata() is step.meta]
    assert plan.fold is not None and plan.fold[0] == step.arrivals().data_ptr()  # the kernel folds
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, reference[0]) and torch.equal(lse, reference[1])
        assert int(step.arrivals().abs().sum()) == 0


def test_requests_beyond_the_fold_limit_run_the_combine_in_the_same_call():
    """64-row tiles fold requests of 2 splits: the longer ones are left as partials to the
    combine, launched after the same decode kernel, and the bits equal an all-combine run's."""
    from snapmla_cli.ops.decode import metadata_plan

    device = torch.device("cuda")
    step = _Step(True, _fp8_config(64, device, wg_mode=4, row_groups=4), 1, 64, seed=9)
    counts = (step.splits[1:] - step.splits[:-1]).tolist()
    plan = metadata_plan(step.meta)
    assert plan is not None and plan.fold is not None and plan.fold.combine_left
    limit = plan.fold.max_splits
    assert any(1 < n <= limit for n in counts) and any(n > limit for n in counts)
    folded = step.run(step.meta)
    combined = step.run(step.meta.clone())
    assert torch.equal(folded[0], combined[0]) and torch.equal(folded[1], combined[1])
    assert int(step.arrivals().abs().sum()) == 0


@pytest.mark.parametrize("h_q", [16, 128])
def test_hundreds_of_splits_merge_like_one(h_q):
    """The combine at its limits: requests cut into up to 141 splits (more than a CTA's threads,
    so its weights load in several rounds) against the same requests unsplit. P does not depend
    on where a request is cut (SPEC 5: e s_k / sigma_k cancels the running max), so the two
    differ only in float32 rounding."""
    from snapmla_cli.ops.schedule import MAX_SPLITS_PER_REQUEST

    device = torch.device("cuda")
    fine = _fp8_config(min(h_q, 64), device, wg_mode=0 if h_q == 16 else 4, row_groups=1 if h_q == 16 else 4)
    fine = replace(fine, split=replace(fine.split, max_splits_per_request=MAX_SPLITS_PER_REQUEST)).with_sms(8192)
    whole = replace(fine, split=replace(fine.split, min_blocks_per_split=1 << 20))
    split_step = _Step(True, fine, 1, h_q, seed=11)
    counts = (split_step.splits[1:] - split_step.splits[:-1]).tolist()
    assert max(counts) > 128
    whole_step = _Step(True, whole, 1, h_q, seed=11)
    assert max((whole_step.splits[1:] - whole_step.splits[:-1]).tolist()) == 1
    out_s, lse_s = split_step.run(split_step.meta)
    out_w, lse_w = whole_step.run(whole_step.meta)
    torch.cuda.synchronize()
    assert out_s.isfinite().all()
    finite = ~torch.isinf(lse_w)
    assert torch.equal(finite, ~torch.isinf(lse_s))
    torch.testing.assert_close(lse_s[finite], lse_w[finite], rtol=0, atol=2e-5)
    torch.testing.assert_close(out_s.float(), out_w.float(), rtol=2e-2, atol=2e-3)


# every request with keys has at least 8 pages: with one block per split at least, a policy
# capped at n splits a request gives each exactly n (and the empty one none)
CLUSTER_LENS = [513, 0, 4097, 9000, 700, 2500, 1000, 4600]
CLUSTER_STEPS = [  # (fp8, rows per tile, kernel switches, s_q, h_q, splits per request)
    (True, 16, {"wg_mode": 3, "row_groups": 1}, 1, 16, 2),
    (True, 16, {"wg_mode": 3, "row_groups": 1}, 1, 16, 8),
    (True, 32, {"wg_mode": 3, "row_groups": 2, "stages": 5, "rope_ring": 3}, 2, 16, 2),
    (True, 20, {"wg_mode": 3, "row_groups": 2}, 1, 20, 4),  # a tile with padding rows
    (True, 64, {"wg_mode": 4, "row_groups": 4}, 1, 64, 2),
    (True, 64, {"wg_mode": 4, "row_groups": 4}, 2, 32, 4),
    (True, 128, {"wg_mode": 4, "row_groups": 4}, 2, 64, 4),  # two row tiles
    (False, 64, {}, 1, 64, 2),  # the BF16 baseline's wgmma kernel
    (False, 32, {}, 2, 16, 4),
]
CLUSTER_IDS = ["alt16-n2", "alt16-n8", "ring32-n2", "alt20-n4", "rows-m64-n2", "rows-m64-n4", "rows-m128-n4",
               "bf16-64-n2", "bf16-32-n4"]


def _cluster_step(fp8: bool, rows: int, switches: dict, s_q: int, h_q: int, n: int) -> _Step:
    cfg = _fp8_config(rows, torch.device("cuda"), **switches) if fp8 else _bf16_config(rows)
    cfg = replace(cfg, split=replace(cfg.split, max_splits_per_request=n))
    return _Step(fp8, cfg, s_q, h_q, seed=7 * n + h_q, lens=CLUSTER_LENS)


def cluster_merge_matches_fold_and_combine(step: _Step, n: int,
                                           monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``step`` planned in clusters of ``n``, run clustered (twice), by the combine (a copy of its
    work list) and by the arrival counters (cluster merge off): every result bitwise the same,
    finite where a row sees keys. Returns the clustered ``(out, lse)``."""
    from snapmla_cli.ops.decode import metadata_plan
    from snapmla_cli.ops.decode_launch import clear_plans

    counts = (step.splits[1:] - step.splits[:-1]).tolist()
    assert sorted(set(counts)) == [0, n]
    plan = metadata_plan(step.meta)
    assert plan is not None and plan.fold is not None and plan.fold.cluster == n
    clear_plans()
    clustered = step.run(step.meta)
    assert _plan_cluster(step.meta) == n  # launched in clusters (the GPU holds the wave)
    again = step.run(step.meta)
    combined = step.run(step.meta.clone())  # no plan: the combine merges
    monkeypatch.setenv("SNAPMLA_CLUSTER_FOLD", "0")
    clear_plans()
    folded = step.run(step.meta)  # the arrival counters (or the combine beyond the fold's limit)
    assert _plan_cluster(step.meta) == 0
    torch.cuda.synchronize()
    out, lse = clustered
    assert out.isfinite().all() and lse[~torch.isinf(lse)].isfinite().all()
    for other in (again, combined, folded):
        assert torch.equal(out, other[0]) and torch.equal(lse, other[1])
    return out, lse


def _plan_cluster(meta: torch.Tensor) -> int:
    """The cluster size the decode plan of ``meta`` launched with (0: none)."""
    from snapmla_cli.ops import decode_launch

    plans = [p for p in decode_launch.stored_plans() if p.metadata() is meta]
    assert len(plans) == 1
    return plans[0].cluster_size


@pytest.mark.parametrize("fp8,rows,switches,s_q,h_q,n", CLUSTER_STEPS, ids=CLUSTER_IDS)
def test_cluster_merge_gives_the_fold_and_combine_bits(fp8, rows, switches, s_q, h_q, n, monkeypatch):
    step = _cluster_step(fp8, rows, switches, s_q, h_q, n)
    clustered = cluster_merge_matches_fold_and_combine(step, n, monkeypatch)
    empty = [i for i, length in enumerate(CLUSTER_LENS) if length == 0]
    assert torch.all(clustered[0][empty] == 0) and torch.all(clustered[1][empty] == float("inf"))


def test_cluster_merge_replays_from_a_cuda_graph():
    from snapmla_cli.ops.config_choice import captures_replay_fixed_contents
    from snapmla_cli.ops.decode_launch import clear_plans

    step = _cluster_step(True, 64, {"wg_mode": 4, "row_groups": 4}, 1, 64, 2)
    reference = step.run(step.meta.clone())
    clear_plans()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), captures_replay_fixed_contents():
        out, lse = step.run(step.meta)
    assert _plan_cluster(step.meta) == 2
    for _ in range(3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, reference[0]) and torch.equal(lse, reference[1])


# Two steps of two requests whose work lists have the same shape at 16 rows and different merges:
# two one-page requests (no split: neither fold nor combine planned) and an empty request next to
# a 512-token one (two splits, merged as a cluster or by the counters; the combine writes the
# empty request).
STATIC_LENS, STEP_LENS = [64, 64], [0, 512]


def test_a_static_work_list_rewritten_in_place_merges_right_eager_and_replayed():
    """FlashMLA's CUDA-graph pattern, as SGLang's backend uses it: the static buffers come from
    ``get_mla_metadata`` itself and each step's list is copied into them. The step's contents must
    not run under the merge planned for the buffers' first contents (here: none, which left request
    1's partials unmerged and request 0's rows unwritten), neither in an eager call after the copy
    nor in a graph captured before it and replayed after it."""
    from snapmla_cli.ops.decode import decode_fp8, get_mla_metadata

    device = torch.device("cuda")
    prob = random_problem(STEP_LENS, 1, 16, causal=True, seed=23)
    q, cache = quantize_rows(prob.q.to(device)), prob.fp8_cache().to(device)
    table, lens = prob.layout.block_table.to(device), prob.layout.cache_seqlens.to(device)

    def run(meta: torch.Tensor, splits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.full((2, 1, 16, 512), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((2, 16, 1), float("nan"), dtype=torch.float32, device=device)
        return decode_fp8(q, cache, table, lens, meta, splits, prob.softmax_scale, True, out=out, lse=lse)

    meta, splits = get_mla_metadata(lens, 16, 1)
    reference = run(meta, splits)
    combined = run(meta.clone(), splits.clone())  # no plan: the combine merges (its kernels loaded too)
    torch.cuda.synchronize()
    assert torch.equal(reference[0], combined[0]) and torch.equal(reference[1], combined[1])
    assert torch.all(reference[0][0] == 0) and torch.all(reference[1][0] == float("inf"))
    assert reference[0][1].isfinite().all() and reference[1][1].isfinite().all()
    static_lens = torch.tensor(STATIC_LENS, dtype=torch.int32, device=device)
    static, static_splits = get_mla_metadata(static_lens, 16, 1)
    assert static.shape == meta.shape and not torch.equal(static, meta)
    static.copy_(meta)
    static_splits.copy_(splits)
    eager = run(static, static_splits)
    captured_static, captured_splits = get_mla_metadata(static_lens, 16, 1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run(captured_static, captured_splits)
    captured_static.copy_(meta)
    captured_splits.copy_(splits)
    graph.replay()
    torch.cuda.synchronize()
    for result in (eager, (out, lse)):
        assert torch.equal(result[0], reference[0]) and torch.equal(result[1], reference[1])
