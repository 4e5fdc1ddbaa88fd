"""Tuning: search space, budget, YAML database (round trip, merge, atomic writes, bad files),
nearest-bucket lookup, the search loop with injected timing/correctness, resume, and
``snapmla tune --dry-run``. CPU only and fast; one GPU-marked end-to-end run at the end."""

from __future__ import annotations

import json
import pathlib
import re
import warnings
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import typer
from typer.testing import CliRunner

from snapmla_cli.cli.tune import _line, tune_command
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.ops import decode_config as dc
from snapmla_cli.ops.decode_config import DecodeConfig, heuristic_config
from snapmla_cli.ops.schedule import SplitPolicy
from snapmla_cli.sizes import parse_int_list
from snapmla_cli.tuning import db as tdb
from snapmla_cli.tuning import describe_database, lookup
from snapmla_cli.tuning.db import Entry, GpuKey, load_file, normalise_gpu_name, save_entries
from snapmla_cli.tuning.space import (
    FP8_VERSIONS,
    ROPE_RINGS,
    SMEM_PER_SM,
    SMEM_RESERVED_PER_CTA,
    Bucket,
    Budget,
    SearchSpace,
    config_id,
    config_problem,
    default_config,
    kernel_variants,
    max_row_groups,
    parse_budget,
    parse_formats,
    parse_ranges,
    same_kernel,
    search_space,
    seeded,
    smem_bytes,
    split_policies,
)
from snapmla_cli.tuning.tuner import (
    CheckResult,
    EntryInfo,
    FatalMeasureError,
    PartialStore,
    Tuner,
    partial_path,
)

GPU = GpuKey("Test GPU X100", 132, (9, 0), 13)
CTX = [(16384, 16384), (65536, 65536), (131072, 131072)]


@pytest.fixture(autouse=True)
def isolated_db(isolated_tuning_dirs, monkeypatch):
    """User folder and shipped folder both under tmp_path; fresh lookup state; this GPU is GPU."""
    monkeypatch.setattr(lookup, "_device_key_hook", lambda index: GPU)
    return isolated_tuning_dirs


def entry(h_q=64, s_q=2, batch=(64, 64), context=(16384, 16384), fmt="fp8", t=100.0,
          cfg: DecodeConfig | None = None, default_t=120.0) -> Entry:
    rows = h_q * s_q
    cfg = cfg or heuristic_config(rows, fmt == "fp8")
    return Entry(bucket=Bucket(h_q, s_q, batch, context, fmt), config=cfg, time_us=t,
                 default_time_us=default_t, date="2026-12-01", snapmla_version="0.1.0",
                 command="snapmla tune --heads 64 --mtp 2", default_config=heuristic_config(rows),
                 kernels="abc123", timed_at={"batch": batch[0], "context": context[0]},
                 candidates=7)


# Valid non-default FP8 configurations for 128 rows (whatever the kernels currently accept).
VARIANTS = [c for c in kernel_variants(128, "fp8")[0]
            if replace(c, split=heuristic_config(128).split) != heuristic_config(128)]


def alt_config(i: int = 3) -> DecodeConfig:
    cfg = replace(VARIANTS[i], split=heuristic_config(128).split)
    assert config_problem(cfg, "fp8") is None
    return cfg


# ---------------------------------------------------------------------------------------------
# names, parsing, budget


@pytest.mark.parametrize("name,stem", [
    ("NVIDIA H200", "NVIDIA_H200"),
    ("  NVIDIA   H100 80GB HBM3 ", "NVIDIA_H100_80GB_HBM3"),
    ("NVIDIA GeForce RTX 4090 (laptop)", "NVIDIA_GeForce_RTX_4090_laptop"),
    ("a/b\\..c-d_e", "abc-d_e"),
    ("", "unknown_gpu"),
])
def test_gpu_name_normalisation(name, stem):
    assert normalise_gpu_name(name) == stem
    assert tdb.db_filename(name) == stem + ".yaml"


def test_budget_parsing():
    assert parse_budget("120s") == Budget(seconds=120.0)
    assert parse_budget("2m") == Budget(seconds=120.0)
    assert parse_budget("1.5min") == Budget(seconds=90.0)
    assert parse_budget(" 40 ") == Budget(count=40)
    assert [str(b) for b in (Budget(seconds=90.0), Budget(count=1), Budget(count=40), Budget())] == [
        "90s per bucket", "1 candidate per bucket", "40 candidates per bucket", "no limit per bucket"]
    for bad in ("", "abc", "0", "0s", "1.5", "-3s", "10h"):
        with pytest.raises(SnapmlaError, match="--budget"):
            parse_budget(bad)


def test_range_and_list_parsing():
    assert parse_ranges("64", "--batch") == [(64, 64)]
    assert parse_ranges("1,8,64", "--batch") == [(1, 1), (8, 8), (64, 64)]
    assert parse_ranges("16-128", "--batch") == [(16, 128)]
    assert parse_ranges("16k,32k-64k", "--ctx") == [(16384, 16384), (32768, 65536)]
    assert parse_ranges(" 8 , 16 - 32 ", "--batch") == [(8, 8), (16, 32)]  # whitespace around an item is allowed
    for bad, position in (("64,", "2 of 2"), ("8, ,16", "2 of 3"), (",64", "1 of 2")):  # an empty item is no range
        with pytest.raises(SnapmlaError, match=f"^--batch: .* has an empty item \\(item {position}; expected e.g. 64,"):
            parse_ranges(bad, "--batch")
    with pytest.raises(SnapmlaError, match="^--heads: 16 given twice$"):
        parse_int_list("16,64,16", "--heads", 1024)
    assert parse_formats("both") == ["fp8", "bf16"] and parse_formats("BF16") == ["bf16"]
    for bad, why in (("128-16", "range '128-16' runs backwards"),
                     ("", r"'' is empty \(expected e.g. 64, 1,8,64 or 16-128\)"),
                     ("x", r"'x' is not a size \(expected e.g. 2048, 32k or 1m\)"),
                     ("0", "'0' must be at least 1")):
        with pytest.raises(SnapmlaError, match=f"^--batch: {why}$"):
            parse_ranges(bad, "--batch")
    with pytest.raises(SnapmlaError, match="^--format: expected fp8, bf16 or both, got 'fp4'$"):
        parse_formats("fp4")
    b = Bucket(64, 2, (16, 128), (16384, 16384), "fp8")
    assert b.timed_batch == 45 and b.timed_context == 16384 and b.rows == 128
    assert b.id == "h64-s2-b16_128-c16384-fp8"


def test_repeated_ranges_are_refused_and_timing_points_round_to_nearest() -> None:
    """`--batch 64,64` would tune (and time) the same bucket twice, and is most often a typo:
    refused, in any spelling of the range; overlapping ranges are distinct buckets. A bucket's
    timed point is the geometric middle rounded to the nearest integer (sqrt(1 * 8) = 2.83 -> 3,
    not 2)."""
    with pytest.raises(SnapmlaError, match="^--batch: 64 given twice$"):
        parse_ranges("64,16-128,64", "--batch")
    with pytest.raises(SnapmlaError, match=r"^--batch: 64 given twice \('64' and '64-64'\)$"):
        parse_ranges("64, 64-64", "--batch")
    with pytest.raises(SnapmlaError, match=r"^--ctx: 16384-32768 given twice \('16k-32k' and '16384 - 32768'\)$"):
        parse_ranges("16k-32k,16384 - 32768", "--ctx")
    assert parse_ranges("16-128,64,64-128", "--batch") == [(16, 128), (64, 64), (64, 128)]
    assert Bucket(64, 1, (1, 8), (16384, 16384), "fp8").timed_batch == 3
    assert Bucket(64, 1, (1, 2), (1000, 3000), "fp8").timed_context == 1732


# ---------------------------------------------------------------------------------------------
# search space


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("rows", [16, 20, 128])
def test_search_space_pruned_by_shared_memory(fmt, rows):
    valid, pruned = kernel_variants(rows, fmt)
    assert valid and pruned
    for cfg in valid:
        smem = smem_bytes(cfg, fmt)
        assert smem <= dc.MAX_SMEM_PER_CTA
        assert cfg.min_ctas_per_sm * (smem + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM
        assert cfg.row_groups * 16 <= max(16, -(-rows // 16) * 16)
    over = [cfg for cfg, _ in pruned if smem_bytes(cfg, fmt) > dc.MAX_SMEM_PER_CTA]
    assert over, "some combination must exceed the per-CTA limit"
    assert all(cfg not in valid for cfg in over)
    if rows == 16:
        assert {c.row_groups for c in valid} == {1}
    space = search_space(Bucket(rows // 2 or 1, 2, (64, 64), (32768, 32768), fmt), 132)
    assert space.candidates[0] == space.default == heuristic_config(space.bucket.rows, fmt == "fp8").with_sms(132)
    ids = space.ids()
    assert len(ids) == len(set(ids))
    assert all(config_problem(c, fmt) is None for c in space.candidates[1:])


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_pruned_variants_count_by_rule(fmt):
    """`tune --dry-run` counts the pruned variants by the rule they break: one wording per rule
    (with its limit, not the variant's numbers), while each problem's text keeps the variant's
    own numbers for a single configuration's error message."""
    _, pruned = kernel_variants(128, fmt)
    rules = {why.rule for _, why in pruned}
    assert 1 < len(rules) <= 7, rules
    per_cta = f"shared memory > {dc.MAX_SMEM_PER_CTA} B per CTA"
    assert per_cta in rules
    over = [(cfg, why) for cfg, why in pruned if why.rule == per_cta]
    assert len(over) > 1 and len({str(why) for _, why in over}) > 1
    for cfg, why in over:
        smem = smem_bytes(cfg, fmt)
        assert str(why) == f"shared memory {smem} B > {dc.MAX_SMEM_PER_CTA} B per CTA"
    per_sm = [(cfg, why) for cfg, why in pruned if str(SMEM_PER_SM) in why.rule]
    assert per_sm and {why.rule for _, why in per_sm} == {
        f"CTAs x (shared memory + {SMEM_RESERVED_PER_CTA} B) > {SMEM_PER_SM} B per SM"}
    assert all(str(why).startswith(f"{cfg.min_ctas_per_sm} CTAs x {smem_bytes(cfg, fmt)} B")
               for cfg, why in per_sm)


def test_kernel_versions_and_wgmma_switches():
    """The FP8 space covers both kernel versions, the wgmma kernel always with float32
    promotion (unpromoted fails verify); the switches exist only on the wgmma kernel, appear in
    the candidate name, and config files keep them within their allowed values."""
    valid, _ = kernel_variants(64, "fp8")
    assert {c.kernel_version for c in valid} == set(FP8_VERSIONS) == {dc.FP8_WGMMA, dc.FP8_MMA_SYNC}
    wgmma = [c for c in valid if c.wgmma]
    # own rows and ping-pong lost everywhere; dims split and alternate pages each win somewhere;
    # rows = M only at 64-row tiles; the V^T experiment is never searched
    assert {c.wg_mode for c in wgmma} == {dc.WG_DIMS_SPLIT, dc.WG_ALT_PAGES, dc.WG_ALT_ROWS_M}
    assert {c.row_groups for c in wgmma if c.wg_mode in dc.WG_ROWS_M_MODES} == {4}
    assert all(c.qk_promote == c.pv_promote == 1 for c in wgmma)
    v3 = DecodeConfig(row_groups=4, stages=4, kernel_version=dc.FP8_WGMMA)
    assert (v3.qk_promote, v3.pv_promote) == (1, 1)  # the defaults
    assert dc.fp8_config_valid(v3) and dc.fp8_config_valid(replace(v3, wg_mode=dc.WG_PINGPONG))
    assert config_id(replace(v3, wg_mode=dc.WG_PINGPONG), "fp8").startswith("v3-rg4-wp-st4")
    unpromoted = replace(v3, qk_promote=0, wg_mode=0)
    assert config_id(unpromoted, "fp8").startswith("v3-rg4-wd-pq0v1-st4")
    defines = dc.fp8_defines(unpromoted)
    assert (defines["QK_PROMOTE"], defines["PV_PROMOTE"], defines["WG_MODE"]) == (0, 1, 0)
    v2 = replace(v3, kernel_version=dc.FP8_MMA_SYNC, stages=2)
    assert dc.fp8_config_valid(v2) and not dc.fp8_config_valid(replace(v2, wg_mode=dc.WG_PINGPONG))
    assert not dc.fp8_config_valid(replace(v3, qk_promote=2))
    assert not dc.fp8_config_valid(replace(v3, wg_mode=5))
    rows_m = replace(v3, wg_mode=dc.WG_ALT_ROWS_M)  # four pages fit: no statistics exchange
    assert dc.fp8_config_valid(rows_m) and not dc.fp8_config_valid(replace(v3, wg_mode=dc.WG_ALT_PAGES))
    assert not dc.fp8_config_valid(replace(rows_m, row_groups=2))
    assert config_id(rows_m, "fp8").startswith("v3-rg4-wm-st4")
    rows_m_vt = replace(v3, wg_mode=dc.WG_ROWS_M_VT)  # V^T in place in the stages: four still fit
    assert dc.fp8_config_valid(rows_m_vt) and not dc.fp8_config_valid(replace(rows_m_vt, row_groups=2))
    assert config_id(rows_m_vt, "fp8").startswith("v3-rg4-wv-st4")
    assert tdb.config_from_dict(tdb.config_to_dict(unpromoted)) == unpromoted
    data = tdb.config_to_dict(v3)
    with pytest.raises(ValueError, match=r"qk_promote must be one of \(0, 1\)"):
        tdb.config_from_dict({**data, "qk_promote": 2})
    with pytest.raises(ValueError, match="wg_mode must be one of"):
        tdb.config_from_dict({**data, "wg_mode": -1})
    old = {k: v for k, v in data.items() if k not in ("kernel_version", "qk_promote", "pv_promote", "wg_mode")}
    assert tdb.config_from_dict(old).kernel_version == dc.FP8_MMA_SYNC  # pre-wgmma entries


@pytest.mark.parametrize("rows", [1, 16, 32, 48])
def test_bf16_wgmma_tile_is_never_narrowed(rows):
    """The BF16 wgmma kernel pads any row count to its 64-row tile: a database entry holding it
    is used as stored below 64 rows, not narrowed into a tile the kernel refuses (which made the
    lookup fall back to the heuristic); the mma.sync kernel is still narrowed."""
    wgmma = heuristic_config(rows, False, dc.BF16_WGMMA)
    assert wgmma.row_groups == 4
    assert lookup.adapt_config(wgmma, rows, "bf16") == wgmma
    mma = heuristic_config(64, False, dc.BF16_MMA_SYNC)
    assert lookup.adapt_config(mma, rows, "bf16").row_groups == max_row_groups(rows)


@pytest.mark.parametrize("mode", [dc.WG_ALT_ROWS_M, dc.WG_ROWS_M_VT])
def test_rows_m_entries_narrow_to_alternate_pages(mode):
    """A stored rows = M entry (64-row tiles only) asked for 32 rows becomes alternate pages at
    two row groups, a launchable tile, instead of falling back to the heuristic."""
    stored = replace(heuristic_config(64, True, dc.FP8_WGMMA), wg_mode=mode)
    assert dc.fp8_config_valid(stored)
    narrowed = lookup.adapt_config(stored, 32, "fp8")
    assert narrowed is not None
    assert (narrowed.row_groups, narrowed.wg_mode) == (2, dc.WG_ALT_PAGES)
    assert lookup.adapt_config(stored, 64, "fp8") == stored


def test_split_policies_keep_one_per_ctas_times_waves() -> None:
    """The scheduler reads only ctas_per_sm * waves, so the fixed policies hold one
    representative per product and minimum split length (the others would time the same plan)."""
    kernel = heuristic_config(128)
    fixed = [p for p in split_policies(kernel, kernel.split) if not (p.balanced or p.auto_balance)]
    keys = [(p.ctas_per_sm * p.waves, p.min_blocks_per_split) for p in fixed]
    assert len(keys) == len(set(keys))
    assert {product for product, _ in keys} == {1, 2, 4}


def test_search_space_drops_split_aliases():
    big = search_space(Bucket(64, 2, (64, 64), (131072, 131072), "fp8"), 132)
    small = search_space(Bucket(64, 2, (1, 1), (4096, 4096), "fp8"), 132)
    assert big.aliases > 0
    # a single short request is where min_blocks_per_split matters: more distinct plans
    assert len(small.candidates) > len(big.candidates)


def test_automatic_balance_leads_the_space_and_settles_at_the_timed_shape():
    """The heuristic's policy (the planner's choice of balanced columns or the split plan) is the
    default candidate; the fixed policy it settles to at the timed shape is its alias, so an
    entry keeps the automatic policy unless another candidate beats it; it round-trips through
    the database file."""
    from snapmla_cli.tuning.space import settled_at, split_policies

    kernel = heuristic_config(128)
    assert kernel.split.auto_balance
    policies = split_policies(kernel, kernel.split, True)
    assert policies[0].auto_balance and sum(p.auto_balance for p in policies) == 1
    # a kernel that cannot run columns has no automatic policy to choose
    assert not any(p.auto_balance for p in split_policies(heuristic_config(32, True, dc.FP8_MMA_SYNC),
                                                            kernel.split, True))
    odd = Bucket(64, 2, (55, 55), (16384, 16384), "fp8")
    space = search_space(odd, 132)
    assert space.default.split.auto_balance and "auto" in config_id(space.default, "fp8")
    assert settled_at(space.default, odd).split.balanced  # 55 requests: columns
    assert not any(c.split.balanced and same_kernel(c, space.default) and
                   c.split.min_blocks_per_split == space.default.split.min_blocks_per_split
                   for c in space.candidates[1:])  # the settled plan is an alias of the default
    assert not settled_at(space.default, Bucket(64, 2, (64, 64), (16384, 16384), "fp8")).split.balanced
    stored = tdb.config_to_dict(space.default)
    assert stored["split"]["auto_balance"] is True and tdb.config_from_dict(stored) == replace(
        space.default, split=replace(space.default.split, num_sms=SplitPolicy().num_sms))


def test_rope_ring_is_searched_where_it_applies_and_stored_only_when_set():
    """The RoPE ring (alternate pages only) is a tuner axis, stored under its name only when set,
    so that the entries written before it keep their text; a ring of one slot is refused."""
    valid, _ = kernel_variants(32, "fp8")
    rings = [c for c in valid if c.rope_ring]
    assert rings and all(c.wg_mode == dc.WG_ALT_PAGES and c.rope_ring in ROPE_RINGS for c in rings)
    assert any(c.rope_ring == 3 and c.stages == 5 for c in rings)  # the fifth stage the ring makes room for
    assert not any(c.stages == 5 and not c.rope_ring and c.row_groups == 2 and c.wg_mode == dc.WG_ALT_PAGES
                   for c in valid)  # five 41 KB stages do not fit next to a 32-row Q
    ring = heuristic_config(32)
    assert (ring.rope_ring, ring.stages) == (dc.RING_SLOTS, dc.RING_STAGES) and "rr3" in config_id(ring, "fp8")
    stored = tdb.config_to_dict(ring)
    assert stored["rope_ring"] == 3 and tdb.config_from_dict(stored).rope_ring == 3
    assert "rope_ring" not in tdb.config_to_dict(heuristic_config(64))
    assert tdb.config_from_dict(tdb.config_to_dict(heuristic_config(64))).rope_ring == 0
    with pytest.raises(ValueError, match="rope_ring must be one of"):
        tdb.config_from_dict({**stored, "rope_ring": 1})
    assert not dc.fp8_config_valid(replace(heuristic_config(64), rope_ring=3))  # rows = M: no ring
    # the host's map: four whole stages give way to five content stages, three RoPE slots and
    # their barriers (the kernel static_asserts the same sum: test_kernel_compile)
    plain = replace(ring, stages=4, rope_ring=0)
    assert dc.wgmma_smem_bytes(ring) == (dc.wgmma_smem_bytes(plain) - 4 * dc.WGMMA_STAGE_BYTES
                                         + 5 * dc.WGMMA_CONTENT_BYTES + 3 * dc.WGMMA_ROPE_SLOT_BYTES
                                         + (2 + 3) * dc.MBARRIER_BYTES) <= dc.MAX_SMEM_PER_CTA


def test_fit_stages_shortens_the_pipeline_only_to_a_valid_depth():
    """``fit_stages`` drops stages until the shared memory fits (alternate pages at 64 rows: four
    pages do not fit, three do); a configuration that no depth makes valid comes back unchanged,
    not cut to two stages."""
    over = replace(heuristic_config(64), wg_mode=dc.WG_ALT_PAGES)
    assert not dc.fp8_config_valid(over)
    fitted = dc.fit_stages(over)
    assert dc.fp8_config_valid(fitted) and fitted.stages == 3
    hopeless = replace(over, stages=5, qk_promote=2)  # no depth makes qk_promote=2 valid
    assert dc.fit_stages(hopeless) is hopeless


def test_balanced_columns_in_the_space_only_where_the_kernel_runs_them():
    """The balanced policy is searched for layouts whose column build compiles without spills,
    and only a balanced configuration gets that build (COLUMN_ITEMS), and its work list columns."""
    from snapmla_cli.tuning.space import split_policies

    # the heuristic's layouts run columns (rows = M at 64+ rows since its column build reads the
    # gammas from shared memory) but at 32 rows, whose RoPE ring runs one item per CTA;
    # alternate pages at 64 rows spills in its column loop
    alt_64 = dc.fit_stages(replace(heuristic_config(64), wg_mode=dc.WG_ALT_PAGES))
    cases = [(heuristic_config(rows), rows != 32) for rows in (16, 32, 64, 128)] + [(alt_64, False)]
    for kernel, capable in cases:
        policies = split_policies(kernel, kernel.split, True)
        assert any(p.balanced for p in policies) == capable == dc.column_capable(kernel, True)
        assert dc.fp8_defines(kernel)["COLUMN_ITEMS"] == 0
        assert dc.fp8_defines(dc.balanced(kernel))["COLUMN_ITEMS"] == int(capable)
    bf16 = heuristic_config(64, False)
    assert dc.bf16_defines(dc.balanced(bf16))["COLUMN_ITEMS"] == 1 and dc.bf16_defines(bf16)["COLUMN_ITEMS"] == 0
    assert not dc.runs_columns(dc.balanced(heuristic_config(32, True, dc.FP8_MMA_SYNC)), True)
    space = search_space(Bucket(32, 1, (64, 64), (16384, 16384), "fp8"), 132)
    balanced = [c for c in space.candidates if c.split.balanced]
    assert balanced and all(dc.column_capable(c, True) for c in balanced)
    assert all("bal" in config_id(c, "fp8") for c in balanced)
    # stored as a YAML boolean, and read back only as one
    stored = tdb.config_to_dict(balanced[0])
    assert stored["split"]["balanced"] is True and tdb.config_from_dict(stored).split.balanced
    with pytest.raises(ValueError, match="balanced must be true or false"):
        tdb.config_from_dict({**stored, "split": {**stored["split"], "balanced": 1}})


# ---------------------------------------------------------------------------------------------
# database file


def test_an_entry_timed_against_another_default_is_not_current_and_gives_way(isolated_db):
    """A resumed tune skips a bucket only when its entry was measured with these kernels against
    today's default; a merge replaces an entry timed against another default even by a slower
    one (their times do not rank: only the new entry beat today's heuristic)."""
    user, _ = isolated_db
    today = heuristic_config(128).with_sms(132)
    current = entry(t=100.0)
    assert current.is_current("abc123", today)
    assert not current.is_current("other-kernels", today)
    stale = replace(current, default_config=alt_config())
    assert not stale.is_current("abc123", today)
    save_entries(user, GPU, [stale])
    _, [o] = save_entries(user, GPU, [entry(t=130.0)])  # slower, but against today's default
    assert o.action == "replaced" and o.previous == stale
    _, [o] = save_entries(user, GPU, [entry(t=140.0)])  # same default, slower: kept
    assert o.action == "kept_old"


def test_merge_notes_name_a_faster_entry_kept_or_forced_out(isolated_db):
    """The tune log says when the database kept a faster stored entry, and when --force put a
    clearly slower one in its place (a small --budget that timed fewer candidates); a forced
    replacement within the timing spread, or of an entry timed against another default, is
    not worth a note."""
    from snapmla_cli.cli.tune import FORCED_SLOWER_MARGIN, merge_note

    user, _ = isolated_db
    _, [o] = save_entries(user, GPU, [entry(t=100.0)])
    assert merge_note(o, entry(t=100.0)) is None  # added
    slower = entry(t=110.0)
    _, [o] = save_entries(user, GPU, [slower])
    assert o.action == "kept_old" and "kept the stored entry (100.0 us)" in merge_note(o, slower)
    _, [o] = save_entries(user, GPU, [slower], force=True)
    note = merge_note(o, slower)
    assert o.action == "replaced" and note is not None
    assert "--force replaced a faster stored entry (100.0 us, 7 candidates, 2026-12-01)" in note
    assert "110.0 us" in note
    within = entry(t=110.0 * (1 + FORCED_SLOWER_MARGIN / 2))
    _, [o] = save_entries(user, GPU, [within], force=True)
    assert o.action == "replaced" and merge_note(o, within) is None
    stale = replace(entry(t=50.0), default_config=alt_config())  # timed against another default
    save_entries(user, GPU, [stale], force=True)
    _, [o] = save_entries(user, GPU, [entry(t=100.0)], force=True)
    assert o.action == "replaced" and merge_note(o, entry(t=100.0)) is None


def test_db_round_trip(isolated_db):
    user, _ = isolated_db
    entries = [entry(), entry(context=(65536, 65536), t=250.5, cfg=alt_config()),
               entry(h_q=16, s_q=1, fmt="bf16", t=33.25)]
    path, outcomes = save_entries(user, GPU, entries)
    assert path == user / "Test_GPU_X100.yaml"
    assert [o.action for o in outcomes] == ["added"] * 3
    loaded = load_file(path)
    assert not loaded.problems
    assert len(loaded.sections) == 1 and loaded.sections[0].gpu == GPU
    assert sorted(loaded.sections[0].entries, key=lambda e: e.bucket.id) == sorted(
        entries, key=lambda e: e.bucket.id)
    text = path.read_text()
    assert "name: Test GPU X100" in text and "speedup" in text and "command" in text


def test_merge_keeps_faster_and_other_buckets(isolated_db):
    user, _ = isolated_db
    other = entry(context=(65536, 65536), t=400.0)
    save_entries(user, GPU, [entry(t=100.0), other])
    _, [o] = save_entries(user, GPU, [entry(t=90.0, cfg=alt_config())])
    assert o.action == "replaced" and o.previous.time_us == 100.0
    _, [o] = save_entries(user, GPU, [entry(t=120.0)])
    assert o.action == "kept_old"
    stored = {e.bucket.context: e for e in load_file(user / "Test_GPU_X100.yaml").sections[0].entries}
    assert stored[(16384, 16384)].time_us == 90.0 and stored[(16384, 16384)].config == alt_config()
    assert stored[(65536, 65536)] == other
    _, [o] = save_entries(user, GPU, [entry(t=150.0)], force=True)
    assert o.action == "replaced"
    # another driver major is another section of the same file; both are kept
    save_entries(user, replace(GPU, cuda_driver_major=12), [entry(t=80.0)])
    sections = load_file(user / "Test_GPU_X100.yaml").sections
    assert len(sections) == 2 and sum(len(s.entries) for s in sections) == 3


def test_an_equally_fast_new_entry_keeps_the_stored_one(isolated_db: tuple[pathlib.Path, pathlib.Path]) -> None:
    """Only a faster entry replaces a stored one: a re-run that times the same shows no gain."""
    user, _ = isolated_db
    save_entries(user, GPU, [entry(t=100.0)])
    _, [o] = save_entries(user, GPU, [entry(t=100.0, cfg=alt_config())])
    assert o.action == "kept_old"
    [stored] = load_file(user / "Test_GPU_X100.yaml").sections[0].entries
    assert stored.config == heuristic_config(128)


def test_a_bucket_stored_twice_is_judged_by_its_fastest_entry() -> None:
    """A hand-merged file may hold one bucket twice: a new entry is compared with the faster one,
    and only one entry of the bucket is kept."""
    fast, slow = entry(t=10.0), entry(t=30.0, cfg=alt_config(2))
    merged, outcome = tdb.merge_entry([slow, fast], entry(t=20.0, cfg=alt_config(3)))
    assert outcome.action == "kept_old" and outcome.previous == fast and merged == [fast]


def test_the_resume_check_reads_a_bucket_stored_twice_as_its_first_entry(tmp_path) -> None:
    """``entries_for`` / ``find_entry`` (what a resumed ``snapmla tune`` compares with) take the
    file's first entry of a bucket, as its docstring says, not whichever comes last."""
    first, second = entry(t=30.0, cfg=alt_config(2)), entry(t=10.0)
    (tmp_path / tdb.db_filename(GPU.name)).write_text(tdb.dump_text([tdb.DeviceSection(GPU, [first, second])]))
    assert tdb.entries_for(tmp_path, GPU) == {first.bucket: first}
    assert tdb.find_entry(tmp_path, GPU, first.bucket) == first


def test_atomic_write_survives_interrupted_write(isolated_db, monkeypatch):
    user, _ = isolated_db
    path, _ = save_entries(user, GPU, [entry(t=100.0)])
    before = path.read_bytes()
    real_write_text = pathlib.Path.write_text

    def half_then_fail(self, text, *args, **kwargs):
        real_write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", half_then_fail)
    with pytest.raises(OSError):
        save_entries(user, GPU, [entry(t=50.0, cfg=alt_config())])
    monkeypatch.setattr(pathlib.Path, "write_text", real_write_text)
    assert path.read_bytes() == before
    left = sorted(p.name for p in user.iterdir() if p.name != ".Test_GPU_X100.yaml.lock")  # the merge lock stays
    assert left == ["Test_GPU_X100.yaml"]  # no temp left
    assert load_file(path).sections[0].entries[0].time_us == 100.0


def _save_buckets(folder: str, first_h_q: int, count: int) -> None:
    """One tuner process's saves: ``count`` buckets of its own, one merge each (as tune does)."""
    for h_q in range(first_h_q, first_h_q + count):
        save_entries(pathlib.Path(folder), GPU, [entry(h_q=h_q, s_q=1, cfg=heuristic_config(h_q))])


def test_concurrent_tuners_keep_every_entry(tmp_path):
    """One `snapmla tune` per GPU of a node writes the same <GPU>.yaml: each merge reads, adds
    and replaces the file, so without the merge lock one process's entries were lost. Half the
    tuners reach the file through a symlink in another folder: the lock is the target's."""
    import multiprocessing

    real, linked = tmp_path / "real", tmp_path / "linked"
    path, _ = save_entries(real, GPU, [entry(h_q=200, s_q=1, cfg=heuristic_config(200))])
    linked.mkdir()
    (linked / path.name).symlink_to(path)
    processes, per_process = 4, 12
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_save_buckets, args=(str(real if i % 2 else linked), 1 + i * per_process, per_process))
               for i in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    stored = load_file(path).sections[0].entries
    assert sorted(e.bucket.h_q for e in stored) == [*range(1, 1 + processes * per_process), 200]
    assert (linked / path.name).is_symlink() and not (linked / f".{path.name}.lock").exists()


@pytest.mark.parametrize("failure", ["open", "flock"])
def test_a_merge_goes_on_where_no_lock_can_be_taken(tmp_path, monkeypatch, failure):
    """The lock protects concurrent merges; it is not a precondition: a folder where it cannot be
    created (read-only, with a link to the database elsewhere) or a filesystem without locks
    (ENOLCK on NFS) saves unlocked, as before the lock existed."""
    import errno as errnos

    real_open = tdb.os.open

    def no_lock_file(name, *args, **kwargs):
        if str(name).endswith(".lock"):
            raise PermissionError(errnos.EACCES, "Permission denied")
        return real_open(name, *args, **kwargs)

    def no_locks(fd, op):
        raise OSError(errnos.ENOLCK, "No locks available")

    if failure == "open":
        monkeypatch.setattr(tdb.os, "open", no_lock_file)
    else:
        monkeypatch.setattr(tdb.fcntl, "flock", no_locks)
    path, outcomes = save_entries(tmp_path, GPU, [entry()])
    assert len(outcomes) == 1 and load_file(path).sections[0].entries[0].time_us == 100.0


def test_corrupt_file_is_not_overwritten_without_force(isolated_db):
    user, _ = isolated_db
    path = user / "Test_GPU_X100.yaml"
    path.write_text("format: [unclosed\n")
    with pytest.raises(SnapmlaError, match="not overwriting"):
        save_entries(user, GPU, [entry()])
    assert path.read_text() == "format: [unclosed\n"
    save_entries(user, GPU, [entry()], force=True)
    assert len(load_file(path).sections[0].entries) == 1


# ---------------------------------------------------------------------------------------------
# lookup


def cuda0():
    return torch.device("cuda", 0)  # never touched: the device key comes from the hook


@pytest.mark.parametrize("content", [
    "format: [unclosed\n",  # not YAML
    "format: something-else\nversion: 1\n",  # YAML, not ours
    "format: snapmla-tuning\nversion: 99\ndevices: []\n",  # from the future
    "\x00\x01\x02 binary",
])
def test_corrupt_and_unknown_files_warn_once(isolated_db, content):
    user, shipped = isolated_db
    (user / "Test_GPU_X100.yaml").write_text(content)
    save_entries(shipped, GPU, [entry(t=100.0)])
    with pytest.warns(RuntimeWarning, match="Test_GPU_X100.yaml") as record:
        cfg = lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0())
    assert len([w for w in record if "tuning" in str(w.message)]) == 1
    assert cfg == heuristic_config(128)  # the shipped entry still answers
    lookup.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second load of the same file: no second warning
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == cfg


def test_bad_entry_is_skipped_with_a_warning(isolated_db):
    user, _ = isolated_db
    path, _ = save_entries(user, GPU, [entry(t=100.0, cfg=alt_config())])
    text = path.read_text().replace("entries:\n", "entries:\n  - {bucket: nonsense}\n", 1)
    path.write_text(text)
    with pytest.warns(RuntimeWarning, match="bad entry"):
        cfg = lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0())
    assert cfg == alt_config()


def test_unknown_gpu_and_cpu_device_give_none(isolated_db, monkeypatch):
    user, _ = isolated_db
    save_entries(user, GPU, [entry()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=torch.device("cpu")) is None
        monkeypatch.setattr(lookup, "_device_key_hook",
                            lambda index: GpuKey("Test GPU X100", 108, (8, 0), 13))
        lookup.clear_cache()
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) is None


def test_a_bare_cuda_device_follows_the_current_device(isolated_db, monkeypatch):
    """"cuda" names whichever GPU is current: its state is not cached under the string (a
    string's `index` attribute, str.index, once made it look like a fixed device 0)."""
    user, _ = isolated_db
    other = GpuKey("Test GPU X100", 108, (8, 0), 13)
    save_entries(user, GPU, [entry(cfg=alt_config())])
    monkeypatch.setattr(lookup, "_device_key_hook", lambda index: GPU if index == 0 else other)
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    assert lookup.lookup_decode_config(rows=128, fp8=True, device="cuda") == alt_config()
    current[0] = 1  # another GPU, no database entry for it
    assert lookup.lookup_decode_config(rows=128, fp8=True, device="cuda") is None
    assert lookup.lookup_decode_config(rows=128, fp8=True, device="cuda:0") == alt_config()
    assert lookup._names_fixed_gpu("cuda:1") and lookup._names_fixed_gpu(torch.device("cuda", 0))
    assert not lookup._names_fixed_gpu("cuda") and not lookup._names_fixed_gpu(torch.device("cuda"))


def test_lookup_never_raises(isolated_db, monkeypatch):
    def boom(index):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(lookup, "_device_key_hook", boom)
    with pytest.warns(RuntimeWarning, match="driver exploded"):
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) is None

    def other(index):  # a failure of another kind is said too (one key for all once hid it)
        raise KeyError("no such GPU")

    monkeypatch.setattr(lookup, "_device_key_hook", other)
    lookup.clear_cache()
    with pytest.warns(RuntimeWarning, match="no such GPU"):
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and said once
        lookup.clear_cache()
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) is None


def test_nearest_bucket(isolated_db):
    user, _ = isolated_db
    c16, c64, c128 = alt_config(2), alt_config(3), alt_config(4)
    save_entries(user, GPU, [entry(context=CTX[0], cfg=c16), entry(context=CTX[1], cfg=c64),
                             entry(context=CTX[2], cfg=c128),
                             entry(h_q=128, s_q=1, context=CTX[2], cfg=c128),
                             entry(fmt="bf16", t=5.0)])

    def get(rows=128, fp8=True, **kw):
        return lookup.lookup_decode_config(rows=rows, fp8=fp8, device=cuda0(), **kw)

    assert get(context=16384) == c16
    assert get(context=20000) == c16  # log2 distance 0.29 to 16k, 1.71 to 64k
    assert get(context=100000) == c128  # 0.36 to 128k, 0.61 to 64k
    assert get(context=10**6) == c128
    assert get(context=40000, batch=64) == c64
    assert get(batch=64) == c128  # context unknown: four tied entries, c128 has two votes
    assert get(rows=64, context=16384) == c16  # nearest rows within 2x
    assert get(rows=16) is None  # 8x fewer rows: too far
    assert get(fp8=False) == heuristic_config(128, False)
    # row groups narrowed to the query: 20 rows need at most 2 groups
    save_entries(user, GPU, [entry(h_q=40, s_q=1, cfg=heuristic_config(40))])
    lookup.clear_cache()
    narrowed = get(rows=20, context=16384)
    assert narrowed is not None and narrowed.row_groups == 2


def test_the_querys_own_s_q_wins_among_equal_rows(isolated_db):
    """h_q 64 s_q 2 and h_q 128 s_q 1 are both 128 rows: a caller that knows s_q gets its own
    shape's entry; one that does not (FlashMLA's get_mla_metadata) gets the first in sort order."""
    user, _ = isolated_db
    two, one = alt_config(2), alt_config(3)
    save_entries(user, GPU, [entry(h_q=64, s_q=2, cfg=two), entry(h_q=128, s_q=1, cfg=one)])

    def get(**kw):
        return lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), context=16384, **kw)

    assert get(s_q=1) == one and get(s_q=2) == two
    assert get() == one and get(s_q=4) == one  # unknown or no exact shape: sort order
    # s_q only breaks ties: a nearer context of the other s_q still wins
    save_entries(user, GPU, [entry(h_q=128, s_q=1, context=CTX[2], cfg=one),
                             entry(h_q=64, s_q=2, context=CTX[0], cfg=two)], force=True)
    lookup.clear_cache()
    assert get(s_q=1) == one  # the exact 16k entry of s_q 1 is still there
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), context=CTX[2][0], s_q=2) == one


def test_entries_four_times_the_rows_away_are_not_used(isolated_db: tuple[pathlib.Path, pathlib.Path]) -> None:
    """Module docstring: entries more than a factor of 2 away in rows are never used."""
    user, _ = isolated_db
    save_entries(user, GPU, [entry(cfg=alt_config())])  # 128 rows
    for rows, expect in ((64, alt_config()), (256, alt_config()), (32, None), (512, None)):
        got = lookup.lookup_decode_config(rows=rows, fp8=True, device=cuda0(), context=16384)
        assert (got is None if expect is None else got == expect), rows


def test_the_querys_own_s_q_beats_the_user_folder(isolated_db: tuple[pathlib.Path, pathlib.Path]) -> None:
    """Tie-break order: the query's own s_q first, then the user's folder over the shipped one."""
    user, shipped = isolated_db
    own, other = alt_config(2), alt_config(3)
    save_entries(shipped, GPU, [entry(h_q=64, s_q=2, cfg=own)])
    save_entries(user, GPU, [entry(h_q=128, s_q=1, cfg=other)])
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), context=16384, s_q=2) == own
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), context=16384) == other


def test_a_section_of_this_cuda_driver_wins(isolated_db: tuple[pathlib.Path, pathlib.Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sections of one GPU model differing only in the CUDA driver major: the one that
    matches the running driver answers."""
    user, _ = isolated_db
    save_entries(user, GPU, [entry(cfg=alt_config(2))])
    save_entries(user, replace(GPU, cuda_driver_major=12), [entry(cfg=alt_config(3))])
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == alt_config(2)
    monkeypatch.setattr(lookup, "_device_key_hook", lambda index: replace(GPU, cuda_driver_major=12))
    lookup.clear_cache()
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == alt_config(3)


def test_the_users_database_beats_a_shipped_entry_of_this_driver(isolated_db: tuple[pathlib.Path, pathlib.Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's order: the user's database first, then the same CUDA driver major. A user entry
    timed under another driver still beats a shipped one of this driver for the same bucket."""
    user, shipped = isolated_db
    save_entries(user, replace(GPU, cuda_driver_major=12), [entry(cfg=alt_config(3))])
    save_entries(shipped, GPU, [entry(cfg=alt_config(2))])
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == alt_config(3)


def test_the_entry_lists_put_this_drivers_section_first(isolated_db: tuple[pathlib.Path, pathlib.Path]) -> None:
    """A tune after a CUDA driver upgrade appends the new driver's section after the old one. The
    lookup answers from the new section; the entry lists (``stored_entries``, ``--stale``'s buckets,
    ``snapmla info``) take a bucket's first entry as the one the lookup takes, so they must list the
    same section first: the old section's stale entry was re-timed by every ``--stale`` run and
    counted stale by ``info`` although nothing used it."""
    from snapmla_cli.runtime.nvrtc import kernel_dir, product_sources_hash

    user, _ = isolated_db
    kernels = product_sources_hash(kernel_dir())
    b = Bucket(64, 2, (64, 64), (16384, 16384), "fp8")
    today = tdb.strip_sms(default_config(b, GPU.sm_count))
    old = replace(entry(cfg=alt_config(3)), kernels="0123456789abcdef", default_config=today)
    new = replace(entry(cfg=alt_config(2)), kernels=kernels, default_config=today)
    save_entries(user, replace(GPU, cuda_driver_major=12), [old])
    save_entries(user, GPU, [new])  # appended: the file lists the driver-12 section first
    assert [s.gpu.cuda_driver_major for s in load_file(user / tdb.db_filename(GPU.name)).sections] == [12, 13]
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), batch=64, context=16384) == alt_config(2)
    assert lookup.stored_entries(GPU)[b] == new
    assert lookup.stale_buckets(GPU, ["fp8"]) == []
    assert [loc.gpu.cuda_driver_major for loc in lookup.matching_entries(GPU)] == [13, 12]
    # a GPU on the old driver sees its own section first
    assert lookup.stored_entries(replace(GPU, cuda_driver_major=12))[b] == old
    # info counts the old section's entry as shadowed, and no command run here re-times it
    from snapmla_cli.runtime.gpu_facts import GpuFacts

    facts = GpuFacts(0, GPU.name, "GPU-1", 132, (9, 0), 80 << 30, 1980, 2619, "580", "13.0")
    lines = describe_database([facts])
    assert lines[-3].endswith(f"{config_id(old.config, 'fp8')} {old.time_us:.1f} us, "
                              f"1.20x vs default (2026-12-01, user) [stale: timed with other kernel sources]")
    assert lines[-1] == ("  1 of the stale entries are shadowed by an earlier entry of the same bucket: `snapmla tune "
                         "--stale --db-dir FOLDER` re-times a folder's own; 1 is in a section of another CUDA driver, "
                         "which only a run on that driver re-times")


def test_a_section_of_another_sm_count_does_not_apply(isolated_db: tuple[pathlib.Path, pathlib.Path]) -> None:
    """SPEC section 9 keys on the SM count too: a same-named GPU with fewer SMs (a cut-down part)
    was tuned for other split plans."""
    user, _ = isolated_db
    save_entries(user, replace(GPU, sm_count=114), [entry(cfg=alt_config())])
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), context=16384) is None
    assert lookup.matching_entries(GPU) == []


def test_batch_is_rounded_to_the_nearest_sixteenth_octave(isolated_db: tuple[pathlib.Path, pathlib.Path]) -> None:
    """Batch 61 is looked up as 2^(95/16) = 61.06 (nearest step), which is nearer the [62, 64]
    bucket than the [1, 59] one, as 61 itself is; rounding down (59.3) would pick [1, 59]."""
    user, _ = isolated_db
    low, high = alt_config(2), alt_config(3)
    save_entries(user, GPU, [entry(batch=(1, 59), cfg=low), entry(batch=(62, 64), cfg=high)])
    get = lookup.lookup_decode_config
    assert get(rows=128, fp8=True, device=cuda0(), batch=61, context=16384) == high
    assert get(rows=128, fp8=True, device=cuda0(), batch=58, context=16384) == low


def test_rounding_never_moves_a_value_across_a_range_end(isolated_db: tuple[pathlib.Path, pathlib.Path]) -> None:
    """Adjacent ranges: a value just inside one (batch 65, context 16,385-16,700: within 1/32
    octave of the other range's end) is answered by its own range's entry, and the memo keeps
    the two sides apart."""
    user, _ = isolated_db
    low, high = alt_config(2), alt_config(3)
    save_entries(user, GPU, [entry(batch=(1, 64), context=(1, 16384), cfg=low),
                             entry(batch=(65, 128), context=(1, 16384), cfg=high),
                             entry(batch=(1, 64), context=(16385, 32768), cfg=high)])
    get = lookup.lookup_decode_config
    assert get(rows=128, fp8=True, device=cuda0(), batch=64, context=16384) == low
    assert get(rows=128, fp8=True, device=cuda0(), batch=65, context=16384) == high
    assert get(rows=128, fp8=True, device=cuda0(), batch=63, context=16384) == low
    for context in (16385, 16500, 16700):
        assert get(rows=128, fp8=True, device=cuda0(), batch=64, context=context) == high
    assert get(rows=128, fp8=True, device=cuda0(), batch=64, context=16300) == low


def test_user_dir_wins_and_env_override(isolated_db, monkeypatch, tmp_path):
    user, shipped = isolated_db
    save_entries(shipped, GPU, [entry(cfg=alt_config(2))])
    save_entries(user, GPU, [entry(cfg=alt_config(3))])
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == alt_config(3)
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(other))  # new folder: the shipped entry answers
    lookup.clear_cache()  # the folders are read once per device
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == alt_config(2)
    monkeypatch.delenv(tdb.TUNING_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tdb.user_dir() == tmp_path / "home" / ".config" / "snapmla" / "tuning"


def test_lookup_is_cached_no_io_on_hot_path(isolated_db, monkeypatch):
    user, _ = isolated_db
    path, _ = save_entries(user, GPU, [entry(cfg=alt_config())])
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == alt_config()

    def no_io(*a, **k):
        raise AssertionError("file read on the hot path")

    monkeypatch.setattr(tdb, "load_file", no_io)
    monkeypatch.setattr(lookup, "load_file", no_io)
    path.unlink()
    for ctx in (1000, 16384, 50000):
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), context=ctx) == alt_config()


def test_matching_entries_and_describe(isolated_db):
    user, shipped = isolated_db
    save_entries(user, GPU, [entry()])
    save_entries(shipped, replace(GPU, cuda_driver_major=12), [entry(context=CTX[1])])
    assert len(lookup.matching_entries("Test GPU X100")) == 2
    assert [m.origin for m in lookup.matching_entries(GPU)] == ["user", "shipped"]
    from snapmla_cli.runtime.gpu_facts import GpuFacts
    from snapmla_cli.tuning import describe_database, matching_entries

    facts = GpuFacts(0, "Test GPU X100", "GPU-1", 132, (9, 0), 80 << 30, 1980, 2619, "580", "13.0")
    assert len(matching_entries(facts)) == 2
    lines = describe_database([facts])
    assert any("2 (" in line for line in lines) and any("1.20x" in line for line in lines)
    assert any("none" in line for line in describe_database([replace(facts, name="Other")]))


def test_describe_marks_the_entries_a_resumed_tune_would_retime(isolated_db, monkeypatch, tmp_path):
    """After an upgrade, ``snapmla info`` names the entries whose times no longer describe what
    the default runs: timed with other kernel sources, or against another default (the small-work
    rule changed the default of the b 1 16k buckets of 64+ rows); current entries carry no mark,
    and without an SM count only the kernel sources are compared."""
    from snapmla_cli.runtime.gpu_facts import GpuFacts
    from snapmla_cli.runtime.nvrtc import kernel_dir, product_sources_hash

    user, _ = isolated_db
    kernels = product_sources_hash(kernel_dir())
    b64 = Bucket(64, 2, (64, 64), (16384, 16384), "fp8")
    b1 = Bucket(64, 2, (1, 1), (16384, 16384), "fp8")
    current = replace(entry(), kernels=kernels, default_config=tdb.strip_sms(default_config(b64, 132)))
    old_default = replace(entry(batch=(1, 1)), kernels=kernels, default_config=heuristic_config(128))
    assert old_default.default_config != tdb.strip_sms(default_config(b1, 132))  # the rule moved it
    old_kernels = replace(entry(context=CTX[2]), kernels="0123456789abcdef",
                          default_config=tdb.strip_sms(default_config(Bucket(64, 2, (64, 64), CTX[2], "fp8"), 132)))
    save_entries(user, GPU, [current, old_default, old_kernels])
    facts = GpuFacts(0, "Test GPU X100", "GPU-1", 132, (9, 0), 80 << 30, 1980, 2619, "580", "13.0")
    lines = describe_database([facts])
    marked = {line.split(":")[0].strip(): line for line in lines if line.startswith("  h_q")}
    assert "stale" not in marked[b64.label()]
    assert marked[b1.label()].endswith("[stale: timed with another default]")
    assert marked[Bucket(64, 2, (64, 64), CTX[2], "fp8").label()].endswith("[stale: timed with other kernel sources]")
    assert lines[-1].startswith("  2 of 3 entries are stale")
    no_sms = describe_database([replace(facts, sm_count=None)])
    assert sum("[stale" in line for line in no_sms) == 1 and "1 of 3 entries are stale" in no_sms[-1]
    # the same survey as `snapmla info --json` gives it: every entry whole, its reason or None
    (gpu,) = lookup.survey_database([facts], lookup.kernel_stamp()).as_dict()["gpus"]
    assert gpu["name"] == "Test GPU X100" and len(gpu["entries"]) == 3
    stale = {Bucket.from_dict(e["bucket"]).label(): e["stale"] for e in gpu["entries"]}
    assert stale == {b64.label(): None, b1.label(): "another default",
                     Bucket(64, 2, (64, 64), CTX[2], "fp8").label(): "other kernel sources"}
    (whole,) = [e for e in gpu["entries"] if Bucket.from_dict(e["bucket"]) == b64]
    assert whole["origin"] == "user" and whole["file"].startswith(str(user)) and whole["kernels"] == kernels
    assert tdb.Entry.from_dict(whole) == current  # the stored fields, not a summary of them
    monkeypatch.setenv("SNAPMLA_KERNEL_DIR", str(tmp_path / "no-kernels"))  # nothing to compare with
    assert not any("stale" in line for line in describe_database([facts]))
    # a stale shipped entry under a user entry of its bucket: a plain --stale will not re-time it
    monkeypatch.delenv("SNAPMLA_KERNEL_DIR")
    _, shipped = isolated_db
    save_entries(shipped, GPU, [replace(current, kernels="0123456789abcdef")])
    shadowing = describe_database([facts])
    assert "3 of 4 entries are stale" in shadowing[-2]
    assert shadowing[-1].startswith("  1 of the stale entries are shadowed") and "--db-dir" in shadowing[-1]
    assert not any("shadowed" in line for line in lines)


def test_the_kernel_stamp_is_none_without_readable_sources(monkeypatch, tmp_path):
    """No kernel folder, or a source that cannot be read: nothing to compare the entries with
    (``snapmla info`` still lists them), never an exception out of ``info``."""
    from snapmla_cli.runtime import nvrtc

    assert lookup.kernel_stamp() == nvrtc.product_sources_hash(nvrtc.kernel_dir())
    monkeypatch.setenv(nvrtc.KERNEL_DIR_ENV, str(tmp_path / "absent"))
    assert lookup.kernel_stamp() is None
    monkeypatch.delenv(nvrtc.KERNEL_DIR_ENV)

    def unreadable(folder, skip=()):
        raise PermissionError(13, "Permission denied", str(folder / "x.cu"))

    monkeypatch.setattr(nvrtc, "source_tree_hash", unreadable)
    assert lookup.kernel_stamp() is None


def test_a_gpu_name_with_spaces_around_it_matches_by_name(isolated_db):
    """NVML names are matched stripped: a name given with spaces around it finds the sections."""
    user, _ = isolated_db
    save_entries(user, GPU, [entry(), entry(context=CTX[1])])
    assert len(lookup.matching_entries("  Test GPU X100 ")) == 2
    assert lookup.matching_entries("Test GPU X10") == []


def test_fp8_and_bf16_answers_are_memoised_apart(isolated_db):
    user, _ = isolated_db
    bf16 = heuristic_config(128, False)
    save_entries(user, GPU, [entry(cfg=alt_config()), entry(fmt="bf16", cfg=bf16)])
    assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), batch=64) == alt_config()
    assert lookup.lookup_decode_config(rows=128, fp8=False, device=cuda0(), batch=64) == bf16


def test_a_gpu_without_an_sm_count_matches_by_name_and_capability(isolated_db):
    """torch could not count the SMs (no usable CUDA): the sections of that name and compute
    capability apply, whatever their SM count."""
    from snapmla_cli.runtime.gpu_facts import GpuFacts

    user, shipped = isolated_db
    save_entries(user, GPU, [entry()])
    save_entries(shipped, replace(GPU, sm_count=114), [entry(context=CTX[1])])
    facts = GpuFacts(0, "Test GPU X100", "GPU-1", None, (9, 0), 80 << 30, None, None, "580", "13.0")
    assert [m.origin for m in lookup.matching_entries(facts)] == ["user", "shipped"]
    assert lookup.matching_entries(replace(facts, compute_capability=(8, 9))) == []


def test_describe_database_names_a_missing_user_folder_and_lists_the_files(isolated_db, tmp_path,
                                                                          monkeypatch):
    user, shipped = isolated_db
    save_entries(shipped, GPU, [entry()])
    lines = describe_database([])
    assert lines[0] == f"tuning database folders: user {user}, shipped {shipped}"
    assert lines[-1] == "tuning files: Test_GPU_X100.yaml"
    missing = tmp_path / "nope"
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(missing))
    assert describe_database([])[0] == f"tuning database folders: user {missing} (missing: ignored), shipped {shipped}"
    monkeypatch.delenv(tdb.TUNING_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))  # the default folder, absent: not worth a note
    assert "missing" not in describe_database([])[0]


def test_only_multi_token_buckets_decode_causally():
    assert not Bucket(64, 1, (8, 8), (4096, 4096), "fp8").causal
    assert Bucket(64, 2, (8, 8), (4096, 4096), "fp8").causal


def test_shared_memory_exactly_at_the_per_cta_limit_is_allowed():
    """The BF16 mma.sync layout rg2 st5 bn32 needs exactly the 227 KB a CTA may opt into."""
    cfg = DecodeConfig.of({"row_groups": 2, "stages": 5, "min_ctas_per_sm": 1, "block_n": 32,
                           "kernel_version": dc.BF16_MMA_SYNC})
    assert smem_bytes(cfg, "bf16") == dc.MAX_SMEM_PER_CTA
    assert config_problem(cfg, "bf16", 32) is None
    assert cfg in kernel_variants(32, "bf16")[0]


@pytest.mark.parametrize("fp8", [True, False])
def test_one_pipeline_stage_is_refused(fp8):
    cfg = replace(heuristic_config(128, fp8), stages=1)
    assert config_problem(cfg, "fp8" if fp8 else "bf16").rule == "min_ctas_per_sm >= 1 and stages >= 2 required"


def test_config_ids_name_block_n_only_where_it_applies_and_a_split_cap():
    mma = heuristic_config(128, False, dc.BF16_MMA_SYNC)
    assert "-bn32-" in config_id(mma, "bf16")
    wgmma = heuristic_config(128, False, dc.BF16_WGMMA)
    assert "-bn" not in config_id(wgmma, "bf16")
    fp8 = heuristic_config(128)
    capped = replace(fp8, split=replace(fp8.split, max_splits_per_request=8))
    assert config_id(capped, "fp8") == config_id(fp8, "fp8") + "-ms8"


def test_split_policies_start_with_the_kernels_own_ctas_per_sm():
    """A kernel built for 2 CTAs per SM is tried first with the split plan that targets 2 CTAs
    per SM and the default's waves and minimum split (then the other products)."""
    default = heuristic_config(128).split
    kernel = next(c for c in kernel_variants(128, "fp8")[0] if c.min_ctas_per_sm == 2)
    fixed = [p for p in split_policies(kernel, default) if not (p.balanced or p.auto_balance)]
    first = fixed[0]
    assert (first.ctas_per_sm, first.waves, first.min_blocks_per_split) == (2, default.waves,
                                                                            default.min_blocks_per_split)


@pytest.mark.parametrize("bucket", [Bucket(16, 1, (8, 8), (4096, 4096), "bf16"),
                                    Bucket(64, 2, (64, 64), (16384, 16384), "fp8")])
def test_every_kernel_and_split_pair_is_the_default_a_candidate_or_an_alias(bucket):
    """Each kernel variant appears once, and every (kernel, split policy) pair is counted once:
    the default itself, a candidate, or an alias of an earlier one (the default is no alias)."""
    space = search_space(bucket, 132)
    assert len(set(space.kernels)) == len(space.kernels)
    assert space.kernels[0] == replace(space.default, split=SplitPolicy())
    pairs = sum(len(split_policies(k, space.default.split, bucket.fp8)) for k in space.kernels)
    assert pairs == len(space.candidates) + space.aliases


# ---------------------------------------------------------------------------------------------
# the search loop with injected measurements


class FakeMeasurer:
    """Deterministic times per candidate; ``wrong`` candidates fail the gate; ``interrupt_after``
    raises KeyboardInterrupt on that many-th timing call (simulating Ctrl-C)."""

    def __init__(self, space, fastest_wrong=True, interrupt_after=None):
        self.fmt = space.bucket.format
        self.times = {}
        for i, cfg in enumerate(space.candidates):
            self.times[config_id(cfg, self.fmt)] = 1e-3 * (1.0 + ((i * 7919) % 1009) / 100)
        self.ids = space.ids()
        self.wrong = {self.ids[3]} if fastest_wrong else set()
        if fastest_wrong:
            self.times[self.ids[3]] = 1e-6  # fastest of all, but wrong
        self.checked, self.timed, self.prepared = [], [], 0
        self.interrupt_after = interrupt_after

    def prepare(self, bucket):
        self.prepared += 1

    def release(self):
        pass

    def check(self, bucket, cfg):
        cid = config_id(cfg, self.fmt)
        self.checked.append(cid)
        return CheckResult(cid not in self.wrong, "fake")

    def time(self, bucket, cfg, cutoff=None):
        cid = config_id(cfg, self.fmt)
        if self.interrupt_after is not None and len(self.timed) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.timed.append(cid)
        return self.times[cid]


def small_space():
    space = search_space(Bucket(64, 2, (1, 1), (4096, 4096), "fp8"), 132)
    assert 12 < len(space.candidates) < 1009  # FakeMeasurer's times are then all distinct
    return space


INFO = EntryInfo("0.1.0", "snapmla tune --heads 64 --mtp 2", "k1", today="2026-12-01")


def test_tuner_selects_fastest_correct_candidate():
    space = small_space()
    fake = FakeMeasurer(space)
    result = Tuner(fake, Budget(count=1000), INFO).tune(space)
    wrong = fake.ids[3]
    assert wrong in fake.checked and wrong not in fake.timed  # gated before timing
    assert result.best.cid != wrong
    valid = {k: v for k, v in fake.times.items() if k != wrong}
    assert result.best.cid == min(valid, key=valid.get)
    assert result.default.cid == fake.ids[0] and fake.timed[0] == fake.ids[0]
    e = result.entry
    assert e.config == tdb.strip_sms(result.best.config)
    assert e.time_us == pytest.approx(valid[result.best.cid] * 1e6)
    assert e.default_time_us == pytest.approx(fake.times[fake.ids[0]] * 1e6)
    assert e.kernels == "k1" and e.date == "2026-12-01" and e.candidates == len(space.candidates)
    assert result.failed == 1


def test_tuner_count_budget_and_phase_order():
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    result = Tuner(fake, Budget(count=5), INFO, confirm_rounds=0).tune(space)
    assert len(result.measured) == 6  # the default + 5
    kernels = [m.config for m in result.measured[1:]]
    # phase 1: distinct kernel variants first, each with its own default split policy
    assert len({config_id(k, "fp8").split("/")[0] for k in kernels}) == 5
    likely = Tuner(fake, Budget(count=5), INFO).likely_candidates(space)
    assert [config_id(c, "fp8") for c in likely] == [m.cid for m in result.measured]
    assert len(Tuner(fake, Budget(seconds=5), INFO).likely_candidates(space)) == len(space.candidates)
    # the progress bar's total: the default and the budget's five, or every candidate without a count
    assert Tuner(fake, Budget(count=5), INFO).planned(space) == 6 < len(space.candidates)
    assert Tuner(fake, Budget(seconds=5), INFO).planned(space) == len(space.candidates)


def test_tuner_measures_the_stored_configuration_right_after_the_default():
    """A re-tune starts from the bucket's stored entry: its configuration (stored without the SM
    count) is measured right after the default, so even a one-candidate budget keeps the former
    winner in the race, and its kernel variant is not measured a second time in phase one. A
    stored default or a configuration that today's space lacks seeds nothing; the latter says so."""
    space = small_space()
    last = space.candidates[-1]  # the last of the static order: a budget cut would drop it
    with_prior, note = seeded(space, tdb.strip_sms(last))
    assert note is None and with_prior.prior == last and space.prior is None
    fake = FakeMeasurer(space, fastest_wrong=False)
    one = Tuner(fake, Budget(count=1), INFO, confirm_rounds=0).tune(with_prior)
    assert [m.cid for m in one.measured] == [config_id(space.default, "fp8"), config_id(last, "fp8")]
    assert Tuner(fake, Budget(count=1), INFO).likely_candidates(with_prior) == [space.default, last]
    n_kernels = len(space.kernels)
    phase_one = Tuner(fake, Budget(count=n_kernels - 1), INFO, confirm_rounds=0).tune(with_prior)
    kernel_ids = [m.cid.split("/")[0] for m in phase_one.measured]
    assert len(set(kernel_ids)) == len(kernel_ids) == n_kernels  # one per kernel variant
    everything = Tuner(fake, Budget(count=10_000), INFO, confirm_rounds=0).tune(with_prior)
    assert sorted(m.cid for m in everything.measured) == sorted(space.ids())  # each exactly once
    assert seeded(space, tdb.strip_sms(space.default)) == (space, None)
    bf16_only = search_space(replace(space.bucket, format="bf16"), 132).candidates[-1]
    unseeded, why = seeded(space, tdb.strip_sms(bf16_only))
    assert unseeded.prior is None and why is not None and "not in today's search space" in why


def test_a_stored_alias_seeds_the_candidate_that_runs_the_same_work():
    """A stored configuration that today's space dropped as an alias (another split policy with
    the same work list at the timed shape) seeds the candidate that runs it; one that aliases
    the default seeds nothing (the default is measured first)."""
    from snapmla_cli.tuning.space import _signature

    space = small_space()
    default_sig = _signature(space.default, space.bucket)
    by_sig = {_signature(c, space.bucket): c for c in space.candidates[1:]}
    dropped = [replace(k, split=p) for k in space.kernels for p in split_policies(k, space.default.split, True)]
    dropped = [c for c in dropped if c not in space.candidates]
    of_default = next(c for c in dropped if _signature(c, space.bucket) == default_sig)
    of_candidate = next(c for c in dropped if _signature(c, space.bucket) in by_sig)
    assert seeded(space, tdb.strip_sms(of_default)) == (space, None)
    with_prior, note = seeded(space, tdb.strip_sms(of_candidate))
    assert note is None and with_prior.prior == by_sig[_signature(of_candidate, space.bucket)] != of_candidate


def test_tuner_time_budget_with_fake_clock():
    space = small_space()
    now = [0.0]

    class Slow(FakeMeasurer):
        def time(self, bucket, cfg, cutoff=None):
            now[0] += 10.0
            return super().time(bucket, cfg, cutoff)

    fake = Slow(space, fastest_wrong=False)
    result = Tuner(fake, Budget(seconds=35.0), INFO, clock=lambda: now[0], confirm_rounds=0).tune(space)
    assert len(result.measured) == 4  # starts at 0, 10, 20, 30 s; none at 40 s
    now[0] = 0.0
    exact = Tuner(Slow(space, fastest_wrong=False), Budget(seconds=30.0), INFO, clock=lambda: now[0], confirm_rounds=0)
    assert len(exact.tune(space).measured) == 3  # a budget spent to the second starts nothing more


def test_tuner_budget_starts_after_the_buckets_setup():
    """The first bucket of a shape builds its timing inputs and correctness problems (seconds on
    the GPU machine); with a 6 s budget that setup once left 4 candidates timed of 160."""
    space = small_space()
    now = [0.0]

    class SlowSetup(FakeMeasurer):
        def prepare(self, bucket):
            super().prepare(bucket)
            now[0] += 100.0

        def time(self, bucket, cfg, cutoff=None):
            now[0] += 10.0
            return super().time(bucket, cfg, cutoff)

    fake = SlowSetup(space, fastest_wrong=False)
    result = Tuner(fake, Budget(seconds=35.0), INFO, clock=lambda: now[0], confirm_rounds=0).tune(space)
    assert fake.prepared == 1 and len(result.measured) == 4  # as without the setup
    assert result.phase_s == {"setup": 100.0, "candidates": 40.0, "confirmation": 0.0}
    # the table's line says where the bucket's time went; the confirmation re-times the top
    # three and the default once each
    again = Tuner(SlowSetup(space, fastest_wrong=False), Budget(seconds=35.0), INFO, clock=lambda: now[0],
                  confirm_rounds=1).tune(space)
    contenders = len({m.cid for m in sorted(again.measured, key=lambda m: m.time_s)[:3]} | {again.default.cid})
    assert again.phase_s == {"setup": 100.0, "candidates": 40.0, "confirmation": 10.0 * contenders}
    assert _line(again).endswith(f"; 100.0 s setup + 40.0 s candidates + {10.0 * contenders:.1f} s confirmation")


def test_tuner_confirmation_medians_decide():
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    lucky = fake.ids[5]
    fake.times[lucky] = 1e-5
    calls = {"n": 0}
    orig = fake.time

    def time(bucket, cfg, cutoff=None):
        t = orig(bucket, cfg, cutoff)
        if config_id(cfg, "fp8") == lucky:
            calls["n"] += 1
            return t if calls["n"] == 1 else 1.0  # one lucky sample, then slow
        return t

    fake.time = time
    result = Tuner(fake, Budget(count=1000), INFO).tune(space)
    assert result.best.cid != lucky


def _retime(fake: FakeMeasurer, again: Callable[[str], float | None]) -> dict[str, int]:
    """Replace ``fake.time``: a configuration's first timing (the search) is the fake's, later
    ones (the confirmation) ``again(cid)``, or the fake's where that is None. Returns the count
    of timings per configuration id, filled as the tuner runs."""
    seen: dict[str, int] = {}
    search_time = fake.time

    def time(bucket, cfg, cutoff=None):
        cid = config_id(cfg, "fp8")
        seen[cid] = seen.get(cid, 0) + 1
        later = None if seen[cid] == 1 else again(cid)
        return search_time(bucket, cfg, cutoff) if later is None else later

    fake.time = time
    return seen


def test_tuner_confirms_the_top_few_on_their_confirmation_samples_alone():
    """With ``confirm_top=1`` only the search's best and the default are re-timed; the medians
    use the confirmation samples alone (a lucky search sample of the best does not count), so
    a best that is slower than the default on re-timing leaves the default stored."""
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    default_cid, rival = fake.ids[0], fake.ids[6]
    for cid in fake.times:
        fake.times[cid] = 3e-3 + 1e-6 * len(fake.times) - 1e-6 * fake.ids.index(cid)  # distinct, all slow
    runner_up = fake.ids[8]  # second in the search, ahead of the default: not re-timed at confirm_top=1
    fake.times[default_cid], fake.times[rival], fake.times[runner_up] = 1e-3, 1e-4, 5e-4
    seen = _retime(fake, lambda cid: 1.5e-3 if cid == rival else None)  # re-timed: the rival is slower
    result = Tuner(fake, Budget(count=1000), INFO, confirm_top=1, confirm_rounds=1).tune(space)
    assert {cid for cid, n in seen.items() if n > 1} == {default_cid, rival}
    assert all(n == 2 for cid, n in seen.items() if cid in (default_cid, rival))
    assert result.best.cid == default_cid


def test_tuner_confirmation_takes_the_median_not_the_mean():
    """One slow outlier among a candidate's three confirmation samples does not decide: the
    median (0.5 ms) beats the default's 1 ms, where the mean (0.33 s) would not."""
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    default_cid, rival = fake.ids[0], fake.ids[4]
    fake.times[default_cid], fake.times[rival] = 1e-3, 4e-4
    seen: dict[str, int] = {}
    orig = fake.time

    def time(bucket, cfg, cutoff=None):
        cid = config_id(cfg, "fp8")
        seen[cid] = seen.get(cid, 0) + 1
        if cid == rival and seen[cid] > 1:
            return 1.0 if seen[cid] == 3 else 5e-4  # confirmation: 0.5 ms, 1 s, 0.5 ms
        return orig(bucket, cfg, cutoff)

    fake.time = time
    result = Tuner(fake, Budget(count=1000), INFO, confirm_top=1, confirm_rounds=3).tune(space)
    assert seen[rival] == 4 and result.best.cid == rival
    assert result.speedup == pytest.approx(1e-3 / 5e-4)  # default over best, confirmed medians


def test_tuner_times_candidates_with_an_early_out_after_the_best_so_far():
    """The default gets a full timing; every later candidate is told the cutoff, EARLY_OUT times
    the fastest correct time seen so far (a slow candidate may then stop early)."""
    from snapmla_cli.tuning.tuner import EARLY_OUT

    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    cutoffs: list[tuple[str, float | None]] = []
    orig = fake.time

    def time(bucket, cfg, cutoff=None):
        t = orig(bucket, cfg, cutoff)
        cutoffs.append((config_id(cfg, "fp8"), cutoff))
        return t

    fake.time = time
    Tuner(fake, Budget(count=4), INFO, confirm_rounds=0).tune(space)
    assert cutoffs[0] == (fake.ids[0], None) and len(cutoffs) == 5
    best = fake.times[fake.ids[0]]
    for cid, cutoff in cutoffs[1:]:
        assert cutoff == pytest.approx(EARLY_OUT * best)
        best = min(best, fake.times[cid])


@pytest.mark.parametrize("faster_by,stored_default", [(0.01, True), (0.05, False)])
def test_tuner_keeps_the_default_within_the_tie_margin(faster_by, stored_default):
    """A candidate 1% faster than the default on the confirmation medians is within the noise,
    and the default (whose split policy settles per batch size) stays; one 5% faster replaces it."""
    from snapmla_cli.tuning.tuner import TIE_MARGIN

    assert 0.01 < TIE_MARGIN < 0.05
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    default_cid, rival = fake.ids[0], fake.ids[7]
    base = 1e-3
    for cid in fake.times:
        fake.times[cid] = base * 2
    fake.times[default_cid], fake.times[rival] = base, base / (1 + faster_by)
    result = Tuner(fake, Budget(count=1000), INFO).tune(space)
    assert (result.best.cid == default_cid) == stored_default
    assert result.best.cid in (default_cid, rival)


def test_tuner_keeps_the_default_when_confirmation_favours_it():
    """A candidate that looked faster in the search but loses the interleaved re-timing to the
    heuristic default is not stored: the entry is the default's configuration at 1.0x."""
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    default_cid = fake.ids[0]
    _retime(fake, lambda cid: 1e-6 if cid == default_cid else 1.0)  # re-timing: the default is fastest
    result = Tuner(fake, Budget(count=1000), INFO).tune(space)
    assert result.best.cid == default_cid
    assert result.speedup == pytest.approx(1.0)
    assert result.entry.config == tdb.strip_sms(space.default)


def test_resume_after_interrupt(tmp_path):
    space = small_space()
    path = partial_path(tmp_path, GPU)
    assert path.name == "Test_GPU_X100.partial.json"
    first = FakeMeasurer(space, interrupt_after=6)
    with pytest.raises(KeyboardInterrupt):
        Tuner(first, Budget(count=1000), INFO, partial=PartialStore(path, GPU, "k1"),
              confirm_rounds=0).tune(space)
    data = json.loads(path.read_text())
    results = data["buckets"][space.bucket.id]["results"]
    assert len([r for r in results.values() if r["status"] == "ok"]) == 6
    assert all(r["status"] != "started" for r in results.values())  # Ctrl-C: nothing blamed

    second = FakeMeasurer(space)
    store = PartialStore(path, GPU, "k1")
    result = Tuner(second, Budget(count=1000), INFO, partial=store, confirm_rounds=0).tune(space)
    assert first.timed and not set(first.timed) & set(second.timed)  # nothing timed twice
    assert len(first.timed) + len(second.timed) == len([m for m in result.measured if m.ok])
    assert sum(m.reused for m in result.measured) == len(results)  # 6 timed (+ gated ones)
    reference = Tuner(FakeMeasurer(space), Budget(count=1000), INFO, confirm_rounds=0).tune(space)
    assert result.best.cid == reference.best.cid
    store.finish(space.bucket.id)
    assert not path.exists()


def test_resume_skips_a_candidate_that_crashed(tmp_path):
    space = small_space()
    path = partial_path(tmp_path, GPU)
    store = PartialStore(path, GPU, "k1")
    crashed = space.ids()[2]
    store.started(space.bucket.id, crashed, 1.0)  # as if the process died during it
    fake = FakeMeasurer(space, fastest_wrong=False)
    result = Tuner(fake, Budget(count=1000), INFO, partial=PartialStore(path, GPU, "k1")).tune(space)
    assert crashed not in fake.timed and crashed not in fake.checked
    assert any(m.cid == crashed and not m.ok and "earlier run" in m.detail for m in result.measured)


def test_resume_times_the_default_again_even_if_it_crashed(tmp_path):
    """The default is the baseline every entry is measured against: a crash during it in an
    earlier run does not skip it (it is re-timed), unlike any other candidate."""
    space = small_space()
    path = partial_path(tmp_path, GPU)
    store = PartialStore(path, GPU, "k1")
    default_cid = space.ids()[0]
    store.started(space.bucket.id, default_cid, 1.0)  # as if the process died during the default
    fake = FakeMeasurer(space, fastest_wrong=False)
    result = Tuner(fake, Budget(count=3), INFO, partial=PartialStore(path, GPU, "k1")).tune(space)
    assert default_cid in fake.timed and result.default.ok and result.entry is not None


def test_a_sticky_error_during_the_default_leaves_it_to_be_timed_again(tmp_path):
    """A fatal CUDA error stops the run and marks the candidate it hit as failed, so that the
    resumed run skips it; but the default is the baseline of every entry: marked failed, the
    resumed run stored nothing and blamed the default for failing the gate."""
    space = small_space()
    path = partial_path(tmp_path, GPU)

    class Sticky(FakeMeasurer):
        def time(self, bucket, cfg, cutoff=None):
            raise FatalMeasureError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(FatalMeasureError):
        Tuner(Sticky(space), Budget(count=5), INFO, partial=PartialStore(path, GPU, "k1")).tune(space)
    assert space.ids()[0] not in PartialStore(path, GPU, "k1").results(space.bucket.id)
    fake = FakeMeasurer(space, fastest_wrong=False)
    result = Tuner(fake, Budget(count=5), INFO, partial=PartialStore(path, GPU, "k1")).tune(space)
    assert fake.timed[0] == space.ids()[0] and result.default.ok and result.entry is not None
    assert not any("default failed" in n for n in result.notes)


def test_a_sticky_error_during_another_candidate_skips_it_on_resume(tmp_path):
    space = small_space()
    path = partial_path(tmp_path, GPU)
    victim = space.ids()[1]

    class StickyOnVictim(FakeMeasurer):
        def time(self, bucket, cfg, cutoff=None):
            if config_id(cfg, self.fmt) == victim:
                raise FatalMeasureError("CUDA error: an illegal memory access was encountered")
            return super().time(bucket, cfg, cutoff)

    with pytest.raises(FatalMeasureError):
        Tuner(StickyOnVictim(space, fastest_wrong=False), Budget(count=1000), INFO,
              partial=PartialStore(path, GPU, "k1")).tune(space)
    assert PartialStore(path, GPU, "k1").results(space.bucket.id)[victim]["status"] == "failed"
    fake = FakeMeasurer(space, fastest_wrong=False)
    Tuner(fake, Budget(count=1000), INFO, partial=PartialStore(path, GPU, "k1")).tune(space)
    assert victim not in fake.timed


@pytest.mark.parametrize("flaky_is_default", [False, True])
def test_a_candidate_whose_re_timing_raises_is_never_stored(flaky_is_default: bool) -> None:
    """The confirmation medians decide; a contender with a re-timing that raised has only its
    phase-1 sample, which a lucky first timing makes the fastest. It must not win on it; a
    default that cannot be re-timed leaves no baseline, so nothing is stored."""
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    flaky = fake.ids[0] if flaky_is_default else fake.ids[2]
    fake.times[flaky] = 1e-5  # the fastest on its first timing
    orig = fake.time

    def time(bucket, cfg, cutoff=None):
        cid = config_id(cfg, fake.fmt)
        if cid == flaky and cid in fake.timed:
            raise RuntimeError("CUDA error: the launch timed out")
        return orig(bucket, cfg, cutoff)

    fake.time = time
    result = Tuner(fake, Budget(count=1000), INFO).tune(space)
    assert any(f"confirmation of {flaky} failed" in n for n in result.notes)
    if flaky_is_default:
        assert result.entry is None and any("default's re-timing failed" in n for n in result.notes)
    else:
        assert result.best is not None and result.best.cid != flaky
        assert result.entry is not None and result.entry.time_us > 1e-5 * 1e6


def test_concurrent_tuners_on_two_gpus_keep_separate_partial_files(tmp_path):
    """One `snapmla tune` per GPU of a node writes the same folder: each GPU's resume file is its
    own, so one process's snapshot never replaces the other's crash marker or results."""
    space = small_space()
    a = PartialStore(partial_path(tmp_path, GPU, "GPU-aaaa"), GPU, "k1")
    b = PartialStore(partial_path(tmp_path, GPU, "GPU-bbbb"), GPU, "k1")
    assert a.path != b.path and a.path.name == "Test_GPU_X100.GPU-aaaa.partial.json"
    b.started(space.bucket.id, space.ids()[1], 1.0)  # b is timing (or crashes in) a candidate
    a.started(space.bucket.id, space.ids()[2], 1.0)
    a.finish(space.bucket.id)
    assert not a.path.exists()
    resumed = PartialStore(b.path, GPU, "k1")
    assert resumed.results(space.bucket.id)[space.ids()[1]] == {"status": "started"}
    b.finish(space.bucket.id)
    b.finish(space.bucket.id)  # the file already gone: no FileNotFoundError


def test_a_default_that_fails_the_gate_is_still_timed_and_a_zero_time_is_refused():
    """A default that fails the correctness gate is still timed (a note says it failed); a
    timing of 0 s is a failed measurement, not the fastest candidate."""
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    default_cid, zero = fake.ids[0], fake.ids[2]
    fake.wrong = {default_cid}
    fake.times[zero] = 0.0
    cutoffs: list[float | None] = []
    orig = fake.time

    def time(bucket, cfg, cutoff=None):
        cutoffs.append(cutoff)
        return orig(bucket, cfg, cutoff)

    fake.time = time
    result = Tuner(fake, Budget(count=1000), INFO, confirm_rounds=0).tune(space)
    assert cutoffs[:2] == [None, None]  # a failed default's time is no best to cut off after
    assert not result.default.ok and result.default.time_s == pytest.approx(fake.times[default_cid])
    assert any("default failed the correctness gate" in n for n in result.notes)
    (zero_m,) = [m for m in result.measured if m.cid == zero]
    assert not zero_m.ok and zero_m.time_s is None and "timing returned 0.0" in zero_m.detail


@pytest.mark.parametrize("confirm_rounds", [0, 3])
def test_a_default_that_fails_the_gate_is_never_the_stored_entry(confirm_rounds: int) -> None:
    """The failed default is the fastest, and every correct candidate is within the tie margin
    of it: the tie rule must not hand the bucket to the default, which the nearest-bucket lookup
    would then serve to neighbouring shapes too."""
    space = small_space()
    fake = FakeMeasurer(space, fastest_wrong=False)
    default_cid = fake.ids[0]
    fake.wrong = {default_cid}
    fake.times = {cid: 1e-3 * (1.0 + 0.001 * (cid != default_cid) + 1e-6 * i)
                  for i, cid in enumerate(fake.times)}
    result = Tuner(fake, Budget(count=1000), INFO, confirm_rounds=confirm_rounds).tune(space)
    assert not result.default.ok
    assert result.best is not None and result.best.ok and result.best.cid != default_cid
    assert result.entry is not None and result.entry.config != tdb.strip_sms(space.default)


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d, b: d["buckets"][b]["results"].update(x={"status": "ok", "time_s": float("nan")}), "time_s nan"),
    (lambda d, b: d["buckets"][b]["results"].update(x={"status": "ok", "time_s": 0}), "time_s 0"),
    (lambda d, b: d["buckets"][b].update(elapsed_s=-5.0), "elapsed_s"),
    (lambda d, b: d["buckets"][b].update(elapsed_s=10**400), "elapsed_s"),
    (lambda d, b: d["buckets"].update({b: []}), "is malformed"),
    (lambda d, b: d["buckets"][b].update(results=None), "is malformed"),
    (lambda d, b: d.update(buckets=[]), "not a mapping"),
    (lambda d, b: d.update(version=99), "version 99"),
    (lambda d, b: d.pop("version"), "version None"),
])
def test_a_corrupt_partial_file_starts_over_instead_of_feeding_the_search(tmp_path, edit, needle):
    """A NaN time would sort a slower candidate first; a negative elapsed time would never use up
    the budget; a malformed bucket raised AttributeError; another version may mean other timings."""
    space = small_space()
    path = partial_path(tmp_path, GPU)
    store = PartialStore(path, GPU, "k1")
    store.started(space.bucket.id, space.ids()[1], 1.0)
    assert PartialStore(path, GPU, "k1").buckets  # the clean file resumes
    data = json.loads(path.read_text())
    edit(data, space.bucket.id)
    path.write_text(json.dumps(data))
    resumed = PartialStore(path, GPU, "k1")
    assert resumed.buckets == {} and needle in resumed.note and "starting over" in resumed.note
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert "unreadable (RecursionError)" in PartialStore(path, GPU, "k1").note


def test_partial_file_for_other_gpu_or_kernels_is_ignored(tmp_path):
    space = small_space()
    path = partial_path(tmp_path, GPU)
    store = PartialStore(path, GPU, "k1")
    store.started(space.bucket.id, space.ids()[1], 1.0)
    assert PartialStore(path, GPU, "k2").buckets == {}
    assert "another GPU" in PartialStore(path, replace(GPU, sm_count=114), "k1").note
    assert PartialStore(path, GPU, "k1", resume=False).buckets == {}
    path.write_text("{not json")
    assert "unreadable" in PartialStore(path, GPU, "k1").note


# ---------------------------------------------------------------------------------------------
# the command


def tiny_app():
    app = typer.Typer(add_completion=False)
    app.command()(tune_command)
    return app


def test_tune_dry_run_lists_search_space(isolated_db):
    result = CliRunner().invoke(tiny_app(), ["--heads", "64", "--mtp", "2", "--batch", "1,64",
                                             "--ctx", "16k,128k", "--format", "both",
                                             "--budget", "40", "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "fp8 kernel variants for 128 rows" in out and "bf16 kernel variants" in out
    assert "h_q 64 s_q 2 batch 64 ctx 128k fp8" in out and "8 buckets" in out
    assert "40 candidates per bucket" in out and "pruned" in out
    # one table per kernel family and row count, however many buckets share it
    assert out.count("fp8 kernel variants for 128 rows") == 1 == out.count("bf16 kernel variants for 128 rows")
    # the small-work rule gives b 1 16k 32-row tiles and the other FP8 buckets 64-row tiles: both
    # defaults are marked in the one FP8 table, and the buckets table names each bucket's
    assert "v3-rg2-wa-rr3-st5-c1 (default)" in out and "v3-rg4-wm-st4-c1 (default)" in out
    assert "v3-rg2-wa-rr3-st5-c1/1x1-mb4" in out


def test_tune_dry_run_names_the_stored_configuration_timed_after_the_default(isolated_db, monkeypatch):
    """On a GPU, --dry-run's buckets table names what a run measures right after the default: the
    configuration of the bucket's stored entry (here the shipped one), or '-' without an entry."""
    _, shipped = isolated_db
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(lookup, "device_gpu_key", lambda index: GPU)
    space = small_space()
    last = space.candidates[-1]
    save_entries(shipped, GPU, [replace(entry(64, 2, (1, 1), (4096, 4096)), config=tdb.strip_sms(last))])
    result = CliRunner().invoke(tiny_app(), ["--heads", "64", "--mtp", "2", "--batch", "1", "--ctx", "4k,8k",
                                             "--budget", "4", "--dry-run"], terminal_width=250)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "h_q 64 s_q 2 batch 1" in line]
    assert len(rows) == 2 and config_id(last, "fp8") in rows[0] and config_id(last, "fp8") not in rows[1]
    assert rows[1].rstrip(" │|").endswith("-")


@pytest.mark.skipif(torch.cuda.is_available(), reason="names the file of a machine without a GPU")
def test_tune_dry_run_names_the_database_file_it_would_write(isolated_db, tmp_path):
    folder = tmp_path / "db"
    result = CliRunner().invoke(tiny_app(), ["--heads", "16", "--mtp", "1", "--batch", "4", "--ctx", "1k",
                                             "--budget", "4", "--dry-run", "--db-dir", str(folder)])
    assert result.exit_code == 0, result.output
    assert f"database: {folder / '<GPU name>.yaml'}" in " ".join(result.output.split())


def test_tune_says_when_the_decode_calls_do_not_read_its_folder(isolated_db, tmp_path):
    """A --db-dir that is neither the user's folder nor the shipped one is written, but no decode
    call reads it: the dry run (and the run's end) says so and names the variable that would."""
    user, shipped = isolated_db
    args = ["--heads", "16", "--mtp", "1", "--batch", "4", "--ctx", "1k", "--budget", "4", "--dry-run", "--db-dir"]
    elsewhere = CliRunner().invoke(tiny_app(), [*args, str(tmp_path / "db")], terminal_width=400)
    assert elsewhere.exit_code == 0, elsewhere.output
    assert " ".join(elsewhere.output.split()).endswith(
        f"note: the decode calls read the tuning database from {user} and {shipped}, not from {tmp_path / 'db'}: "
        f"set SNAPMLA_TUNING_DIR={tmp_path / 'db'} where they run to use these entries")
    for read in (user, shipped, user / "." / "x" / ".."):
        result = CliRunner().invoke(tiny_app(), [*args, str(read)], terminal_width=400)
        assert result.exit_code == 0 and "note:" not in result.output, result.output


def test_tune_interrupted_exits_130_and_says_it_resumes(isolated_db, monkeypatch):
    from snapmla_cli.cli import tune as tune_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_cli, "_tune", interrupted)
    result = CliRunner().invoke(tiny_app(), ["--dry-run"])
    assert result.exit_code == 130
    assert result.stderr.startswith("interrupted: measurements so far are kept") and "resume" in result.stderr
    assert "the same command again" in result.stderr
    # with --no-resume, the same command again would start over
    result = CliRunner().invoke(tiny_app(), ["--dry-run", "--no-resume"])
    assert result.exit_code == 130 and "again without --no-resume to resume" in result.stderr


def cpu_measurer(space, runs: list[FakeMeasurer]) -> type[FakeMeasurer]:
    """A stand-in for GpuMeasurer on the CPU: FakeMeasurer's times over ``space`` (the fastest
    candidate right), each instance appended to ``runs``, so that ``snapmla tune``'s real run
    path (cli/tune.py ``_run``) runs without a GPU."""

    class CpuMeasurer(FakeMeasurer):
        device, sm_count, uuid = torch.device("cpu"), 132, "GPU-0a1b"

        def __init__(self) -> None:
            super().__init__(space, fastest_wrong=False)
            runs.append(self)

        def precompile(self, items, progress) -> None:
            pass

    return CpuMeasurer


def _cpu_tune_run(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> tuple[SearchSpace, list[FakeMeasurer], pathlib.Path]:
    """``snapmla tune``'s real run path (cli/tune.py ``_run``) on the CPU: the small space, the GPU
    measurer replaced by FakeMeasurer (each run's appended to the list returned) and this GPU
    faked; returns (space, runs, database folder)."""
    from snapmla_cli.tuning import measure

    space = small_space()
    runs: list[FakeMeasurer] = []
    monkeypatch.setattr(measure, "GpuMeasurer", cpu_measurer(search_space(space.bucket, 132), runs))
    monkeypatch.setattr(lookup, "device_gpu_key", lambda index: GPU)
    return space, runs, tmp_path / "db"


def _store_current(folder: pathlib.Path, space: SearchSpace, config: DecodeConfig, time_us: float,
                   default_time_us: float) -> None:
    """A stored entry of ``space``'s bucket that is current: these kernel sources, this default."""
    from snapmla_cli.runtime.nvrtc import kernel_dir, product_sources_hash

    bucket = space.bucket
    default = tdb.strip_sms(space.default)
    save_entries(folder, GPU, [Entry(bucket=bucket, config=config, time_us=time_us, default_time_us=default_time_us,
                                     date="2026-12-01", snapmla_version="0.1.0", command="snapmla tune",
                                     default_config=default, kernels=product_sources_hash(kernel_dir()),
                                     timed_at={"batch": bucket.timed_batch, "context": bucket.timed_context},
                                     candidates=1)])


def test_force_retunes_a_bucket_already_tuned_with_these_kernels(isolated_db, monkeypatch, tmp_path, capsys):
    """A resumed ``snapmla tune`` skips a bucket whose stored entry is current (these kernel
    sources, this default); with ``--force`` it is timed again. The GPU measurer is replaced by
    FakeMeasurer, so the real run path (cli/tune.py ``_run``) runs on the CPU."""
    from snapmla_cli.cli import tune as tune_cli
    from snapmla_cli.tuning.tuner import Budget

    space, runs, folder = _cpu_tune_run(monkeypatch, tmp_path)
    bucket = space.bucket
    default = tdb.strip_sms(space.default)
    _store_current(folder, space, default, 50.0, 50.0)
    tune_cli._run([bucket], Budget(count=2), folder, "--db-dir", True, False, "snapmla tune")
    assert runs[-1].timed == []  # already tuned: skipped
    assert "re-timed" not in capsys.readouterr().out
    tune_cli._run([bucket], Budget(count=2), folder, "--db-dir", True, True, "snapmla tune --force")
    assert runs[-1].timed and runs[-1].timed[0] == config_id(space.default, "fp8")
    # an entry timed with other kernel sources is re-timed on resume, and the table says why
    stored = tdb.find_entry(folder, GPU, bucket)
    save_entries(folder, GPU, [replace(stored, kernels="0123456789abcdef")], force=True)
    capsys.readouterr()
    tune_cli._run([bucket], Budget(count=2), folder, "--db-dir", True, False, "snapmla tune")
    assert runs[-1].timed
    assert "re-timed: the stored entry was timed with other kernel sources" in capsys.readouterr().out
    # the re-timing measures the stored configuration right after the default, even with a
    # one-candidate budget that the static order would spend on another kernel variant
    last = space.candidates[-1]
    stored = tdb.find_entry(folder, GPU, bucket)
    save_entries(folder, GPU, [replace(stored, config=tdb.strip_sms(last), kernels="0123456789abcdef")], force=True)
    capsys.readouterr()
    tune_cli._run([bucket], Budget(count=1), folder, "--db-dir", True, False, "snapmla tune")
    assert runs[-1].timed[:2] == [config_id(space.default, "fp8"), config_id(last, "fp8")]
    now_us = runs[-1].times[config_id(last, "fp8")] * 1e6
    said = " ".join(capsys.readouterr().out.split())
    assert (f"the stored configuration {config_id(last, 'fp8')}: {now_us:.1f} us now, {stored.time_us:.1f} us stored"
            in said)


def test_a_kept_stored_entry_is_shown_with_its_own_times(isolated_db, monkeypatch, tmp_path, capsys):
    """When the merge keeps the stored entry (faster than this run's best), the final table shows
    that entry's configuration with its own times, not this run's best time beside the stored
    configuration (a pair nothing measured), and the bucket's log line names this run's best."""
    from snapmla_cli.cli import tune as tune_cli
    from snapmla_cli.tuning.tuner import Budget

    space, runs, folder = _cpu_tune_run(monkeypatch, tmp_path)
    bucket = space.bucket
    stored_cfg = tdb.strip_sms(space.candidates[-1])
    _store_current(folder, space, stored_cfg, 0.5, 0.6)
    capsys.readouterr()
    tune_cli._run([bucket], Budget(count=3), folder, "--db-dir", False, False, "snapmla tune --no-resume")
    out = capsys.readouterr()
    (row,) = [line for line in out.out.splitlines() if bucket.label() in line and "│" in line]
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[1:5] == ["0.6", "0.5", "1.200x", config_id(stored_cfg, "fp8")]
    assert "kept the stored entry (0.5 us), faster than this run's" in " ".join(out.out.split())
    best = min((t, cid) for cid, t in runs[-1].times.items() if cid in runs[-1].timed)[1]
    logged = " ".join((out.out + out.err).split())
    assert f"{bucket.label()}: default" in logged and best in logged


def test_tune_stale_retimes_the_stale_buckets_and_records_each_ones_command(isolated_db, monkeypatch, tmp_path):
    """``snapmla tune --stale`` takes its buckets from this GPU's stale entries (the user's entry
    shadows the shipped one of the same bucket), re-times them into the folder, and each new entry
    records the command that names its bucket; a bucket option next to it is refused, and a run
    with nothing stale says so and measures nothing. The measurer is FakeMeasurer on the CPU."""
    from snapmla_cli.cli import tune as tune_cli
    from snapmla_cli.runtime.nvrtc import kernel_dir, product_sources_hash
    from snapmla_cli.tuning import measure

    user, shipped = isolated_db
    kernels = product_sources_hash(kernel_dir())
    space = small_space()
    bucket = space.bucket  # h64 s2 b1 4k fp8
    shadowed = Bucket(64, 2, (1, 1), (8192, 8192), "fp8")
    runs: list[FakeMeasurer] = []
    monkeypatch.setattr(measure, "GpuMeasurer", cpu_measurer(space, runs))
    monkeypatch.setattr(lookup, "device_gpu_key", lambda index: GPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def stored(b: Bucket, stamp: str) -> Entry:
        cfg = tdb.strip_sms(default_config(b, 132))
        return Entry(bucket=b, config=cfg, time_us=1.0, default_time_us=1.0, date="2026-12-01",
                     snapmla_version="0.1.0", command="snapmla tune", default_config=cfg, kernels=stamp,
                     timed_at={"batch": b.timed_batch, "context": b.timed_context}, candidates=1)

    save_entries(shipped, GPU, [stored(bucket, "0123456789abcdef"), stored(shadowed, "0123456789abcdef")])
    save_entries(user, GPU, [stored(shadowed, kernels)])  # current, and the lookup takes it first
    assert lookup.stale_buckets(GPU, ["fp8", "bf16"]) == [(bucket, "other kernel sources")]
    assert lookup.stale_buckets(GPU, ["bf16"]) == []
    # written to another folder than the user's (--db-dir tuning_db refreshes the shipped file),
    # --stale re-times that folder's own stale entries, shadowed by the user's or not
    assert tune_cli._stale_source(user) is None and tune_cli._stale_source(shipped) == shipped
    assert lookup.stale_buckets(GPU, ["fp8"], shipped) == [(bucket, "other kernel sources"),
                                                           (shadowed, "other kernel sources")]
    assert lookup.stale_buckets(GPU, ["fp8"], user) == []
    assert lookup.stale_buckets(GPU, ["fp8"], user / "absent") == []

    refused = CliRunner().invoke(tiny_app(), ["--stale", "--heads", "64"])
    assert refused.exit_code == 2
    assert refused.stderr.strip() == "error: --stale takes its buckets from the tuning database; drop --heads"
    result = CliRunner().invoke(tiny_app(), ["--stale", "--budget", "2", "--db-dir", str(user)])
    assert result.exit_code == 0, result.output
    assert runs and runs[-1].timed
    [new] = [e for e in load_file(user / tdb.db_filename(GPU.name)).sections[0].entries if e.bucket == bucket]
    assert new.kernels == kernels
    assert new.command == "snapmla tune --heads 64 --mtp 2 --batch 1 --ctx 4k --format fp8 --budget 2"
    # the user's entry now shadows the shipped stale one: nothing is left to re-time
    done = len(runs)
    nothing = CliRunner().invoke(tiny_app(), ["--stale", "--db-dir", str(user)])
    assert nothing.exit_code == 0 and "nothing to re-time" in nothing.output and len(runs) == done


def test_stale_buckets_come_in_order_of_urgency(isolated_db):
    """``snapmla tune --stale`` re-times entries timed against another default first (they may
    now lose to the heuristic), then FP8 before BF16, then in the file's order, so that a run cut
    short by time (``gpu_check.sh stale``) has done the urgent ones."""
    from snapmla_cli.runtime.nvrtc import kernel_dir, product_sources_hash

    user, _ = isolated_db
    kernels = product_sources_hash(kernel_dir())

    def stale(b: Bucket, stamp: str, default: DecodeConfig) -> Entry:
        return replace(entry(b.h_q, b.s_q, b.batch, b.context, b.format), kernels=stamp, default_config=default)

    old = "0123456789abcdef"
    bf16 = Bucket(64, 2, (64, 64), (16384, 16384), "bf16")
    fp8_kernels = Bucket(64, 2, (64, 64), (131072, 131072), "fp8")
    fp8_default = Bucket(64, 2, (1, 1), (16384, 16384), "fp8")  # the small-work rule moved its default
    fp8_both = Bucket(64, 1, (1, 1), (16384, 16384), "fp8")
    today = {b: tdb.strip_sms(default_config(b, GPU.sm_count)) for b in (bf16, fp8_kernels, fp8_default, fp8_both)}
    assert heuristic_config(128) not in (today[fp8_default], today[fp8_both])
    save_entries(user, GPU, [stale(bf16, old, today[bf16]), stale(fp8_kernels, old, today[fp8_kernels]),
                             stale(fp8_default, kernels, heuristic_config(128)),
                             stale(fp8_both, old, heuristic_config(128))])
    assert lookup.stale_buckets(GPU, ["fp8", "bf16"]) == [
        (fp8_both, "other kernel sources"), (fp8_default, "another default"),
        (fp8_kernels, "other kernel sources"), (bf16, "other kernel sources")]


def test_bucket_command_names_the_bucket_it_came_from():
    """The command an entry re-timed by --stale records parses back to its own bucket."""
    from snapmla_cli.sizes import parse_int_list
    from snapmla_cli.tuning.space import bucket_command, make_buckets

    for b in (Bucket(64, 2, (1, 1), (16384, 16384), "fp8"), Bucket(16, 1, (16, 128), (16384, 65536), "bf16")):
        words = bucket_command(b, "5s").split()
        opts = dict(zip(words[2::2], words[3::2]))
        assert words[:2] == ["snapmla", "tune"] and opts["--budget"] == "5s"
        rebuilt = make_buckets(parse_int_list(opts["--heads"], "--heads", 128), parse_int_list(opts["--mtp"], "--mtp", 8),
                               parse_ranges(opts["--batch"], "--batch"), parse_ranges(opts["--ctx"], "--ctx"),
                               parse_formats(opts["--format"]))
        assert rebuilt == [b]


def test_a_stored_entry_timed_with_other_kernels_gives_way_and_is_named(isolated_db):
    """A faster stored entry timed with other kernel sources is replaced (its time says nothing
    about these kernels, and kept it would stay stale for every resumed run), and the log names
    its configuration."""
    from snapmla_cli.cli.tune import merge_note

    user, _ = isolated_db
    save_entries(user, GPU, [replace(entry(t=100.0), kernels="old-kernels")])
    new = entry(t=130.0)
    _, [outcome] = save_entries(user, GPU, [new])
    assert outcome.action == "replaced" and outcome.previous.kernels == "old-kernels"
    note = merge_note(outcome, new)
    assert note is not None and note.startswith("replaced a stored entry timed with other kernel sources (100.0 us")
    _, [same] = save_entries(user, GPU, [entry(t=140.0)])  # the same kernels, slower: kept
    assert same.action == "kept_old"


def test_tune_errors_are_one_line(isolated_db):
    runner = CliRunner()
    bad = runner.invoke(tiny_app(), ["--budget", "lots", "--dry-run"])
    assert bad.exit_code == 2 and bad.stderr.strip().startswith("error: --budget")
    if not torch.cuda.is_available():
        nogpu = runner.invoke(tiny_app(), ["--heads", "16", "--ctx", "1k"])
        assert nogpu.exit_code == 2, nogpu.output
        lines = nogpu.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "GPU" in lines[0]
        for args in (["--stale"], ["--stale", "--dry-run"]):  # which entries are stale depends on the GPU
            stale = runner.invoke(tiny_app(), args)
            assert stale.exit_code == 2
            assert stale.stderr.strip() == ("error: --stale: no CUDA GPU here, and which entries are stale "
                                            "depends on the GPU")


class _FakeGraph:
    def replay(self) -> None:
        pass


def test_precompile_includes_the_cluster_merge_builds(monkeypatch):
    """A b 64 timing of a wgmma candidate launches its cluster-merge build (equal lengths: 2
    splits a request); the tuner compiled it inside the bucket's budget until the thirty-fourth
    session (10 NVRTC compiles in one 6 s bucket of h16 s1, docs/PERF.md). The mma.sync kernels
    have no such build, and SNAPMLA_CLUSTER_FOLD=0 needs none."""
    from snapmla_cli.tuning import measure
    from snapmla_cli.tuning.space import kernel_key, kernel_keys

    wgmma, mma = heuristic_config(16, True), heuristic_config(16, True, dc.FP8_MMA_SYNC)
    bf16 = heuristic_config(64, False)
    for cfg, fmt in ((wgmma, "fp8"), (bf16, "bf16")):
        keys = kernel_keys(cfg, fmt)
        assert keys[0] == kernel_key(cfg, fmt) and len(keys) == 2
        assert dict(keys[1][1]) == {**dict(keys[0][1]), "CLUSTER_FOLD": 1}
    assert kernel_keys(mma, "fp8") == (kernel_key(mma, "fp8"),)
    compiled: list = []
    monkeypatch.setattr(measure, "compile_jobs", lambda jobs, *a, **k: compiled.extend(jobs) or {})
    measurer = object.__new__(measure.GpuMeasurer)  # no GPU: only the job list is built
    measurer.arch, measurer.compile_workers, measurer.compile_errors = "sm_90a", 1, {}
    measurer.precompile([("fp8", wgmma), ("fp8", mma)])
    assert compiled == [*kernel_keys(wgmma, "fp8"), kernel_key(mma, "fp8")]
    monkeypatch.setenv("SNAPMLA_CLUSTER_FOLD", "0")
    assert kernel_keys(wgmma, "fp8") == (kernel_key(wgmma, "fp8"),)


@pytest.mark.parametrize("spilling", [0, 1])
def test_gpu_measurer_rejects_a_candidate_whose_cluster_build_spills(spilling: int) -> None:
    """A timing of a cluster-capable candidate loads its cluster-merge build too: a resource
    problem (spills, serialized wgmma) in either build fails the candidate before its check."""
    from snapmla_cli.tuning import measure
    from snapmla_cli.tuning.space import kernel_keys

    bucket = Bucket(16, 1, (64, 64), (16384, 16384), "fp8")
    cfg = heuristic_config(16, True)
    keys = kernel_keys(cfg, "fp8")
    assert len(keys) == 2
    measurer = object.__new__(measure.GpuMeasurer)  # no GPU: only the compile-error lookup runs
    measurer._checked, measurer._guard = {}, lambda fn: fn()
    measurer._check = lambda b, c: CheckResult(True, "numerics ok")
    measurer.compile_errors = {key: ("ptxas: spills 96 bytes" if i == spilling else None)
                               for i, key in enumerate(keys)}
    result = measurer.check(bucket, cfg)
    assert not result.ok and result.detail == "compile failed: ptxas: spills 96 bytes"
    measurer.compile_errors = dict.fromkeys(keys)
    assert measurer.check(bucket, cfg).ok


@pytest.mark.parametrize("cutoff, expect_s", [(None, 1e-3), (1e-3, 2e-3)])
def test_gpu_measurer_times_graph_replays_at_boost_clocks(monkeypatch, cutoff, expect_s):
    """The tuner times one rotation of calls (one per cache copy) captured as a CUDA graph, per
    call; a candidate slower than the cut-off stops after one replay; the others are timed after
    an idle pause within a short window (TUNE_CLOCKS), so the H200 stays at its boost clock
    instead of drifting into the power cap (docs/PERF.md, fifteenth session)."""
    import snapmla_cli.ops.decode as decode_ops
    from snapmla_cli.tuning import measure

    decoded: list[str] = []
    monkeypatch.setattr(decode_ops, "get_mla_metadata", lambda *a, **k: ("meta", "splits"))
    monkeypatch.setattr(decode_ops, "decode_fp8", lambda q, cache, table, *a, **k: decoded.append(table))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    captured: list[int] = []

    def capture(step):
        before = len(decoded)
        step()
        captured.append(len(decoded) - before)
        return _FakeGraph()

    timings: list[tuple[int, object]] = []

    def time_cuda(fn, reps=20, warmup=3, rounds=5, clocks=None):
        timings.append((reps, clocks))
        return 6e-3 if clocks is None else 3e-3  # seconds per replay of the 3-call rotation

    monkeypatch.setattr(measure, "capture_graph", capture)
    monkeypatch.setattr(measure, "time_cuda", time_cuda)
    measurer = object.__new__(measure.GpuMeasurer)  # no GPU: only the timing logic runs
    measurer.device, measurer.clocks = torch.device("cpu"), measure.TUNE_CLOCKS
    bucket = Bucket(16, 1, (64, 64), (2048, 2048), "fp8")
    measurer._inputs = measure._TimingInputs(bucket, None, None, ["t0", "t1", "t2"], None, None, None)

    assert measurer._time(bucket, heuristic_config(16, True), cutoff) == pytest.approx(expect_s)
    assert decoded[:3] == ["t0", "t1", "t2"] and captured == [3]  # loaded, then one rotation captured
    assert timings[0] == (1, None)  # the cut-off's single replay
    if cutoff is None:
        assert timings[1][1] is measure.TUNE_CLOCKS and len(timings) == 2
        assert measure.TUNE_CLOCKS.cooldown_s >= 0.05 and measure.TUNE_CLOCKS.measure_s <= 0.025
    else:
        assert len(timings) == 1


# ---------------------------------------------------------------------------------------------
# GPU: a tiny real run


@pytest.mark.gpu
def test_tune_on_gpu_end_to_end(isolated_db):
    user, _ = isolated_db
    lookup.clear_cache()
    monkey_key = lookup.device_gpu_key(torch.cuda.current_device())
    result = CliRunner().invoke(tiny_app(), ["--heads", "16", "--mtp", "1", "--batch", "4",
                                             "--ctx", "2k", "--budget", "3", "--db-dir", str(user)])
    assert result.exit_code == 0, result.output + result.stderr
    path = user / tdb.db_filename(monkey_key.name)
    [section] = load_file(path).sections
    [stored] = section.entries
    assert stored.time_us > 0 and stored.default_time_us > 0 and stored.candidates >= 2
    assert not list(user.glob("*.partial.json"))
    # the entry made stale (other kernel sources) with a configuration the static order reaches
    # last: --stale re-times exactly that bucket, and that configuration right after the default
    last = search_space(stored.bucket, monkey_key.sm_count or 132).candidates[-1]
    save_entries(user, monkey_key, [replace(stored, kernels="0123456789abcdef", config=tdb.strip_sms(last))],
                 force=True)
    lookup.clear_cache()
    again = CliRunner().invoke(tiny_app(), ["--stale", "--budget", "1", "--db-dir", str(user)], terminal_width=250)
    assert again.exit_code == 0, again.output + again.stderr
    assert "re-timed: the stored entry was timed with other kernel sources" in again.output
    assert f"the stored configuration {config_id(last, 'fp8')}: " in again.output
    [retimed] = load_file(path).sections[0].entries
    assert retimed.kernels == stored.kernels and retimed.time_us > 0 and retimed.candidates == 2
    assert retimed.config in (tdb.strip_sms(last), stored.default_config)
    assert retimed.command == "snapmla tune --heads 16 --mtp 1 --batch 4 --ctx 2k --format fp8 --budget 1"


def test_config_from_spec_parses_the_kernel_scripts_format():
    """``bench_decode.py --sweep`` and ``precompile.py`` name configs as
    version:row_groups:kv_split:stages:ctas[:qk:pv[:wg_mode[:rope_ring]]]; omitted switches keep defaults."""
    cfg = dc.config_from_spec("3:4:1:3:1:1:1:2")
    assert (cfg.kernel_version, cfg.row_groups, cfg.stages, cfg.min_ctas_per_sm) == (3, 4, 3, 1)
    assert (cfg.qk_promote, cfg.pv_promote, cfg.wg_mode) == (1, 1, dc.WG_PINGPONG)
    short = dc.config_from_spec("2:1:2:2:2")
    assert short.kv_split == 2 and short.split.ctas_per_sm == 2
    assert (short.qk_promote, short.pv_promote, short.wg_mode) == dc.WGMMA_SWITCH_DEFAULTS
    ring = dc.config_from_spec("3:2:1:5:1:1:1:3:3")
    assert (ring.stages, ring.wg_mode, ring.rope_ring) == (5, dc.WG_ALT_PAGES, 3) and dc.fp8_config_valid(ring)
    for bad in ("3:4", "3:4:1:4", "3:4:1:x:1", "3:4:1:4:1:1:1:0:9:1"):  # ctas is required
        with pytest.raises(ValueError, match="kernel spec"):
            dc.config_from_spec(bad)


def test_shipped_databases_are_clean_measurements():
    """Issue 5: the shipped tuning_db/ holds real `snapmla tune` results. Every file parses with
    no skipped entry, sits under its GPU's file name, has one entry per bucket, and every entry
    records its command, kernels hash and date and is never slower than the heuristic default
    it was measured against (tuned beats or equals the default)."""
    files = sorted((pathlib.Path(__file__).resolve().parents[1] / "tuning_db").glob("*.yaml"))  # (tests isolate shipped_dir)
    assert files, "no shipped tuning database"
    for path in files:
        loaded = load_file(path)
        assert loaded.problems == [], loaded.problems
        assert loaded.sections
        for section in loaded.sections:
            assert path.name == tdb.db_filename(section.gpu.name)
            buckets = [e.bucket.id for e in section.entries]
            assert section.entries and len(buckets) == len(set(buckets)), path
            for e in section.entries:
                assert e.command.startswith("snapmla tune "), e.command
                assert e.kernels and e.date and e.default_config is not None and e.candidates > 0
                assert e.time_us <= e.default_time_us, (e.bucket.id, e.time_us, e.default_time_us)


def test_list_gpus_reads_nvml_and_matches_torch_sm_counts_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML's CUDA driver version 13010 is "13.1" (major 13); a GPU's SM count is torch's for
    its UUID, else for its index; a clock NVML cannot report is None."""
    import sys
    from types import SimpleNamespace

    from snapmla_cli.runtime import gpu_facts

    def max_clock(handle: int, which: int) -> int:
        if which == 1:
            raise RuntimeError("NVMLError_NotSupported")
        return 1980

    count = {"n": 2}
    fake = SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, NVML_CLOCK_SM=0, NVML_CLOCK_MEM=1,
        nvmlSystemGetDriverVersion=lambda: b"580.65.06", nvmlSystemGetCudaDriverVersion_v2=lambda: 13010,
        nvmlDeviceGetCount=lambda: count["n"], nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}f", nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=141 * 2**30), nvmlDeviceGetMaxClockInfo=max_clock)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(gpu_facts, "_sm_counts", lambda: {"GPU-1f": 132, "index-0": 114})
    listing = gpu_facts.list_gpus()
    assert listing.reason == "" and [g.sm_count for g in listing.gpus] == [114, 132]
    g = listing.gpus[1]
    assert (g.name, g.uuid, g.driver_version, g.cuda_driver_version) == ("NVIDIA H200", "GPU-1f", "580.65.06", "13.1")
    assert g.cuda_driver_major == 13 and g.key == ("NVIDIA H200", 132, (9, 0), 13)
    assert (g.max_sm_clock_mhz, g.max_mem_clock_mhz) == (1980, None)
    assert gpu_facts.nvml_uuid(SimpleNamespace(uuid="1f")) == "GPU-1f"
    assert gpu_facts.nvml_uuid(SimpleNamespace()) is None
    count["n"] = 0
    assert gpu_facts.list_gpus() == gpu_facts.GpuListing([], "NVML reports no GPU")
    # a query failing after nvmlInit (a lost GPU, one the container may not query): a reason, no
    # traceback out of `snapmla info`
    count["n"] = 2

    def lost(handle: int) -> object:
        raise RuntimeError("NVMLError_Unknown: Unknown Error")

    fake.nvmlDeviceGetMemoryInfo = lost
    assert gpu_facts.list_gpus() == gpu_facts.GpuListing([], "NVML failed (RuntimeError: NVMLError_Unknown: Unknown Error)")


def test_the_recorded_command_pastes_back_into_a_shell(monkeypatch, tmp_path):
    """An entry's command is for reproducing it: `--ctx "16k, 32k"` stays one argument."""
    import shlex

    from snapmla_cli.cli import tune as tune_cli

    seen: list[str] = []
    monkeypatch.setattr(tune_cli, "_run", lambda *args: seen.append(args[6]))
    tune_cli._tune(tune_cli.BucketOptions("64", "2", "64", "16k, 32k", "fp8"), "8s", False, True, tmp_path,
                   False, False)
    assert shlex.split(seen[0]) == ["snapmla", "tune", "--heads", "64", "--mtp", "2", "--batch", "64",
                                    "--ctx", "16k, 32k", "--format", "fp8", "--budget", "8s"]


def test_tune_refuses_a_database_it_would_damage_before_timing_anything(isolated_db, monkeypatch, tmp_path):
    """A database file that cannot be parsed would lose what this version cannot read on the
    merge: ``snapmla tune`` refuses it (without --force) before the first candidate is timed, not
    after the whole search."""
    from snapmla_cli.cli import tune as tune_cli
    from snapmla_cli.tuning import measure
    from snapmla_cli.tuning.tuner import Budget

    space = small_space()
    runs: list[FakeMeasurer] = []
    monkeypatch.setattr(measure, "GpuMeasurer", cpu_measurer(search_space(space.bucket, 132), runs))
    monkeypatch.setattr(lookup, "device_gpu_key", lambda index: GPU)
    folder = tmp_path / "db"
    folder.mkdir()
    damaged = folder / tdb.db_filename(GPU.name)
    damaged.write_text("format: snapmla-tuning/1\ndevices: [unclosed\n")
    with pytest.raises(SnapmlaError, match=re.escape(str(damaged))):
        tune_cli._run([space.bucket], Budget(count=2), folder, "--db-dir", True, False, "snapmla tune")
    assert runs and runs[-1].timed == []
    assert damaged.read_text() == "format: snapmla-tuning/1\ndevices: [unclosed\n"
