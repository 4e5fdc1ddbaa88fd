"""Context-aware configuration choice: ``get_mla_metadata`` reads the lengths once, looks the
configuration up at their mean (the tuning buckets are per context), and records it for the
returned work list; ``decode_fp8`` / ``decode_bf16`` then run that configuration. CPU only: the
tuning lookup answers for CPU tensors as for a pretend GPU, and the decode launch is replaced by
a probe recording the configuration it was handed."""

from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest
import torch

from snapmla_cli.errors import NoGpuError, SnapmlaError
from snapmla_cli.numerics.formats import FP8_TOKEN_BYTES, PAGE_SIZE
from snapmla_cli.numerics.quant import QuantizedRows
from snapmla_cli.ops import config_choice, decode
from snapmla_cli.ops.decode import (
    choose_config,
    decode_bf16,
    decode_fp8,
    get_mla_metadata,
    metadata_plan,
)
from snapmla_cli.ops.decode_config import DecodeConfig, bf16_kernel, fp8_kernel, heuristic_config
from snapmla_cli.ops.graph_work_list import GraphWorkList
from snapmla_cli.ops.schedule import build_metadata
from snapmla_cli.tuning import lookup
from snapmla_cli.tuning.db import Entry, GpuKey, save_entries
from snapmla_cli.tuning.space import Bucket

GPU = GpuKey("Test GPU X100", 132, (9, 0), 13)
H_Q, S_Q, BATCH = 64, 2, 64
ROWS = H_Q * S_Q
CPU = torch.device("cpu")


def _split_variant(waves: int, min_blocks: int) -> DecodeConfig:
    """The heuristic kernel with another split policy: valid whatever the kernels' current
    constraints, and visible in the work list."""
    base = heuristic_config(ROWS)
    return replace(base, split=replace(base.split, waves=waves, min_blocks_per_split=min_blocks,
                                       auto_balance=False))


C16K, C128K = _split_variant(2, 2), _split_variant(4, 8)


def _entry(context: int, cfg: DecodeConfig) -> Entry:
    return Entry(bucket=Bucket(H_Q, S_Q, (BATCH, BATCH), (context, context), "fp8"), config=cfg,
                 time_us=100.0, default_time_us=120.0, date="2026-12-01",
                 snapmla_version="0.1.0", command="snapmla tune", default_config=heuristic_config(ROWS),
                 kernels="abc123", timed_at={"batch": BATCH, "context": context}, candidates=7)


@pytest.fixture(autouse=True)
def tuned_db(isolated_tuning_dirs, monkeypatch):
    """A user database with two FP8 entries for 128 rows that differ only in the context bucket
    (16k, 128k); the lookup treats CPU tensors as if on that GPU (``_device_index``)."""
    user, _shipped = isolated_tuning_dirs
    monkeypatch.setattr(lookup, "_device_key_hook", lambda index: GPU)
    monkeypatch.setattr(lookup, "_device_index", lambda device: 0)
    lookup.clear_cache(reset_warnings=True)
    save_entries(user, GPU, [_entry(16384, C16K), _entry(131072, C128K)])


def _lens(n: int, batch: int = BATCH) -> torch.Tensor:
    return torch.full((batch,), n, dtype=torch.int32)


def test_context_buckets_give_different_configs():
    assert C16K != C128K and heuristic_config(ROWS) not in (C16K, C128K)
    assert choose_config(ROWS, True, CPU, BATCH, context=16384) == C16K
    assert choose_config(ROWS, True, CPU, BATCH, context=131072) == C128K


def test_metadata_context_reaches_the_lookup(monkeypatch):
    calls: list[dict] = []
    real = lookup.lookup_decode_config

    def spy(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(lookup, "lookup_decode_config", spy)
    get_mla_metadata(torch.tensor([1000, 3000, 0, 4000], dtype=torch.int32), ROWS, 1)
    assert calls[-1]["context"] == 2000.0 and calls[-1]["batch"] == 4
    get_mla_metadata(torch.zeros(0, dtype=torch.int32), ROWS, 1)  # empty batch: context unknown
    assert calls[-1]["context"] is None and calls[-1]["batch"] == 0


def test_metadata_built_for_the_context_config():
    plans = {}
    for ctx, want in ((16384, C16K), (131072, C128K)):
        lens = _lens(ctx)
        meta, splits = get_mla_metadata(lens, ROWS, 1)
        plan = metadata_plan(meta)
        assert plan is not None and plan.config == want and plan.context == float(ctx)
        assert (plan.rows, plan.fp8) == (ROWS, True)
        ref_meta, ref_splits = build_metadata(lens, ROWS, want.block_m, want.split)
        assert torch.equal(meta, ref_meta) and torch.equal(splits, ref_splits)
        plans[ctx] = meta
    assert plans[16384].shape != plans[131072].shape or not torch.equal(plans[16384], plans[131072])
    # an explicit config is what the metadata is built for, and recorded as such
    meta, _ = get_mla_metadata(_lens(16384), ROWS, 1, config=C128K)
    assert metadata_plan(meta).config == C128K


def test_metadata_reads_the_lengths_once(monkeypatch):
    reads = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(tuple(self.shape))
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    get_mla_metadata(_lens(50000), ROWS, 1)
    assert reads == [(BATCH,)]  # one device-to-host read: context and work list share it


def test_metadata_plan_dies_with_the_tensor():
    before = len(config_choice._PLANS)
    meta, _ = get_mla_metadata(_lens(16384), ROWS, 1)
    assert len(config_choice._PLANS) == before + 1
    assert metadata_plan(meta.clone()) is None and metadata_plan("not a tensor") is None
    del meta
    gc.collect()
    assert len(config_choice._PLANS) == before


ARCH_ASKS: list[str] = []  # the kernel sources the probed decode calls checked the GPU for


@pytest.fixture
def launch_probe(monkeypatch):
    """The decode calls run on CPU tensors up to the launch, which records the config instead."""
    seen: list[DecodeConfig] = []
    monkeypatch.setattr(decode, "_require_cuda", lambda t, name, device: None)
    monkeypatch.setattr(decode, "_split_kv_decode", lambda *args: seen.append(args[10]))
    monkeypatch.setattr(decode, "require_arch", lambda source, index: ARCH_ASKS.append(source))
    ARCH_ASKS.clear()
    from snapmla_cli.runtime import tensor_map

    monkeypatch.setattr(tensor_map, "fp8_cache_tensor_maps", lambda cache: cache)
    monkeypatch.setattr(tensor_map, "bf16_cache_tensor_map", lambda cache: cache)
    return seen


def _fp8_inputs():
    q = QuantizedRows(torch.zeros(BATCH, S_Q, H_Q, 512, dtype=torch.uint8),
                      torch.ones(BATCH, S_Q, H_Q, dtype=torch.float32),
                      torch.zeros(BATCH, S_Q, H_Q, 64, dtype=torch.bfloat16))
    cache = torch.zeros(1, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    table = torch.zeros(BATCH, 1, dtype=torch.int32)
    return q, cache, table


def test_decode_runs_the_metadata_config(launch_probe, monkeypatch):
    q, cache, table = _fp8_inputs()
    lens16, lens128 = _lens(16384), _lens(131072)
    meta16, splits16 = get_mla_metadata(lens16, ROWS, 1)
    meta128, splits128 = get_mla_metadata(lens128, ROWS, 1)
    decode_fp8(q, cache, table, lens16, meta16, splits16)
    decode_fp8(q, cache, table, lens128, meta128, splits128)
    assert launch_probe == [C16K, C128K]
    assert ARCH_ASKS == [fp8_kernel(C16K)[0], fp8_kernel(C128K)[0]]  # the GPU is asked for the kernel that runs
    explicit = _split_variant(1, 16)
    decode_fp8(q, cache, table, lens128, meta128, splits128, config=explicit)
    assert launch_probe[-1] == explicit  # an explicit config still wins
    # metadata snapmla did not build (here a copy): today's context-blind choice
    decode_fp8(q, cache, table, lens16, meta16.clone(), splits16)
    assert launch_probe[-1] == choose_config(ROWS, True, CPU, BATCH)

    # FP8-built metadata before a BF16 decode: a BF16 choice, still at the recorded context
    choices = []
    real_choose = config_choice.choose_config

    def spy(*args):
        choices.append(args)
        return real_choose(*args)

    monkeypatch.setattr(config_choice, "choose_config", spy)
    q16 = torch.zeros(BATCH, S_Q, H_Q, 576, dtype=torch.bfloat16)
    cache16 = torch.zeros(1, PAGE_SIZE, 1, 576, dtype=torch.bfloat16)
    decode_bf16(q16, cache16, table, lens128, meta128, splits128)
    assert choices == [(ROWS, False, CPU, BATCH, 131072.0, S_Q)]  # the decode knows its s_q
    assert launch_probe[-1] == heuristic_config(ROWS, False)  # no BF16 entries
    assert ARCH_ASKS[-1] == bf16_kernel(launch_probe[-1])[0]


AUTO_H_Q, AUTO_S_Q = 64, 1


def test_automatic_balance_is_settled_by_the_metadata_and_run_by_the_decode(launch_probe, monkeypatch):
    """The heuristic leaves balanced columns against the split plan to the planner; the metadata
    settles it for its batch (55 requests of 16k at 64 rows: columns; 64: the split plan, as
    measured on the H200), builds that work list, and the decode runs the matching build, also
    when the caller passes the unsettled configuration explicitly, as the tuner does."""
    from snapmla_cli.ops.decode_config import runs_columns, settle_blind

    monkeypatch.setattr(lookup, "lookup_decode_config", lambda **kw: None)  # the heuristic runs
    rows = AUTO_H_Q * AUTO_S_Q
    auto = choose_config(rows, True, CPU, 55, 16384.0)
    assert auto.split.auto_balance and auto == heuristic_config(rows).with_sms(auto.split.num_sms)
    cache = torch.zeros(1, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    for batch, columns in ((55, True), (64, False)):
        lens = _lens(16384, batch)
        meta, splits = get_mla_metadata(lens, rows, 1)
        settled = metadata_plan(meta).config
        assert not settled.split.auto_balance and settled.split.balanced == columns
        assert runs_columns(settled, True) == columns and (meta.shape[1] > 1) == columns
        ref_meta, _ = build_metadata(lens, rows, settled.block_m, settled.split, runs_columns=columns)
        assert torch.equal(meta, ref_meta)
        table = torch.zeros(batch, 1, dtype=torch.int32)
        q_b = QuantizedRows(torch.zeros(batch, AUTO_S_Q, AUTO_H_Q, 512, dtype=torch.uint8),
                            torch.ones(batch, AUTO_S_Q, AUTO_H_Q, dtype=torch.float32),
                            torch.zeros(batch, AUTO_S_Q, AUTO_H_Q, 64, dtype=torch.bfloat16))
        decode_fp8(q_b, cache, table, lens, meta, splits)
        assert launch_probe[-1] == settled
        decode_fp8(q_b, cache, table, lens, meta, splits, config=auto)  # explicit, unsettled
        assert launch_probe[-1] == settled
        # a work list the plan does not know (a copy): the one-item build, which runs any list
        decode_fp8(q_b, cache, table, lens, meta.clone(), splits, config=auto)
        assert launch_probe[-1] == settle_blind(auto) and not runs_columns(launch_probe[-1], True)


@pytest.mark.parametrize(("rows", "columns"), [(16, False), (64, False), (65, True), (128, True), (256, True)])
def test_the_bf16_heuristic_runs_columns_from_two_row_tiles_on(rows: int, columns: bool, monkeypatch):
    """The BF16 wgmma heuristic takes balanced columns once a request needs two or more 64-row
    tiles (what every tuned H200 bucket of 128+ rows chose from 32k on), and the split plan
    below; the metadata builds the matching work list."""
    from snapmla_cli.ops.decode_config import BF16_WGMMA, runs_columns

    monkeypatch.setattr(lookup, "lookup_decode_config", lambda **kw: None)  # the heuristic runs
    cfg = heuristic_config(rows, False, BF16_WGMMA)
    assert cfg.split.balanced == columns and not cfg.split.auto_balance
    assert runs_columns(cfg, False) == columns
    assert heuristic_config(rows, True).split.balanced is False  # FP8 leaves it to the planner
    lens = _lens(16384, 5)
    meta, _ = get_mla_metadata(lens, rows, 1, fp8=False)
    settled = metadata_plan(meta).config
    assert settled.split.balanced == columns
    ref_meta, _ = build_metadata(lens, rows, settled.block_m, settled.split, runs_columns=columns)
    assert torch.equal(meta, ref_meta)


def test_a_repeated_step_gets_its_own_tensors():
    """Steps whose pages per request repeat reuse the planned tables (schedule._work_tables), but
    every call returns fresh tensors: writing into one step's work list changes no other's."""
    first, first_splits = get_mla_metadata(_lens(16384), ROWS, 1)
    second, second_splits = get_mla_metadata(_lens(16383), ROWS, 1)  # the same pages
    assert torch.equal(first, second) and torch.equal(first_splits, second_splits)
    assert first.data_ptr() != second.data_ptr()
    expected = second.clone()
    first.fill_(-7)
    first_splits.fill_(-7)
    third, third_splits = get_mla_metadata(_lens(16384), ROWS, 1)
    assert torch.equal(third, expected) and torch.equal(third_splits, second_splits)
    assert metadata_plan(third).config == metadata_plan(second).config


def test_metadata_device_is_checked():
    lens = _lens(16384)
    meta, _ = get_mla_metadata(lens, ROWS, 1, device="cpu")
    assert meta.device.type == "cpu"
    with pytest.raises(SnapmlaError, match="^device: expected a torch device"):
        get_mla_metadata(lens, ROWS, 1, device="tpu-7")
    if not torch.cuda.is_available():
        with pytest.raises(NoGpuError, match="^device: cuda"):
            get_mla_metadata(lens, ROWS, 1, device="cuda")


def test_graph_work_list_looks_the_configuration_up_at_its_max_context():
    """GraphWorkList without a config: the database's entry at max_context (the tuned buckets
    are per context), settled to the split plan; without max_context the context-blind choice."""
    from snapmla_cli.ops.decode_config import with_balance
    from snapmla_cli.ops.graph_work_list import GraphWorkList

    for ctx, want in ((16384, C16K), (131072, C128K)):
        work = GraphWorkList(BATCH, ROWS, "cpu", max_context=ctx)
        assert work.config == with_balance(want, False)
        assert metadata_plan(work.metadata).requested == want
    blind = GraphWorkList(BATCH, ROWS, "cpu")
    assert metadata_plan(blind.metadata).requested == choose_config(ROWS, True, CPU, BATCH)


def test_s_q_picks_the_entry_of_its_own_shape(isolated_tuning_dirs):
    """h_q 128 s_q 1 has the rows of the database's h_q 64 s_q 2: given s_q, get_mla_metadata
    and GraphWorkList take the entry of the caller's own shape; without it the rows decide."""
    from snapmla_cli.ops.graph_work_list import GraphWorkList

    user, _ = isolated_tuning_dirs
    own = _split_variant(3, 4)
    save_entries(user, GPU, [replace(_entry(16384, own), bucket=Bucket(128, 1, (BATCH, BATCH), (16384, 16384), "fp8"))])
    lookup.clear_cache()
    lens = _lens(16384)
    assert metadata_plan(get_mla_metadata(lens, ROWS, 1, s_q=1)[0]).requested == own
    assert metadata_plan(get_mla_metadata(lens, ROWS, 1, s_q=2)[0]).requested == C16K
    assert metadata_plan(get_mla_metadata(lens, ROWS, 1)[0]).requested == own  # h128-s1 sorts first
    assert metadata_plan(GraphWorkList(BATCH, ROWS, "cpu", max_context=16384, s_q=2).metadata).requested == C16K
    for bad in (0, 3, 1.0, True, torch.tensor(2), torch.tensor(2.0), torch.tensor([1, 2])):
        with pytest.raises(SnapmlaError, match="^s_q: expected the query tokens per request"):
            get_mla_metadata(lens, ROWS, 1, s_q=bad)
    with pytest.raises(SnapmlaError, match="^s_q: expected"):
        GraphWorkList(BATCH, ROWS, "cpu", s_q=5)


@pytest.mark.parametrize("lengths,rows,needle", [
    ([1, 2], ROWS, "^cache_seqlens: expected a torch.Tensor, got list"),
    (torch.tensor([1, 2], dtype=torch.int32), 16.0, "^num_heads_per_head_k: expected an integer"),
    (torch.tensor([1, 2], dtype=torch.int32), True, "^num_heads_per_head_k: expected an integer"),
    (torch.tensor([1, 2], dtype=torch.int32), 0, r"^num_heads_per_head_k: expected 1 <= s_q \* h_q"),
    (torch.tensor([1, 2], dtype=torch.int32), 2**63, r"^num_heads_per_head_k: expected 1 <= s_q \* h_q <= 2147483647"),
])
def test_get_mla_metadata_bad_arguments_are_one_line_errors(lengths, rows, needle):
    with pytest.raises(SnapmlaError, match=needle):
        get_mla_metadata(lengths, rows, 1)


def test_flash_mla_with_kvcache_names_a_host_q():
    """The FP8 path quantizes q first: a CPU q is reported as q, not as the quantizer's output."""
    meta, splits = get_mla_metadata(torch.tensor([100, 10], dtype=torch.int32), 16, 1)
    q = torch.randn(2, 1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    with pytest.raises(NoGpuError, match="^q: expected a CUDA tensor"):
        decode.flash_mla_with_kvcache(q, cache, torch.zeros(2, 2, dtype=torch.int32),
                                      torch.tensor([100, 10], dtype=torch.int32), 512, meta, splits)


def test_host_tensors_with_the_checks_switch_on_are_named_not_a_torch_error():
    """With SNAPMLA_CHECK_FINITE on, the block-table check ran before the device check and asked
    a CPU-only torch whether a stream was capturing (a RuntimeError deep in torch)."""
    from snapmla_cli.ops.finite import GPU_CHECKS, set_gpu_checks

    before = GPU_CHECKS.on
    meta, splits = get_mla_metadata(torch.tensor([100, 10], dtype=torch.int32), 16, 1)
    lens = torch.tensor([100, 10], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q8 = QuantizedRows(torch.zeros(2, 1, 16, 512, dtype=torch.uint8), torch.ones(2, 1, 16),
                       torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16))
    set_gpu_checks(True)
    try:
        with pytest.raises(NoGpuError, match="expected a CUDA tensor"):
            decode_fp8(q8, torch.zeros(4, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8), table, lens, meta, splits)
        with pytest.raises(NoGpuError, match="expected a CUDA tensor"):
            decode_bf16(torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16),
                        torch.zeros(4, PAGE_SIZE, 1, 576, dtype=torch.bfloat16), table, lens, meta, splits)
    finally:
        set_gpu_checks(before)


def test_flash_mla_with_kvcache_refuses_another_value_head_dim():
    """``head_dim_v`` is FlashMLA's value width: anything but 512 (e.g. the 576 of the keys) is
    refused by name before any tensor is looked at, not reported as a host tensor."""
    lens = torch.tensor([100, 10], dtype=torch.int32)
    meta, splits = get_mla_metadata(lens, 16, 1)
    q = torch.randn(2, 1, 16, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cache = torch.randn(4, PAGE_SIZE, 1, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with pytest.raises(SnapmlaError, match="^head_dim_v: expected 512, got 576"):
        decode.flash_mla_with_kvcache(q, cache, torch.zeros(2, 2, dtype=torch.int32), lens, 576, meta, splits)


def test_decode_bf16_names_a_q_of_the_wrong_rank():
    """A 5-D q is refused as q with its shape (one line), not as a ValueError from unpacking."""
    lens = torch.tensor([100, 10], dtype=torch.int32)
    meta, splits = get_mla_metadata(lens, 16, 1, fp8=False)
    q = torch.randn(2, 1, 16, 1, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    cache = torch.randn(4, PAGE_SIZE, 1, 576, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with pytest.raises(SnapmlaError, match=r"^q: expected \[b, s_q, h_q, 576\], got \[2, 1, 16, 1, 576\]"):
        decode_bf16(q, cache, torch.zeros(2, 2, dtype=torch.int32), lens, meta, splits)


def test_metadata_of_other_rows_gets_a_fresh_choice_for_the_decode_rows():
    """A work list built for 128 rows handed to a 16-row decode: the decode takes its own rows'
    configuration (row tile 16), never the 128-row plan's 64-row tile."""
    meta, _ = get_mla_metadata(_lens(16384), ROWS, 1)
    assert metadata_plan(meta).config.block_m == 64
    cfg = config_choice.decode_config_for(None, meta, 16, True, CPU, BATCH)
    assert cfg.block_m == 16 and cfg.block_m == heuristic_config(16).block_m


def test_metadata_built_elsewhere_settles_an_automatic_balance_blind():
    """A work list snapmla did not build: the decode cannot know the batch, so an automatic
    balance (the heuristic's at 16 rows, which no tuned entry is near) is settled to the split plan's one-item build."""
    auto = heuristic_config(16)
    assert auto.split.auto_balance
    foreign = build_metadata(torch.tensor([300, 5000], dtype=torch.int32), 16, auto.block_m, auto.split)[0]
    cfg = config_choice.decode_config_for(None, foreign, 16, True, CPU, 2)
    assert not cfg.split.auto_balance and not cfg.split.balanced


def test_flashmla_later_metadata_arguments_are_taken(monkeypatch):
    """FlashMLA's later get_mla_metadata(cache_seqlens, s_q*h_q, h_k, num_heads_q, is_fp8_kvcache,
    topk): num_heads_q gives s_q to the configuration choice, is_fp8_kvcache picks the format,
    topk (sparse attention) is refused; each bad value is a one-line error naming it."""
    asked: list[tuple] = []
    real = decode.choose_config
    monkeypatch.setattr(decode, "choose_config", lambda *args: asked.append(args) or real(*args))
    lens = torch.tensor([300, 5000], dtype=torch.int32)
    meta, _ = get_mla_metadata(lens, 32, 1, 16, False)  # positional, as FlashMLA's callers pass them
    assert asked[-1][0] == 32 and asked[-1][-1] == 2 and asked[-1][1] is False  # rows, s_q = 32 / 16, BF16
    assert decode.metadata_plan(meta).fp8 is False
    meta, _ = get_mla_metadata(lens, 32, 1, is_fp8_kvcache=True, s_q=4)
    assert decode.metadata_plan(meta).fp8 is True and asked[-1][-1] == 4
    assert decode.metadata_plan(get_mla_metadata(lens, 16, 1)[0]).fp8 is True  # neither given: FP8
    get_mla_metadata(lens, 32, 1, num_heads_q=np.int64(16))  # NumPy ints, as for the rows and s_q
    assert asked[-1][-1] == 2
    for kwargs, needle in [
        ({"num_heads_q": 3}, r"^num_heads_q: expected a positive divisor of num_heads_per_head_k \(32"),
        ({"num_heads_q": 0}, "^num_heads_q: expected a positive divisor"),
        ({"num_heads_q": 16, "s_q": 1}, r"^s_q: 1 disagrees with num_heads_q 16 \(32 rows = 2 x 16\)"),
        ({"is_fp8_kvcache": "yes"}, "^is_fp8_kvcache: expected True or False"),
        ({"is_fp8_kvcache": True, "fp8": False}, "^is_fp8_kvcache: True disagrees with fp8=False"),
        ({"topk": 2048}, "^topk: sparse attention is not supported"),
        ({"num_heads_k": torch.tensor([1, 1])}, "^num_heads_k: expected 1"),
        ({"num_heads_k": True}, "^num_heads_k: expected 1"),
        ({"num_heads_q": 16, "s_q": torch.tensor([1, 1])}, "^s_q: expected the query tokens per request"),
        ({"num_heads_q": 16, "s_q": 2.0}, "^s_q: expected the query tokens per request"),
    ]:
        with pytest.raises(SnapmlaError, match=needle):
            get_mla_metadata(lens, 32, **{"num_heads_k": 1, **kwargs})
    # FlashMLA's later name for the rows (num_q_tokens_per_head_k): the same plan; one name only
    by_new_name, _ = get_mla_metadata(lens, num_q_tokens_per_head_k=32, num_heads_k=1)
    assert torch.equal(by_new_name, get_mla_metadata(lens, 32, 1)[0])
    for args, kwargs in [((lens, 32), {"num_q_tokens_per_head_k": 32}), ((lens,), {})]:
        with pytest.raises(SnapmlaError, match="^num_heads_per_head_k: expected the rows s_q \\* h_q, given once"):
            get_mla_metadata(*args, **kwargs)


def test_flashmla_later_decode_forms_are_named():
    """flash_mla_with_kvcache's later keywords: is_fp8_kvcache must agree with the cache's dtype,
    the sparse-attention keywords and the lazily planned FlashMLASchedMeta (num_splits None) get
    one-line errors, not Python TypeErrors; None for a sparse keyword is accepted."""
    lens = torch.tensor([100, 10], dtype=torch.int32)
    meta, splits = get_mla_metadata(lens, 16, 1)
    table = torch.zeros(2, 2, dtype=torch.int32)
    q = torch.randn(2, 1, 16, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    bf16_cache = torch.zeros(4, PAGE_SIZE, 1, 576, dtype=torch.bfloat16)
    fp8_cache = torch.zeros(4, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    call = decode.flash_mla_with_kvcache
    with pytest.raises(SnapmlaError, match="^is_fp8_kvcache: True disagrees with k_cache's dtype bfloat16"):
        call(q, bf16_cache, table, lens, 512, meta, splits, is_fp8_kvcache=True)
    with pytest.raises(SnapmlaError, match="^is_fp8_kvcache: False disagrees with k_cache's dtype uint8"):
        call(q, fp8_cache, table, lens, 512, meta, splits, is_fp8_kvcache=False)
    with pytest.raises(SnapmlaError, match="^indices: sparse attention is not supported"):
        call(q, fp8_cache, table, lens, 512, meta, splits, indices=torch.zeros(2, 1, 2048, dtype=torch.int32))
    with pytest.raises(SnapmlaError, match="^attn_sink: sparse attention is not supported"):
        call(q, fp8_cache, table, lens, 512, meta, splits, attn_sink=torch.zeros(16))
    with pytest.raises(SnapmlaError, match="^indices: sparse attention is not supported"):  # by position
        call(q, fp8_cache, table, lens, 512, meta, splits, None, False, None, torch.zeros(2, 1, 64, dtype=torch.int32))
    with pytest.raises(SnapmlaError, match=r"^head_dim_v: expected 512, got tensor\(\[512, 512\]\)"):
        call(q, fp8_cache, table, lens, torch.tensor([512, 512]), meta, splits)
    with pytest.raises(SnapmlaError, match="^tile_scheduler_metadata: expected the .* tensors of snapmla's "
                                           "get_mla_metadata.*got object and num_splits=NoneType"):
        call(q, fp8_cache, table, lens, 512, object(), None)
    with pytest.raises(SnapmlaError, match="^tile_scheduler_metadata: expected the"):
        call(q, fp8_cache, table, lens, 512, meta, None)
    with pytest.raises(SnapmlaError, match="^tile_scheduler_metadata: expected the"):  # num_splits left out
        call(q, fp8_cache, table, lens, 512, meta)
    # FlashMLA's FP8 variant's per-tensor scales: a one-line refusal, not a TypeError
    for name in ("descale_q", "descale_k"):
        with pytest.raises(SnapmlaError, match=f"^{name}: per-tensor FP8 scales are not supported"):
            call(q, fp8_cache, table, lens, 512, meta, splits, **{name: torch.ones(1)})
    # the flag agreeing and the sparse keywords None: on to the next check (a host q)
    with pytest.raises(NoGpuError, match="^q: expected a CUDA tensor"):
        call(q, fp8_cache, table, lens, 512, meta, splits, is_fp8_kvcache=True, indices=None, topk_length=None)


def test_a_gpu_index_past_the_machines_gpus_is_named(monkeypatch):
    """device="cuda:7" on a machine of one GPU: a one-line error, not torch's AssertionError
    ("Invalid device id") from deep inside the first copy."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SnapmlaError, match=r"^device: cuda:7 requested, but this machine has 1 CUDA GPU\(s\)"):
        get_mla_metadata(torch.tensor([100, 10], dtype=torch.int32), 16, 1, device="cuda:7")
    with pytest.raises(SnapmlaError, match="^device: cuda:7 requested"):
        GraphWorkList(2, 16, "cuda:7")


def test_a_warm_up_call_does_not_use_up_the_fp8_layout_check(monkeypatch):
    """An engine's warm-up (all lengths 0) or a call on a freshly zeroed cache reads nothing to
    judge by: it once marked the cache checked, and V3.2 tokens written later went unseen."""
    from snapmla_cli.ops import encoding_check

    monkeypatch.setattr(encoding_check, "_checkable", lambda *args: True)  # (a CPU cache stands in)
    monkeypatch.setattr(encoding_check, "_checked", set())
    cache = torch.zeros(2, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    encoding_check.check_snapmla_encoding_once(cache, table, torch.tensor([0, 0], dtype=torch.int32))
    encoding_check.check_snapmla_encoding_once(cache, table, torch.tensor([3, 1], dtype=torch.int32))
    assert not encoding_check._checked
    cache[1, 0, 520] = 1  # a V3.2 token written after the warm-up
    cache[1, 0, 0] = 0x38
    with pytest.raises(SnapmlaError, match="^k_cache: request 1 reads token 0 with nonzero pad bytes"):
        encoding_check.check_snapmla_encoding_once(cache, table, torch.tensor([3, 1], dtype=torch.int32))


def test_graph_work_list_batch_beyond_int32_is_refused():
    with pytest.raises(SnapmlaError, match="^batch: expected 1..2147483646 requests"):
        GraphWorkList(2**40, 16, "cpu")


def test_flashmla_fp8_flag_checks_each_caches_encoding_once(monkeypatch):
    """With FlashMLA's is_fp8_kvcache the cache may well be its DeepSeek-V3.2 layout (the same
    656 bytes, extra scales in SnapMLA's zero pad bytes): the first token of each request's first
    page is checked, once per cache; a request with no tokens or a page index outside the cache
    is skipped (the decode's own checks name those)."""
    from snapmla_cli.ops import encoding_check
    from snapmla_cli.ops.prep import append_kv

    monkeypatch.setattr(encoding_check, "_checkable", lambda *args: True)  # (a CPU cache stands in)
    monkeypatch.setattr(encoding_check, "_checked", set())
    cache = torch.zeros(4, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    kv = torch.randn(4 * PAGE_SIZE, 576, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    append_kv(kv, torch.arange(4 * PAGE_SIZE, dtype=torch.int32), cache)
    table = torch.tensor([[2, 0], [1, 3], [9, 9]], dtype=torch.int32)  # request 2: a page past the cache
    lens = torch.tensor([70, 5, 3], dtype=torch.int32)
    bad = cache.clone()
    bad[3, 0, 516:528] = 0x3F  # a page no request starts on: not read by this check
    encoding_check.check_snapmla_encoding_once(bad, table, lens)
    bad = cache.clone()
    bad[1, 0, 520] = 1  # request 1's first token
    with pytest.raises(SnapmlaError, match="^k_cache: request 1 reads token 0 with nonzero pad bytes 516..527"):
        encoding_check.check_snapmla_encoding_once(bad, table, lens)
    encoding_check.check_snapmla_encoding_once(bad, table, torch.tensor([70, 0, 3], dtype=torch.int32))  # empty
    encoding_check.check_snapmla_encoding_once(cache, table, lens)
    cache[1, 0, 520] = 1
    encoding_check.check_snapmla_encoding_once(cache, table, lens)  # checked once already: no second read
    # a checked cache costs a replayed call one lookup, not the arguments' shape tests
    monkeypatch.setattr(encoding_check, "_checkable", lambda *args: pytest.fail("a checked cache was re-examined"))
    encoding_check.check_snapmla_encoding_once(cache, table, lens)
