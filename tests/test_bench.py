"""``snapmla bench`` without a GPU: the arithmetic (sharding, KV-budget batches, aggregation), the
launch checks, a real 2-rank torch.distributed run (gloo, spawned processes) of the orchestration
with the CPU fake workload, the rendering, and the command through a typer app of its own."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import typer
from cli_checks import assert_one_line_error
from rich.console import Console
from typer.testing import CliRunner

from snapmla_cli.bench.launch import (
    MULTICAST_OFF,
    RunnerSpec,
    _first_failure,
    _one_line,
    preflight,
    run_benchmark,
    torchrun_env,
)
from snapmla_cli.bench.plan import (
    BF16,
    DEFAULT_KV_MEM,
    FP8,
    L2_FLUSH_BYTES,
    LAYOUT_PRESETS,
    PRESETS,
    Batches,
    Case,
    Layout,
    budget_batch,
    cache_tokens,
    distinct_caches,
    format_bytes,
    heads_per_rank,
    make_plan,
    parse_bytes,
    parse_layouts,
    place,
)
from snapmla_cli.bench.render import plot_report, render_report
from snapmla_cli.bench.results import Comparison, Measurement, aggregate, compare
from snapmla_cli.bench.roofline import Ceilings, DecodeWork
from snapmla_cli.cli.bench import bench_command
from snapmla_cli.errors import NoGpuError, SnapmlaError
from snapmla_cli.runtime.gpu_arch import UnsupportedGpuError
from snapmla_cli.sizes import MAX_BATCH, MAX_QUERY_TOKENS

GiB = 2**30


# ---------------------------------------------------------------- presets, layouts, sharding


def test_model_presets_match_the_published_configs() -> None:
    assert (PRESETS["deepseek-v3"].heads, PRESETS["deepseek-v3"].layers) == (128, 61)
    assert (PRESETS["longcat-flash"].heads, PRESETS["longcat-flash"].layers) == (64, 56)
    assert (PRESETS["kimi-k2"].heads, PRESETS["kimi-k2"].layers) == (64, 61)


def test_layout_presets_are_the_papers_figure_1() -> None:
    assert LAYOUT_PRESETS == {"dp1tp8": Layout(1, 8), "dp4tp2": Layout(4, 2), "dp8tp1": Layout(8, 1)}
    assert parse_layouts("dp1tp8,DP4/TP2,dp8tp1") == (Layout(1, 8), Layout(4, 2), Layout(8, 1))
    with pytest.raises(SnapmlaError, match=r"^--layout: dp2tp1 given twice \('dp2tp1' and 'DP2/TP1'\)$"):
        parse_layouts("dp2tp1,DP2/TP1")
    assert Layout(4, 2).world == 8 and Layout(4, 2).label == "DP4/TP2"


@pytest.mark.parametrize("text, needle", [
    ("dp2tp1,dp1tp1", "same number of GPUs"),
    ("tp8", "not a layout"),
    ("dp0tp1", "at least 1"),
    ("dp1tp0", "'dp1tp0': dp and tp must be at least 1"),
    (",", "empty"),
    ("dp1tp8,,dp8tp1", r"^--layout: 'dp1tp8,,dp8tp1' has an empty item \(item 2 of 3; expected e.g. dp4tp2 or"),
    ("dp" + "9" * 20 + "tp1", r"^--layout: 'dp9+\.\.\.' is too large \(expected at most 19 digits\)$"),
])
def test_bad_layouts(text: str, needle: str) -> None:
    with pytest.raises(SnapmlaError, match=needle):
        parse_layouts(text)


def test_tp_splits_heads_and_groups_contiguous_ranks() -> None:
    assert [heads_per_rank(128, tp) for tp in (1, 2, 8)] == [128, 64, 16]
    assert heads_per_rank(64, 8) == 8  # LongCat-Flash on DP1/TP8
    with pytest.raises(SnapmlaError, match="--tp 3: 128 heads do not split evenly"):
        heads_per_rank(128, 3)
    places = [place(r, Layout(4, 2), 128) for r in range(8)]
    assert [(p.dp_index, p.tp_index) for p in places] == [(r // 2, r % 2) for r in range(8)]
    assert {p.heads for p in places} == {64}
    with pytest.raises(SnapmlaError, match="outside"):
        place(8, Layout(4, 2), 128)


# ---------------------------------------------------------------- memory budget and batches


@pytest.mark.parametrize("text, value", [
    ("60GiB", 60 * GiB), ("60G", 60 * GiB), ("60g", 60 * GiB), ("60 GiB", 60 * GiB),
    ("60GB", 60 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * GiB)), ("4096", 4096),
])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "60XB", "-1G", "0", "60i", "5ib", "60iB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(SnapmlaError, match="--kv-mem"):
        parse_bytes(text)


def test_budget_batch_for_deepseek_v3_at_60_gib() -> None:
    # batch = budget / (layers * ctx * bytes per token), 656 (FP8) vs 1152 (BF16) bytes
    assert budget_batch(60 * GiB, 16384, 61, FP8) == 60 * GiB // (61 * 16384 * 656) == 98
    assert budget_batch(60 * GiB, 16384, 61, BF16) == 55
    assert budget_batch(60 * GiB, 131072, 61, FP8) == 12
    assert budget_batch(60 * GiB, 131072, 61, BF16) == 6
    assert budget_batch(GiB, 131072, 61, BF16) == 0
    # FP8 holds 1152 / 656 = 1.76x the tokens (batches of 3,050 and 1,737, below the cap)
    ctx = 4096
    ratio = budget_batch(5 * 10**11, ctx, 61, FP8) / budget_batch(5 * 10**11, ctx, 61, BF16)
    assert math.isclose(ratio, 1152 / 656, rel_tol=1e-3)
    # at most MAX_BATCH requests: a short context's budget sized 873,813 once (64 tokens, 1 layer)
    assert budget_batch(60 * GiB, 64, 1, FP8) == budget_batch(10**15, ctx, 1, BF16) == MAX_BATCH == 4096


def test_budget_counts_whole_pages() -> None:
    assert cache_tokens(1) == 64 and cache_tokens(64) == 64 and cache_tokens(100) == 128
    assert budget_batch(128 * 656, 100, 1, FP8) == 1
    assert budget_batch(128 * 656 - 1, 100, 1, FP8) == 0


def test_plan_batches_equal_batch_and_equal_memory() -> None:
    plan = make_plan(contexts=[16384, 131072])
    assert plan.kv_mem == DEFAULT_KV_MEM and plan.batch is None
    b = plan.batches(16384)
    assert (b.equal, b.fp8_mem, b.bf16_mem) == (55, 98, 55)
    # the BF16 same-batch and same-memory cases are one run
    assert b.cases() == [Case(FP8, 55), Case(BF16, 55), Case(FP8, 98)]
    # --batch alone: no budget, no equal-memory comparison
    plan = make_plan(batch=32, contexts=[16384])
    assert plan.kv_mem is None and plan.batches(16384) == Batches(32)
    assert plan.batches(16384).cases() == [Case(FP8, 32), Case(BF16, 32)]
    # --batch and --kv-mem: both comparisons
    plan = make_plan(batch=32, kv_mem=60 * GiB, contexts=[16384])
    assert plan.batches(16384).cases() == [Case(FP8, 32), Case(BF16, 32), Case(FP8, 98), Case(BF16, 55)]


def test_no_equal_memory_comparison_where_both_formats_reach_the_batch_cap() -> None:
    """The README: the equal-memory speed-up is not reported where both formats reach the 4096
    cap (1 layer at 1k: 60 GiB holds 54,613 BF16 requests). It once showed 4096/4096 as 'same
    mem', the equal-batch run again under another name."""
    b = make_plan(layers=1, contexts=[1024]).batches(1024)
    assert (b.equal, b.fp8_mem, b.bf16_mem) == (MAX_BATCH, MAX_BATCH, MAX_BATCH)
    assert b.equal_memory is None and b.cases() == [Case(FP8, MAX_BATCH), Case(BF16, MAX_BATCH)]
    # only FP8 at the cap: each format still runs at what the budget holds (FP8 capped)
    b = make_plan(layers=8, contexts=[2048]).batches(2048)
    assert b.fp8_mem == MAX_BATCH > b.bf16_mem and b.equal_memory == (MAX_BATCH, b.bf16_mem)


def test_batch_does_not_depend_on_tp() -> None:
    """MLA's one latent KV head is not split by TP: every rank holds its group's whole cache."""
    a = make_plan(layouts=(Layout(8, 1),), contexts=[32768])
    b = make_plan(layouts=(Layout(1, 8),), contexts=[32768])
    assert a.batches(32768) == b.batches(32768)


@pytest.mark.parametrize("kwargs, needle", [
    ({"model": "gpt"}, "--model"),
    ({"mtp": 17}, "--mtp"),
    ({"mtp": 0}, "--mtp"),
    ({"heads": 0}, "--heads"),
    ({"layers": 0}, "--layers"),
    ({"batch": 0}, "--batch"),
    ({"contexts": [1], "mtp": 2}, "shorter than --mtp"),
    ({"layouts": (Layout(1, 3),)}, "--tp 3"),
    ({"layouts": (Layout(1, 3),), "from_layout_option": True}, "^--layout dp1tp3: 128 heads"),
    ({"kv_mem": GiB, "contexts": [131072]}, "holds no BF16 request of context 128k"),
    ({"kv_mem": 61 * 131072 * 656, "contexts": [131072]}, "holds no BF16 request"),  # one FP8 one
    ({"layouts": (Layout(0, 1),)}, "--dp: expected at least 1, got 0"),
    ({"layouts": (Layout(1, 1), Layout(2, 1))}, "same number of GPUs"),
])
def test_make_plan_rejects(kwargs: dict, needle: str) -> None:
    with pytest.raises(SnapmlaError, match=needle):
        make_plan(**kwargs)


def test_a_context_given_twice_is_timed_once() -> None:
    assert make_plan(contexts=[4096, 1024, 4096]).contexts == (4096, 1024)


def test_plan_description_and_devices() -> None:
    from types import SimpleNamespace

    from snapmla_cli.bench.render import _devices, describe_plan

    assert describe_plan(make_plan(contexts=[1024])).startswith("deepseek-v3: 128 heads x 61 MLA layers")
    assert describe_plan(make_plan(layers=2, contexts=[1024])).startswith("deepseek-v3 (custom): 128 heads")
    assert describe_plan(make_plan(heads=64, contexts=[1024])).startswith("deepseek-v3 (custom): 64 heads")
    ranks = [{"device": "H200"}, {"device": "H100"}, {"device": "H200"}]
    assert _devices(SimpleNamespace(meta={"ranks": ranks})) == "H200 x2, H100 x1"


def test_a_context_as_long_as_the_queries_is_a_plan() -> None:
    """The s_q queries are the last s_q cache tokens (SPEC section 2): ctx == mtp is the
    shortest valid case, only a shorter context is refused."""
    plan = make_plan(mtp=2, contexts=[2], batch=1, kv_mem=None)
    assert plan.contexts == (2,) and plan.s_q == 2


def test_mtp_range_is_the_one_verify_and_tune_accept() -> None:
    """1..MAX_QUERY_TOKENS (16), both ends included, as verify and tune: SPEC section 1's 1..4
    are the MTP depths in use, the kernels take any s_q, and a deeper speculative decoder is
    measured with the same flag it was verified and tuned with."""
    assert make_plan(mtp=MAX_QUERY_TOKENS, contexts=[4096]).s_q == MAX_QUERY_TOKENS
    assert make_plan(mtp=1, contexts=[4096]).s_q == 1
    with pytest.raises(SnapmlaError, match=f"--mtp: expected 1..{MAX_QUERY_TOKENS} query tokens per request, got 17"):
        make_plan(mtp=MAX_QUERY_TOKENS + 1, contexts=[4096])


def test_format_bytes_uses_the_largest_unit_reached() -> None:
    assert format_bytes(60 * GiB) == "60 GiB" and format_bytes(GiB) == "1 GiB"
    assert format_bytes(2**40) == "1 TiB" and format_bytes(2**20) == "1 MiB"
    assert format_bytes(1024) == "1 KiB" and format_bytes(1023) == "1023 B"
    # 1000-1023 of a unit: no exponent (":.3g" wrote "1e+03 MiB")
    assert format_bytes(1000 * 2**20) == "1000 MiB" and format_bytes(1023 * 2**10) == "1023 KiB"
    assert format_bytes(1.5 * 2**20) == "1.5 MiB" and format_bytes(150 * GiB) == "150 GiB"
    # rounding up to 1024 of a unit is the next unit ("1024 MiB" of 1 GiB - 512 KiB)
    assert format_bytes(GiB - 2**19) == "1 GiB" and format_bytes(1023.6) == "1 KiB"
    assert format_bytes(2**50) == "1024 TiB"  # (no larger unit)


def test_a_budget_just_short_of_one_request_shows_the_bytes() -> None:
    """Both sizes rounded to '1024 MiB' / '1 GiB': the budget read as equal to the need it fails."""
    need = 932096 * 1152
    with pytest.raises(SnapmlaError, match=rf"^--kv-mem {need - 1:,} bytes holds no BF16 request of context "
                                           rf".* with 1 layer \(one needs {need:,} bytes\)$"):
        make_plan(layers=1, contexts=[932096], kv_mem=need - 1)


def test_a_note_says_where_the_same_memory_fp8_batch_is_capped() -> None:
    """8 layers at 2k: 60 GiB holds 5,994 FP8 requests, run at the 4,096 cap beside BF16's 3,413."""
    plan = make_plan(layers=8, contexts=[2048, 131072])
    notes = plan.capped_fp8_notes()
    assert len(notes) == 1 and notes[0].startswith("context 2k: the KV budget holds 5,994 FP8 requests")
    assert f"capped at {MAX_BATCH}" in notes[0]
    assert make_plan(layers=1, contexts=[1024]).capped_fp8_notes() == []  # both capped: no comparison
    assert make_plan(batch=8, kv_mem=None, contexts=[2048]).capped_fp8_notes() == []


def test_distinct_caches_needs_at_least_one_layer() -> None:
    for cache_bytes, layers in ((1000, 0), (0, 4), (L2_FLUSH_BYTES, 0)):
        with pytest.raises(SnapmlaError, match="need positive sizes"):
            distinct_caches(cache_bytes, layers)


def test_a_cache_exactly_the_flush_size_needs_no_other_copy() -> None:
    """A cache of L2_FLUSH_BYTES flushes the L2 by itself: one copy. One byte less needs two
    others read between two uses of one copy (one other is a byte short): three."""
    assert distinct_caches(L2_FLUSH_BYTES, 61) == 1
    assert distinct_caches(L2_FLUSH_BYTES - 1, 61) == 3


def test_effective_roofline_follows_spec_section_7() -> None:
    """t_min = max(bytes / B, rows*keys*(2*(512+512)/P8 + 2*64/P16)) for FP8 and
    max(bytes / B, FLOPs / P16) for BF16: the RoPE tile runs at the BF16 rate."""
    work = DecodeWork(2, 2, 16, 4096, causal=True)
    rows_keys = work.row_keys
    fp8_compute = rows_keys * (2 * (512 + 512) / 4e15 + 2 * 64 / 1e15)
    fast_copy = Ceilings(p16=1e15, p8=4e15, bandwidth=1e20)  # compute bound
    assert math.isclose(work.t_min(True, fast_copy), fp8_compute, rel_tol=1e-12)
    assert math.isclose(work.t_min(False, fast_copy), work.flops / 1e15, rel_tol=1e-12)
    slow_copy = Ceilings(p16=1e15, p8=4e15, bandwidth=1e9)  # memory bound
    for fp8 in (True, False):
        assert math.isclose(work.t_min(fp8, slow_copy), work.bytes(fp8) / 1e9, rel_tol=1e-12)


def test_distinct_caches_keep_small_caches_out_of_l2() -> None:
    assert distinct_caches(GiB, 61) == 1
    n = distinct_caches(10 * 2**20, 61)
    assert (n - 1) * 10 * 2**20 >= 256 * 2**20 and n <= 61
    assert distinct_caches(1, 61) == 61
    assert distinct_caches(10 * 2**20, 3) == 3


def test_gpu_step_inputs_write_the_new_tokens_at_the_end_of_each_request() -> None:
    """The slots the real step appends to (checked on the CPU with the BF16 index copy)."""
    from snapmla_cli.bench.gpu_step import _bf16_cache, _inputs
    from snapmla_cli.bench.worker import StepSpec
    from snapmla_cli.cache.layout import gather_from_pages

    spec = StepSpec(BF16, batch=3, s_q=2, heads=4, context=130, layers=2, seed=5)
    x = _inputs(spec, torch.device("cpu"))
    assert x.q.shape == (2, 3, 2, 4, 576) and x.kv_new.shape == (2, 6, 576)
    assert x.seqlens.tolist() == [130] * 3 and x.num_blocks == 3 * 3
    cache = _bf16_cache(x.num_blocks, torch.device("cpu"), torch.Generator().manual_seed(0))
    cache.view(-1, 576).index_copy_(0, x.slots.long(), x.kv_new[1])
    for i in range(3):
        rows = gather_from_pages(cache.squeeze(2), x.block_table[i], 130)
        assert torch.equal(rows[-2:], x.kv_new[1, 2 * i : 2 * i + 2])


# ---------------------------------------------------------------- aggregation


def _m(rank: int, layout: Layout, step_s: float, batch: int = 8, s_q: int = 1) -> Measurement:
    return Measurement(rank=rank, layout=layout.name, dp_index=rank // layout.tp,
                       tp_index=rank % layout.tp, context=4096, impl=FP8, batch=batch, s_q=s_q,
                       heads=128 // layout.tp, layers=61, step_s=step_s, kernel="k", graphed=True)


def test_aggregate_sums_dp_groups_at_the_pace_of_the_slowest_tp_rank() -> None:
    layout = Layout(2, 2)
    rows = [_m(0, layout, 0.010, s_q=2), _m(1, layout, 0.020, s_q=2),
            _m(2, layout, 0.004, s_q=2), _m(3, layout, 0.005, s_q=2)]
    case = aggregate(layout, rows)
    assert case.group_step_s == (0.020, 0.005)
    assert math.isclose(case.aggregate_tokens_per_s, 8 * 2 / 0.020 + 8 * 2 / 0.005)
    assert math.isclose(case.per_gpu_tokens_per_s, case.aggregate_tokens_per_s / 4)
    assert math.isclose(case.tflops, sum(m.tflops for m in rows))
    # the JSON names its per-GPU figures (the table's columns) apart from the sums
    d = case.to_dict()
    assert math.isclose(d["tflops_per_gpu"], case.tflops / 4) and math.isclose(d["gbs_per_gpu"], case.gbs / 4)
    # pure DP: the aggregate is the sum of the ranks
    dp = Layout(3, 1)
    rows = [_m(r, dp, 0.01 * (r + 1)) for r in range(3)]
    assert math.isclose(aggregate(dp, rows).aggregate_tokens_per_s, sum(m.tokens_per_s for m in rows))


def test_aggregate_means_and_per_rank_figures() -> None:
    """Per rank: tokens/s counts every query token (batch x s_q), the roofline share is a
    percentage. Per case: step time, us/layer and roofline share are means over the ranks (not
    the slowest), the roofline share is unknown if any rank lacks it, repeated notes are listed
    once, and ranks whose DP indices do not form the layout's groups are refused."""
    layout = Layout(1, 2)
    a = replace(_m(0, layout, 0.010, batch=6, s_q=3), t_min_s=0.004, note="fake step")
    b = replace(_m(1, layout, 0.030, batch=6, s_q=3), t_min_s=0.006, note="fake step")
    assert math.isclose(a.tokens_per_s, 6 * 3 / 0.010) and math.isclose(a.roof_pct, 40.0)
    case = aggregate(layout, [a, b])
    assert math.isclose(case.step_s, 0.020) and math.isclose(case.us_per_layer, 1e6 * 0.020 / 61)
    assert math.isclose(case.roof_pct, (40.0 + 20.0) / 2) and case.notes == ("fake step",)
    assert aggregate(layout, [a, replace(b, t_min_s=None)]).roof_pct is None
    with pytest.raises(SnapmlaError, match="ranks do not form 1 DP groups of 2"):
        aggregate(layout, [a, replace(b, dp_index=1)])
    faster = aggregate(layout, [replace(a, step_s=0.005), replace(b, step_s=0.005)])
    assert math.isclose(Comparison(layout, 4096, faster, case).speedup_equal_batch, 0.030 / 0.005)


def test_fp8_against_the_bf16_roofline() -> None:
    """An FP8 step reports the BF16 roofline's time for its decode work over its own (issue 7's
    second ratio); a case takes the mean over its ranks, unknown if a rank lacks it (BF16 steps,
    runs without ceilings, older reports); the kernel table prints it as a factor."""
    from snapmla_cli.bench.render import kernel_table

    layout = Layout(2, 1)
    a = replace(_m(0, layout, 0.010), bf16_t_min_s=0.015)
    b = replace(_m(1, layout, 0.020), bf16_t_min_s=0.020)
    assert a.vs_bf16_roofline == pytest.approx(1.5) and a.to_dict()["vs_bf16_roofline"] == pytest.approx(1.5)
    assert aggregate(layout, [a, b]).vs_bf16_roofline == pytest.approx(1.25)
    assert aggregate(layout, [a, replace(b, bf16_t_min_s=None)]).vs_bf16_roofline is None
    plan = make_plan(heads=8, layers=2, contexts=[1024], layouts=(layout,), batch=3, kv_mem=None)
    report = _fake_report(plan)
    report.measurements = [replace(m, bf16_t_min_s=3e-6) if m.impl == FP8 else m for m in report.measurements]
    cells = {c.header: list(c.cells) for c in kernel_table(report).columns}
    # BF16 first (ranks at 2 and 4 us: no ratio), FP8 at 1 and 2 us: mean of 3.0x and 1.5x
    assert cells["x BF16 roofline"] == ["-", "2.25x"]


def test_aggregate_needs_every_rank() -> None:
    layout = Layout(2, 1)
    with pytest.raises(SnapmlaError, match="ranks 0..1"):
        aggregate(layout, [_m(0, layout, 0.01)])


def test_measurement_work_accounting_follows_spec_section_7() -> None:
    m = _m(0, Layout(1, 1), 0.1)
    flops_per_layer = 2 * 8 * 1 * 128 * 4096 * (576 + 512)
    assert math.isclose(m.tflops, 61 * flops_per_layer / 0.1 / 1e12)
    kv, q, out = 8 * 4096 * 656, 8 * 128 * 576 * 2, 8 * 128 * 512 * 2
    assert math.isclose(m.gbs, 61 * (kv + q + out) / 0.1 / 1e9)
    assert math.isclose(m.us_per_layer, 1e5 / 61)
    assert Measurement.from_dict(m.to_dict()) == m


def test_causal_work_counts_the_visible_keys() -> None:
    """SPEC section 7 counts visible keys; a causal query token t sees n - s_q + t + 1 of them."""
    assert DecodeWork(1, 4, 16, 64, causal=True).flops == 2 * (61 + 62 + 63 + 64) * 16 * (576 + 512)
    assert DecodeWork(1, 4, 16, 64).flops == 2 * 4 * 64 * 16 * (576 + 512)
    assert DecodeWork(2, 1, 8, 100, causal=True).row_keys == DecodeWork(2, 1, 8, 100).row_keys == 2 * 8 * 100
    assert DecodeWork(1, 3, 1, 1, causal=True).row_keys == 1  # tokens 0 and 1 see nothing


# ---------------------------------------------------------------- launch checks


RENDEZVOUS = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def launched(**ranks: str) -> dict[str, str]:
    """A launcher's environment: the ranks' variables and rank 0's address."""
    return {**RENDEZVOUS, **ranks}


def test_torchrun_env() -> None:
    assert torchrun_env({}) is None
    assert torchrun_env(launched(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1")).local_rank == 1
    assert torchrun_env(launched(RANK="2", WORLD_SIZE="4")).local_rank == 2
    with pytest.raises(SnapmlaError, match="not integers"):
        torchrun_env(launched(RANK="x", WORLD_SIZE="2"))
    with pytest.raises(SnapmlaError, match="do not fit"):
        torchrun_env(launched(RANK="2", WORLD_SIZE="2"))


def test_torchrun_env_needs_both_rank_and_world_size_and_a_local_rank_of_zero_or_more() -> None:
    """Only RANK or only WORLD_SIZE set is no launcher (not a KeyError); a negative LOCAL_RANK
    does not fit, like a RANK outside the world."""
    assert torchrun_env({"RANK": "0"}) is None
    assert torchrun_env({"WORLD_SIZE": "2", **RENDEZVOUS}) is None
    with pytest.raises(SnapmlaError, match="RANK 1 / LOCAL_RANK -1 do not fit WORLD_SIZE 2"):
        torchrun_env(launched(RANK="1", WORLD_SIZE="2", LOCAL_RANK="-1"))


@pytest.mark.parametrize("environ, needle", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR is not"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT: expected"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "port"}, "MASTER_PORT: expected"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "0"}, "MASTER_PORT: expected"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9" * 5000}, "MASTER_PORT: expected"),
])
def test_torchrun_env_needs_the_rendezvous_address(environ: dict[str, str], needle: str) -> None:
    """Without rank 0's address torch.distributed's env:// store fails with a traceback deep in
    its C++ side; the launch names the missing variable first."""
    with pytest.raises(SnapmlaError, match=needle):
        torchrun_env(environ)


def test_a_launchers_single_rank_runs_without_a_process_group() -> None:
    """RANK=0 WORLD_SIZE=1 needs no rendezvous: the plan runs in this process."""
    env = torchrun_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert env is not None and env.world == 1
    plan = make_plan(heads=8, layers=2, contexts=[1024], layouts=(Layout(1, 1),), batch=2, kv_mem=None)
    report = run_benchmark(plan, RunnerSpec(kind="cpu-fake", steps=1, warmup=0),
                           environ={"RANK": "0", "WORLD_SIZE": "1"})
    assert report is not None and report.meta["launcher"] == "torchrun" and report.meta["world"] == 1
    assert report.meta["backend"] == "none"  # one rank: no process group, so no backend


def test_preflight() -> None:
    gpu = RunnerSpec()
    plan = make_plan(layouts=(Layout(4, 2),), contexts=[16384])
    with pytest.raises(NoGpuError, match="needs CUDA GPUs"):
        preflight(plan, gpu, None, cuda_available=False)
    with pytest.raises(NoGpuError, match="CuPy"):
        preflight(plan, gpu, None, cuda_available=True, have_cupy=False)
    with pytest.raises(SnapmlaError, match="dp4tp2 runs 8 ranks, one per GPU, but this machine has 1 GPU"):
        preflight(plan, gpu, None, cuda_available=True, have_cupy=True, device_count=1)
    preflight(plan, gpu, None, cuda_available=True, have_cupy=True, device_count=8,
                  gpu_problem=HOPPER)
    # torchrun: the world must match; each node only needs its local ranks' GPUs
    env = torchrun_env(launched(RANK="9", WORLD_SIZE="16", LOCAL_RANK="1"))
    with pytest.raises(SnapmlaError, match="torchrun started 16 processes but dp4tp2 needs 8"):
        preflight(plan, gpu, env, cuda_available=True, have_cupy=True, device_count=8,
                  gpu_problem=HOPPER)
    env = torchrun_env(launched(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1"))
    preflight(plan, gpu, env, cuda_available=True, have_cupy=True, device_count=4,
                  gpu_problem=HOPPER)
    # the CPU fake needs no GPU
    preflight(plan, RunnerSpec(kind="cpu-fake"), None, cuda_available=False, device_count=0)


def HOPPER(index: int) -> str | None:
    """preflight's stand-in for a machine whose GPUs all run the kernels."""
    return None


def test_preflight_refuses_a_gpu_the_kernels_are_not_built_for() -> None:
    """A spawned run checks every GPU it will use (the first one that is not Hopper is named); a
    torchrun rank checks its own GPU only."""
    plan = make_plan(layouts=(Layout(2, 1),), contexts=[16384])
    asked: list[int] = []

    def second_is_ada(index: int) -> str | None:
        asked.append(index)
        return f"cuda:{index} is an L40S" if index == 1 else None

    with pytest.raises(UnsupportedGpuError, match="^cuda:1 is an L40S$"):
        preflight(plan, RunnerSpec(), None, cuda_available=True, have_cupy=True, device_count=2,
                  gpu_problem=second_is_ada)
    assert asked == [0, 1]
    asked.clear()
    env = torchrun_env(launched(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"))
    preflight(plan, RunnerSpec(), env, cuda_available=True, have_cupy=True, device_count=2,
              gpu_problem=second_is_ada)
    assert asked == [0]
    # the CPU fake asks nothing
    preflight(plan, RunnerSpec(kind="cpu-fake"), None, cuda_available=False, device_count=0,
              gpu_problem=second_is_ada)
    assert asked == [0]


def test_preflight_needs_a_gpu_for_the_last_local_rank() -> None:
    """LOCAL_RANK counts from 0: on a node of 4 GPUs local rank 4 has none (3 has the last)."""
    plan = make_plan(layouts=(Layout(4, 2),), contexts=[16384])
    env = torchrun_env(launched(RANK="4", WORLD_SIZE="8", LOCAL_RANK="4"))
    with pytest.raises(SnapmlaError, match="LOCAL_RANK 4 has no GPU: this node has 4"):
        preflight(plan, RunnerSpec(), env, cuda_available=True, have_cupy=True, device_count=4,
                  gpu_problem=HOPPER)
    env = torchrun_env(launched(RANK="3", WORLD_SIZE="8", LOCAL_RANK="3"))
    preflight(plan, RunnerSpec(), env, cuda_available=True, have_cupy=True, device_count=4,
                  gpu_problem=HOPPER)


@pytest.mark.parametrize("kwargs, needle", [
    ({"steps": 0}, "--steps"), ({"warmup": -1}, "--warmup"), ({"bf16_impl": "x"}, "--bf16-impl"),
    ({"kind": "tpu"}, "runner"), ({"clocks": "turbo"}, "--clocks"),
])
def test_runner_spec_rejects(kwargs: dict, needle: str) -> None:
    with pytest.raises(SnapmlaError, match=needle):
        RunnerSpec(**kwargs)


def test_first_failure_is_the_earliest_rank_error(tmp_path: Path) -> None:
    (tmp_path / "error-0.txt").write_text("20.0\nRuntimeError: Connection closed by peer")
    (tmp_path / "error-1.txt").write_text("10.0\nOutOfMemoryError: CUDA out of memory")
    assert _first_failure(tmp_path, RuntimeError("x")) == "rank 1: OutOfMemoryError: CUDA out of memory"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "died" in _first_failure(empty, RuntimeError("exit code 1"))


def test_a_rank_error_is_one_line_naming_its_type_unless_it_is_ours() -> None:
    assert _one_line(RuntimeError("CUDA error:\n  out of   memory")) == "RuntimeError: CUDA error: out of memory"
    assert _one_line(SnapmlaError("--batch: expected\nat least 1")) == "--batch: expected at least 1"
    assert _one_line(KeyboardInterrupt()) == "KeyboardInterrupt"


# ---------------------------------------------------------------- orchestration


def _check_aggregates(report) -> None:
    for comparison in report.comparisons:
        for case in (comparison.fp8, comparison.bf16, comparison.fp8_mem, comparison.bf16_mem):
            if case is None:
                continue
            rows = [m for m in report.measurements if (m.layout, m.context, m.impl, m.batch)
                    == (case.layout.name, case.context, case.impl, case.batch)]
            assert sorted(m.rank for m in rows) == list(range(case.layout.world))
            if case.layout.tp == 1:
                assert math.isclose(case.aggregate_tokens_per_s, sum(m.tokens_per_s for m in rows))


def test_two_rank_gloo_run_of_the_orchestration() -> None:
    """Real torch.distributed: two spawned processes, gloo, a free port, the fake workload."""
    plan = make_plan(heads=8, layers=2, contexts=[1024], layouts=(Layout(2, 1),), batch=3,
                     kv_mem=GiB)
    report = run_benchmark(plan, RunnerSpec(kind="cpu-fake", steps=2, warmup=1), environ={})
    assert report.meta["launcher"] == "spawn" and report.meta["backend"] == "gloo"
    assert report.meta["world"] == 2 and [r["rank"] for r in report.meta["ranks"]] == [0, 1]
    assert report.meta["env"] == MULTICAST_OFF  # set in every rank before the process group
    cases = plan.batches(1024).cases()
    assert len(cases) == 4 and len(report.measurements) == 2 * len(cases)
    assert {m.heads for m in report.measurements} == {8}
    _check_aggregates(report)
    (comparison,) = report.comparisons
    assert comparison.fp8.batch == 3 and comparison.fp8_mem.batch == budget_batch(GiB, 1024, 2, FP8)
    pair = comparison.equal_memory
    assert pair is not None and pair[0].batch > pair[1].batch  # FP8's smaller tokens: more requests fit
    assert comparison.speedup_equal_memory == pair[0].aggregate_tokens_per_s / pair[1].aggregate_tokens_per_s > 0


def test_three_rank_gloo_run_takes_an_odd_world() -> None:
    """Any GPU count, not only powers of two: three ranks as DP3 and as DP1/TP3 (6 heads, two a
    rank) in one spawned world of three processes."""
    plan = make_plan(heads=6, layers=1, contexts=[1024], layouts=(Layout(3, 1), Layout(1, 3)), batch=2,
                     kv_mem=GiB)
    report = run_benchmark(plan, RunnerSpec(kind="cpu-fake", steps=1, warmup=0), environ={})
    assert report.meta["world"] == 3 and [r["rank"] for r in report.meta["ranks"]] == [0, 1, 2]
    assert {m.heads for m in report.measurements if m.layout == "dp1tp3"} == {2}
    assert {m.heads for m in report.measurements if m.layout == "dp3tp1"} == {6}
    _check_aggregates(report)


@pytest.fixture(scope="module")
def inline_report():
    plan = make_plan(heads=8, layers=2, contexts=[1024, 4096], kv_mem=GiB)
    return run_benchmark(plan, RunnerSpec(kind="cpu-fake", steps=2, warmup=0), environ={})


def test_inline_run_and_rendering(inline_report, tmp_path: Path) -> None:
    report = inline_report
    assert report.meta["launcher"] == "inline" and report.meta["world"] == 1
    _check_aggregates(report)
    assert len(compare(report.plan, report.measurements)) == 2
    out = Console(record=True, width=240)
    render_report(out, report)
    text = out.export_text()
    assert "DP1/TP1" in text and "x same mem" in text and "cpu-fake" in text
    path = tmp_path / "fig1.png"
    plot_report(report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = report.to_dict()
    json.dumps(doc)
    assert doc["format"] == "snapmla-bench" and doc["plan"]["layouts"] == ["dp1tp1"]


def _fake_report(plan):
    """Every rank's measurement of every case of ``plan``: FP8 replayed as a CUDA graph, BF16
    eager and twice as slow, rank r at (1 + r) us per step."""
    from snapmla_cli.bench.results import BenchReport

    rows = []
    for layout in plan.layouts:
        for ctx in plan.contexts:
            for case in plan.batches(ctx).cases():
                for rank in range(layout.world):
                    rows.append(Measurement(
                        rank=rank, layout=layout.name, dp_index=rank // layout.tp, tp_index=rank % layout.tp,
                        context=ctx, impl=case.impl, batch=case.batch, s_q=plan.s_q,
                        heads=plan.heads // layout.tp, layers=plan.layers,
                        step_s=1e-6 * (1 + rank) * (2 if case.impl == BF16 else 1),
                        kernel=f"fake-{case.impl}", graphed=case.impl == FP8))
    return BenchReport(plan, rows, {"ranks": [{"device": "cpu"}] * plan.world})


def test_kernel_table_has_one_row_per_case_and_per_gpu_figures() -> None:
    from snapmla_cli.bench.render import kernel_table, plot_title

    plan = make_plan(heads=8, layers=2, contexts=[1024], layouts=(Layout(2, 1),), batch=3, kv_mem=GiB)
    report = _fake_report(plan)
    table = kernel_table(report)
    cells = {c.header: list(c.cells) for c in table.columns}
    (comparison,) = report.comparisons
    cases = [comparison.bf16, comparison.fp8, comparison.bf16_mem, comparison.fp8_mem]
    assert cells["batch/DP"] == [str(c.batch) for c in cases] == ["3", "3", "455", "799"]
    assert cells["TFLOPS/GPU"] == [f"{c.tflops / 2:.1f}" for c in cases]
    assert cells["timed"] == ["eager", "CUDA graph", "eager", "CUDA graph"]
    assert plot_title(report).startswith("deepseek-v3: 8 heads x 2 MLA layers, s_q 1, batch 3/DP, KV budget 1 GiB/GPU")


@pytest.mark.parametrize("batch, labels", [
    (None, ["BF16 (fake-bf16), same batch", "FP8 SnapMLA, same batch", "FP8 SnapMLA, same KV memory"]),
    (3, ["BF16 (fake-bf16), same batch", "FP8 SnapMLA, same batch", "BF16, same KV memory",
         "FP8 SnapMLA, same KV memory"]),
])
def test_the_plot_draws_bf16_at_the_same_memory_only_where_its_batch_differs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch, labels) -> None:
    """Without --batch the BF16 same-batch case is the BF16 same-memory case: one bar, not two."""
    import matplotlib.pyplot as plt

    from snapmla_cli.bench import render

    seen: list[list[str]] = []

    def keep_legend(path, write, replace=True):
        seen.append([t.get_text() for t in plt.gcf().legends[0].texts])

    monkeypatch.setattr(render, "write_atomic", keep_legend)
    plan = make_plan(heads=8, layers=2, contexts=[1024, 2048], batch=batch, kv_mem=GiB)
    plot_report(_fake_report(plan), tmp_path / "f.png")
    assert seen == [labels]


def test_the_plot_draws_same_memory_bars_where_a_context_has_them_and_a_whole_legend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer at 1k: both formats reach the batch cap, so that context has no same-memory
    comparison; 64k still gets its bar (all of them were once dropped when one context had
    none). The legend of a one-panel figure lies inside it (four entries in a row were cut off
    at both sides)."""
    import matplotlib.pyplot as plt

    from snapmla_cli.bench import render

    seen: list[tuple[dict[str, int], bool]] = []

    def keep_bars(path, write, replace=True):
        fig = plt.gcf()
        fig.canvas.draw()
        bars: dict[str, int] = {}
        for container in fig.axes[0].containers:
            bars[container.get_label()] = len(container.patches)
        legend = fig.legends[0].get_window_extent()
        seen.append((bars, bool(legend.x0 >= 0 and legend.x1 <= fig.bbox.x1)))

    monkeypatch.setattr(render, "write_atomic", keep_bars)
    plan = make_plan(heads=8, layers=1, contexts=[1024, 65536])
    assert plan.batches(1024).equal_memory is None and plan.batches(65536).equal_memory is not None
    plot_report(_fake_report(plan), tmp_path / "f.png")
    assert seen == [({"BF16 (fake-bf16), same batch": 2, "FP8 SnapMLA, same batch": 2,
                      "FP8 SnapMLA, same KV memory": 1}, True)]


def test_a_narrow_terminal_folds_figures_instead_of_cropping_them() -> None:
    """A cropped figure ("18,305,1…") reads as another number; folded, every digit stays."""
    # a batch past --batch's bound (MAX_BATCH), set behind make_plan's back: the widest figures
    plan = replace(make_plan(heads=8, layers=2, contexts=[1024], batch=2), batch=2**31 - 1)
    report = run_benchmark(plan, RunnerSpec(kind="cpu-fake", steps=1, warmup=0), environ={})
    out = Console(record=True, width=80)
    render_report(out, report)
    text = out.export_text()
    assert "2147483647" in text.replace(" ", "").replace("│", "")
    assert "…" not in text


# ---------------------------------------------------------------- the command


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("bench")(bench_command)
    app.command("other")(lambda: None)  # two commands: "bench" stays a subcommand
    return app


runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(_app(), ["bench", *map(str, args)])


@pytest.mark.parametrize("args, needle", [
    (["--tp", "3"], "--tp 3: 128 heads do not split evenly over 3 ranks"),
    (["--layout", "dp3tp5"], "--layout dp3tp5: 128 heads do not split evenly over 5 ranks"),
    (["--model", "longcat-flash", "--tp", "128"], "64 heads do not split evenly"),
    (["--layout", "dp1tp8,dp2tp1"], "same number of GPUs"),
    (["--layout", "dp2tp1", "--dp", "2"], "--layout and --dp/--tp"),
    (["--layout", "dp1tp1", "--tp", "2"], "--layout and --dp/--tp both given"),
    (["--dp", "0"], "--dp"),
    (["--tp", "0"], "--tp: expected at least 1, got 0"),
    (["--ctx", "32q"], "--ctx"),
    (["--kv-mem", "1MiB"], "holds no BF16 request"),
    (["--kv-mem", "lots"], "--kv-mem"),
    (["--mtp", "17"], "--mtp: expected 1..16"),
    (["--mtp", "0"], "--mtp: expected 1..16"),
    (["--steps", "0"], "--steps"),
    (["--heads", "2000"], "--heads: expected 1..1024, got 2000"),
    (["--layers", "5000"], "--layers: expected 1..1024, got 5000"),
    (["--cpu-fake", "--dp", "99999999999999999999"], "CPU ranks, expected at most 64"),
])
def test_cli_argument_errors(args: list[str], needle: str) -> None:
    assert_one_line_error(invoke(*args), needle)


def test_cli_without_gpu_fails_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_line_error(invoke("--ctx", "16k"), "needs CUDA GPUs")
    assert_one_line_error(invoke("--dp", "2", "--tp", "4"), "needs CUDA GPUs")


def test_cli_under_a_launcher_without_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert_one_line_error(invoke("--cpu-fake", "--dp", "2"), "MASTER_ADDR and MASTER_PORT")


@pytest.mark.parametrize("rank", [0, 1])
def test_cli_progress_only_on_rank_0_under_a_launcher(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    from snapmla_cli.cli import bench as bench_cli

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key, value in RENDEZVOUS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(bench_cli, "run_benchmark", lambda *args, **kwargs: None)  # not rank 0's report
    result = invoke("--cpu-fake", "--dp", "2", "--ctx", "1k", "--batch", "2")
    assert result.exit_code == 0, result.output
    assert ("bench: deepseek-v3: 128 heads" in result.stderr) is (rank == 0), result.stderr


def test_a_rank_run_in_this_process_fails_in_one_line_like_a_spawned_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU out of memory (or a rendezvous that timed out under a launcher) on the inline rank:
    the one line and exit code 2 that a spawned rank's failure gets, not an internal error."""
    from snapmla_cli.bench import fake_step

    def out_of_memory(self: object, *args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 44.00 GiB")

    monkeypatch.setattr(fake_step.CpuFakeRunner, "run", out_of_memory)
    assert_one_line_error(invoke("--cpu-fake", "--quiet", "--heads", 8, "--layers", 1, "--ctx", 128, "--batch", 1),
                          "rank 0: OutOfMemoryError: CUDA out of memory. Tried to allocate 44.00 GiB")


def test_cli_quiet_prints_no_progress() -> None:
    args = ("--cpu-fake", "--heads", 8, "--layers", 2, "--ctx", "1k", "--batch", 2, "--steps", 1)
    loud, quiet = invoke(*args), invoke(*args, "--quiet")
    assert loud.exit_code == 0 == quiet.exit_code, loud.output + quiet.output
    assert loud.stderr.count("bench: ") >= 3  # the plan, then one line per timed case
    assert "bench: " not in quiet.stderr and "x same batch" in quiet.stdout
    assert "apart" not in loud.stderr  # one timed step: no rounds to compare
    rounds = invoke("--cpu-fake", "--heads", 8, "--layers", 2, "--ctx", "1k", "--batch", 2, "--steps", 3)
    assert rounds.exit_code == 0 and rounds.stderr.count("% apart)") == 2, rounds.output  # FP8, BF16


def test_cli_refuses_to_overwrite(tmp_path: Path) -> None:
    existing = tmp_path / "r.json"
    existing.write_text("{}")
    assert_one_line_error(invoke("--cpu-fake", "--json", existing), "exists", "--force")
    assert_one_line_error(invoke("--cpu-fake", "--plot", tmp_path / "p.txt"), "--plot")


def test_cli_runs_the_fake_workload_and_writes_json_and_plot(tmp_path: Path) -> None:
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    result = invoke("--cpu-fake", "--quiet", "--heads", 8, "--layers", 2, "--ctx", "1k,2k",
                    "--kv-mem", "1GiB", "--steps", 2, "--json", report, "--plot", plot)
    assert result.exit_code == 0, result.output
    assert "x same batch" in result.stdout and f"wrote {report}" in result.stdout
    doc = json.loads(report.read_text())
    assert [c["context"] for c in doc["comparisons"]] == [1024, 2048]
    assert doc["comparisons"][0]["equal_memory"]["fp8"]["batch"] == budget_batch(GiB, 1024, 2, FP8)
    assert doc["meta"]["argv"][0] == "snapmla" and doc["meta"]["launcher"] == "inline"
    assert doc["meta"]["runner"]["clocks"] == "steady"  # the default: what a busy server gets
    assert "steady clocks" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = invoke("--cpu-fake", "--quiet", "--heads", 8, "--layers", 2, "--ctx", "1k",
                   "--batch", 2, "--steps", 1, "--json", report, "--force")
    assert again.exit_code == 0, again.output
    assert json.loads(report.read_text())["comparisons"][0]["equal_memory"] is None
    burst = invoke("--cpu-fake", "--quiet", "--heads", 8, "--layers", 2, "--ctx", "1k", "--batch", 2,
                   "--steps", 1, "--clocks", "burst", "--json", report, "--force")
    assert burst.exit_code == 0, burst.output
    assert json.loads(report.read_text())["meta"]["runner"]["clocks"] == "burst"
    turbo = invoke("--cpu-fake", "--clocks", "turbo")  # refused by the option's choices (a usage error)
    assert turbo.exit_code == 2 and "'turbo' is not one of 'burst', 'steady'" in " ".join(
        turbo.stderr.replace("│", " ").split()), turbo.output


@pytest.mark.parametrize("model", sorted(PRESETS))
def test_cli_takes_every_preset(model: str) -> None:
    """--model's choices are the presets' names (one table); the report names the preset's stack."""
    preset = PRESETS[model]
    result = invoke("--cpu-fake", "--quiet", "--model", model, "--layers", preset.layers, "--ctx", "1k",
                    "--batch", 2, "--steps", 1)
    assert result.exit_code == 0, result.output
    assert f"{model}: {preset.heads} heads x {preset.layers} MLA layers" in result.stdout


@pytest.mark.parametrize("calls,seconds,per_call,expect_calls", [
    (3, 0.0, 1e-3, 3),      # the call count alone
    (3, 0.2, 1e-3, 3 + 197),  # then the calls that the first batch's rate says fill 0.2 s
    (0, 0.0, 1e-3, 0),      # no warm-up at all
    (0, 0.01, 0.1, 1),      # one long call covers the time
])
def test_warm_up_runs_the_calls_and_the_device_time(monkeypatch, calls, seconds, per_call, expect_calls):
    """The benchmarks' warm-up (bench.timing.warm_up) runs at least `calls` calls and `seconds`
    of device time, so a timing starts in the steady state (docs/PERF.md)."""
    from snapmla_cli.bench import timing

    ran: list[int] = []

    def fake_elapsed(fn, n):
        ran.append(n)
        return n * per_call

    monkeypatch.setattr(timing, "_elapsed", fake_elapsed)
    timing.warm_up(lambda: None, calls, seconds)
    assert sum(ran) == expect_calls
    assert sum(ran) >= calls and sum(ran) * per_call >= seconds


def _fake_timing(monkeypatch, per_call: float) -> tuple[list[float], list[int]]:
    """bench.timing with a fake device: every call takes ``per_call`` seconds; the idle pauses
    and the calls per timed batch are recorded."""
    from snapmla_cli.bench import timing

    slept: list[float] = []
    ran: list[int] = []

    def fake_elapsed(fn, n):
        ran.append(n)
        return n * per_call

    monkeypatch.setattr(timing, "_elapsed", fake_elapsed)
    monkeypatch.setattr(timing.time, "sleep", slept.append)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    return slept, ran


def test_burst_timing_idles_first_and_measures_briefly(monkeypatch):
    """Clocks.BURST sleeps before the warm-up and keeps the measured calls within its device
    time, so a call is timed at the boost clock, before the power cap (docs/PERF.md)."""
    from snapmla_cli.bench import timing

    slept, ran = _fake_timing(monkeypatch, 3e-3)  # a 3 ms decode call
    t = timing.time_cuda(lambda: None, reps=20, warmup=3, clocks=timing.BURST)
    assert slept == [timing.BURST.cooldown_s]
    assert ran == [3, 1] + [1] * 5  # warm-up: 3 calls (9 ms), one more reaches 10 ms; rounds of one call stay in 25 ms
    assert t == pytest.approx(3e-3)
    ran.clear()
    timing.time_cuda(lambda: None, reps=20, warmup=3, clocks=timing.STEADY)
    assert sum(ran[:-5]) * 3e-3 >= timing.STEADY.warmup_s and ran[-5:] == [4] * 5


def test_a_call_too_long_for_the_burst_window_idles_before_every_round(monkeypatch):
    """One 7 ms call a round would take the five rounds past BURST's 25 ms: each round then idles,
    warms with the fewest calls that cover 10 ms, and times one call (a 61-layer bench step); the
    tuner's clocks keep their single window."""
    from snapmla_cli.bench import timing
    from snapmla_cli.tuning.measure import TUNE_CLOCKS

    slept, ran = _fake_timing(monkeypatch, 7e-3)
    t = timing.time_cuda(lambda: None, reps=20, warmup=3, clocks=timing.BURST)
    assert slept == [timing.BURST.cooldown_s] * 6
    assert ran == [3] + [2, 1] * 5 and t == pytest.approx(7e-3)
    _, ran = _fake_timing(monkeypatch, 30e-3)  # longer than the warm-up time: one warm-up call
    timing.time_cuda(lambda: None, reps=20, warmup=3, clocks=timing.BURST)
    assert ran == [3] + [1, 1] * 5
    slept, ran = _fake_timing(monkeypatch, 7e-3)
    timing.time_cuda(lambda: None, reps=20, warmup=3, clocks=TUNE_CLOCKS)
    assert slept == [TUNE_CLOCKS.cooldown_s] and ran[-5:] == [1] * 5


def test_time_cuda_is_the_median_round_with_at_least_one_call_per_round(monkeypatch):
    """Fewer reps than rounds still times one call per round (never 0 calls, a division by 0),
    and the result is the median round, not the fastest."""
    from snapmla_cli.bench import timing

    ran: list[int] = []
    per_call = iter([1e-3, 3e-3, 1e-3, 2e-3, 5e-3, 4e-3])  # the warm-up call, then five rounds

    def fake_elapsed(fn, n):
        ran.append(n)
        return n * next(per_call)

    monkeypatch.setattr(timing, "_elapsed", fake_elapsed)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    t = timing.time_cuda(lambda: None, reps=2, warmup=1, rounds=5)
    assert ran == [1] * 6 and t == pytest.approx(3e-3)


def test_a_minimum_round_time_adds_calls_to_short_rounds_within_the_window(monkeypatch):
    """min_round_s gives a 35 us step's rounds the calls that fill 1 ms (29, not reps / rounds =
    4), under steady clocks and within BURST's window; it never shortens a round, and BURST's
    window still caps a round of 2 ms calls at two."""
    from snapmla_cli.bench import timing

    for clocks in (timing.STEADY, timing.BURST):
        _, ran = _fake_timing(monkeypatch, 35e-6)
        timing.time_cuda_rounds(lambda: None, reps=20, warmup=3, clocks=clocks, min_round_s=1e-3)
        assert ran[-5:] == [29] * 5
        _, ran = _fake_timing(monkeypatch, 35e-6)
        timing.time_cuda_rounds(lambda: None, reps=20, warmup=3, clocks=clocks)
        assert ran[-5:] == [4] * 5
    _, ran = _fake_timing(monkeypatch, 0.5e-3)
    timing.time_cuda_rounds(lambda: None, reps=20, warmup=3, clocks=timing.STEADY, min_round_s=1e-3)
    assert ran[-5:] == [4] * 5
    _, ran = _fake_timing(monkeypatch, 2e-3)
    timing.time_cuda_rounds(lambda: None, reps=20, warmup=3, clocks=timing.BURST, min_round_s=1e-3)
    assert ran[-5:] == [2] * 5


def test_the_rounds_and_their_spread(monkeypatch):
    """time_cuda_rounds keeps every round in the order timed (time_cuda is their median); the
    spread is the slowest over the fastest minus 1, and None where it means nothing."""
    from snapmla_cli.bench import timing

    per_call = iter([1e-3, 3e-3, 1e-3, 2e-3, 5e-3, 4e-3])
    monkeypatch.setattr(timing, "_elapsed", lambda fn, n: n * next(per_call))
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    rounds = timing.time_cuda_rounds(lambda: None, reps=2, warmup=1, rounds=5)
    assert rounds == pytest.approx([3e-3, 1e-3, 2e-3, 5e-3, 4e-3])
    assert timing.round_spread(rounds) == pytest.approx(4.0)
    assert timing.round_spread([2e-3, 2e-3]) == 0.0
    assert timing.round_spread([2e-3]) is None and timing.round_spread([0.0, 1e-3]) is None


def test_a_case_spread_is_its_noisiest_rank_and_a_noisy_one_gets_a_note() -> None:
    """A case shows the largest spread of its ranks (unknown if a rank has none: a report of an
    older version); a measurement whose rounds differ by more than NOISY_SPREAD makes the report
    say which, and the kernel table shows the spread per case."""
    from snapmla_cli.bench.render import kernel_table
    from snapmla_cli.bench.results import NOISY_SPREAD

    layout = Layout(2, 1)
    a, b = replace(_m(0, layout, 0.010), spread=0.004), replace(_m(1, layout, 0.011), spread=0.012)
    assert aggregate(layout, [a, b]).spread == pytest.approx(0.012)
    assert aggregate(layout, [a, replace(b, spread=None)]).spread is None
    assert Measurement.from_dict({k: v for k, v in a.to_dict().items() if k != "spread"}).spread is None
    plan = make_plan(heads=8, layers=2, contexts=[1024], layouts=(layout,), batch=3, kv_mem=None)
    calm = _fake_report(plan)
    assert not any("timed rounds" in n for n in calm.notes)
    noisy_rank = 1
    calm.measurements = [replace(m, spread=0.01) for m in calm.measurements]
    assert not any("timed rounds" in n for n in calm.notes)
    first_bf16 = next(i for i, m in enumerate(calm.measurements) if m.impl == BF16 and m.rank == noisy_rank)
    calm.measurements[first_bf16] = replace(calm.measurements[first_bf16], spread=NOISY_SPREAD + 0.042)
    (note,) = [n for n in calm.notes if "timed rounds" in n]
    assert "1 of 4 measurements" in note and "7.2%" in note and f"bf16 batch 3 on rank {noisy_rank}" in note
    cells = {c.header: list(c.cells) for c in kernel_table(calm).columns}
    assert cells["spread"] == ["7.2%", "1.0%"]


def test_noisy_rounds_of_the_cpu_stand_in_get_no_advice_about_steps() -> None:
    """The note on noisy rounds suggests more --steps for a GPU's; the CPU stand-in's timings
    (--cpu-fake, which caps its steps) are no GPU figures at all, so their note says that instead,
    and a report read back from JSON (which keeps each measurement's kernel) says the same."""
    from snapmla_cli.bench.fake_step import CpuFakeRunner
    from snapmla_cli.bench.results import CPU_FAKE_KERNEL, NOISY_SPREAD, BenchReport

    plan = make_plan(heads=8, layers=2, contexts=[1024], layouts=(Layout(2, 1),), batch=3, kv_mem=None)
    gpu = _fake_report(plan)
    gpu.measurements[0] = replace(gpu.measurements[0], spread=NOISY_SPREAD + 0.042)
    (gpu_note,) = [n for n in gpu.notes if "timed rounds" in n]
    assert "more --steps" in gpu_note and "CPU stand-in" not in gpu_note
    fake = BenchReport(plan, [replace(m, kernel=CPU_FAKE_KERNEL) for m in gpu.measurements])
    for report in (fake, BenchReport(plan, [Measurement.from_dict(m) for m in fake.to_dict()["measurements"]])):
        (note,) = [n for n in report.notes if "timed rounds" in n]
        assert "1 of 4 measurements" in note and "7.2%" in note
        assert "CPU stand-in's wall-clock timings (--cpu-fake), not GPU timings" in note
        assert "--steps" not in note and "rerun" not in note
    from snapmla_cli.bench.worker import StepSpec

    spec = StepSpec(FP8, batch=1, s_q=1, heads=2, context=16, layers=1, seed=0)
    assert CpuFakeRunner(steps=2).run(spec, lambda: None).kernel == CPU_FAKE_KERNEL  # what marks its timings


def test_the_cpu_runner_spec_records_what_the_cpu_runner_runs() -> None:
    """The report's meta.runner is the spec: with --cpu-fake it once said 20 steps, 3 warm-ups
    and graphs where 5, 1 and eager steps ran."""
    spec = RunnerSpec(kind="cpu-fake", steps=20, warmup=3, graphs=True)
    assert (spec.steps, spec.warmup, spec.graphs) == (5, 1, False)
    runner = spec.build(0)
    assert (runner.steps, runner.warmup) == (5, 1)  # type: ignore[attr-defined]
    assert RunnerSpec(kind="gpu", steps=20, warmup=3).steps == 20
    with pytest.raises(SnapmlaError, match="--steps: expected at least 1"):
        RunnerSpec(kind="cpu-fake", steps=0)
