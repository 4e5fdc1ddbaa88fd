"""GPU tests that close the gaps a coverage review found (fifty-fourth session): every
registered decode build against the reference, all-empty batches, the caller's out / lse,
work lists planned for another format or row count, the tuner's split policies, GraphWorkList
for every kernel kind, the registered prep builds, int64 slots past int32. Every test: fresh random data (``random_problem`` /
``wide_rows``), NaN-poisoned unused cache rows (the problems' own poisoning) and NaN-poisoned
outputs, checked against the references of ``snapmla_cli`` (float64 ``decode_reference``,
``emulate_fp8_decode`` with the work list's split bounds, the reference quantizer / packer).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from graph_steps import replay_steps  # this folder is sys.path[0]
from sibling_modules import load

from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.emulation import emulate_fp8_decode
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.numerics.problem import random_problem
from snapmla_cli.numerics.quant import quantize_rows

pytestmark = pytest.mark.gpu

EMUL_GATE = 5e-3
BF16_COS_GATE = 5e-6
LSE_GATE = 1e-2
COLUMN_LENS = [0, 1, 63, 64, 65, 4097, 9000, 300, 0, 2500]
COLUMN_SMS = 11


# ---------------------------------------------------------------- decode helpers


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _nan_outputs(b: int, s_q: int, h_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((b, h_q, s_q), float("nan"), dtype=torch.float32, device=device)
    return out, lse


def _operands(prob, fp8: bool, device: torch.device):
    if fp8:
        return quantize_rows(prob.q.to(device)), prob.fp8_cache().to(device)
    return prob.q.to(device), prob.bf16_cache().to(device)


def _heuristic_call(prob, fp8: bool, version: int, device: torch.device):
    """The arguments of a decode call of ``prob`` at the heuristic configuration of ``version``:
    (config, q, cache, lengths, block table, metadata, num_splits), on ``device``."""
    from snapmla_cli.ops.decode import get_mla_metadata
    from snapmla_cli.ops.decode_config import heuristic_config

    _b, s_q, h_q, _ = prob.q.shape
    cfg = heuristic_config(s_q * h_q, fp8, version).with_sms(_sms(device))
    q, cache = _operands(prob, fp8, device)
    lens_t = prob.layout.cache_seqlens.to(device)
    table = prob.layout.block_table.to(device)
    meta, splits = get_mla_metadata(lens_t, s_q * h_q, 1, fp8=fp8, config=cfg)
    return cfg, q, cache, lens_t, table, meta, splits


def _decode(fp8: bool):
    from snapmla_cli.ops.decode import decode_bf16, decode_fp8

    return decode_fp8 if fp8 else decode_bf16


def _check_against_reference(prob, fp8: bool, out, lse, cache, meta, splits, device, lens=None) -> None:
    """FP8: the emulation of the work list's split bounds; BF16: float64. Both: the lse, and
    empty rows exactly (out 0, lse +inf); ``compare`` makes any NaN left in out / lse fail."""
    from snapmla_cli.ops.schedule import split_token_bounds

    lens = prob.layout.cache_seqlens.tolist() if lens is None else lens
    table = prob.layout.block_table.to(device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    if fp8:
        bounds = split_token_bounds(splits, meta, lens)
        ref_out, ref_lse = emulate_fp8_decode(quantize_rows(prob.q.to(device)), cache, table, lens_t,
                                              prob.softmax_scale, prob.causal, split_bounds=bounds)
        assert compare(out, ref_out).rel_l2 <= EMUL_GATE, compare(out, ref_out)
    else:
        ref_out, ref_lse = decode_reference(prob.q.to(device), cache.squeeze(2), table, lens_t,
                                            prob.softmax_scale, prob.causal)
        assert compare(out, ref_out).cos_diff <= BF16_COS_GATE, compare(out, ref_out)
    assert compare(lse, ref_lse).max_abs < LSE_GATE, compare(lse, ref_lse)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.all(out[i] == 0) and torch.all(lse[i] == float("inf"))


def _run(prob, fp8: bool, cfg, device):
    """One decode of ``prob`` with caller buffers NaN-poisoned: (out, lse, cache, meta, splits)."""
    from snapmla_cli.ops.decode import get_mla_metadata

    b, s_q, h_q, _ = prob.q.shape
    q, cache = _operands(prob, fp8, device)
    lens = prob.layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(lens, s_q * h_q, 1, fp8=fp8, config=cfg)
    out, lse = _nan_outputs(b, s_q, h_q, device)
    got = _decode(fp8)(q, cache, prob.layout.block_table.to(device), lens, meta, splits, prob.softmax_scale,
                       prob.causal, config=cfg, out=out, lse=lse)
    assert got[0] is out and got[1] is lse  # written in place, not into new tensors
    return out, lse, cache, meta, splits


# ---------------------------------------------------------------- every registered build


def _registered_decode_builds() -> list[tuple[bool, object, str]]:
    """(fp8, DecodeConfig, id) of every decode build runtime/registry.py registers (what CI
    compiles and what the heuristics, ``verify --fp8-kernel`` and the tuner can select), but
    the cluster-merge builds (CLUSTER_FOLD: test_split_fold_gpu.py's cluster tests run them).
    The configuration is rebuilt from the build's defines and must give them back exactly."""
    from snapmla_cli.ops.decode_config import DecodeConfig, bf16_defines, fp8_defines
    from snapmla_cli.ops.schedule import SplitPolicy
    from snapmla_cli.runtime.registry import KERNEL_SOURCES

    builds = []
    for source, variants in KERNEL_SOURCES.items():
        if not source.startswith("decode_"):
            continue
        fp8 = source.startswith("decode_fp8")
        wgmma = source.endswith("_wgmma.cu")
        for var in variants:
            d = dict(var.defines)
            if d.get("CLUSTER_FOLD"):
                continue
            ctas = d["MIN_CTAS_PER_SM"]
            split = SplitPolicy(ctas_per_sm=ctas, balanced=bool(d.get("COLUMN_ITEMS", 0)))
            fields = {"row_groups": d["ROW_GROUPS"], "stages": d["STAGES"], "min_ctas_per_sm": ctas,
                      "kernel_version": 3 if wgmma else 2}
            if fp8 and wgmma:
                fields.update(qk_promote=d["QK_PROMOTE"], pv_promote=d["PV_PROMOTE"], wg_mode=d["WG_MODE"],
                              rope_ring=d.get("ROPE_RING", 0))
            elif fp8:
                fields.update(kv_split=d["KV_SPLIT"])
            elif not wgmma:
                fields.update(block_n=d["BLOCK_N"])
            cfg = DecodeConfig(**fields, split=split)
            assert (fp8_defines(cfg) if fp8 else bf16_defines(cfg)) == d, (source, d)
            name = "-".join(f"{k.lower()}{v}" for k, v in sorted(d.items()) if k != "SNAPMLA_EXPECT_SMEM")
            builds.append((fp8, cfg, f"{source.removesuffix('.cu')}:{name}"))
    return builds


REGISTERED = _registered_decode_builds()


@pytest.mark.parametrize("fp8,cfg", [(f, c) for f, c, _ in REGISTERED], ids=[i for _, _, i in REGISTERED])
def test_every_registered_decode_build_matches_reference_and_repeats_bitwise(fp8, cfg):
    """Gap: registered builds no GPU test runs (dims split at 16/32 rows one-item; the column
    builds of dims split / own rows / ping-pong at 16 and 32 rows and of dims split at 64 rows;
    the auto-balance ones only when the planner happens to pick them). Two row tiles (the second
    partial), s_q 2 causal, h_q not a power of two, empty / 1 / 63 / 64 / 65-token requests."""
    from snapmla_cli.ops.decode_config import runs_columns

    device = torch.device("cuda")
    cfg = cfg.with_sms(COLUMN_SMS if cfg.split.balanced else _sms(device))
    h_q = cfg.block_m // 2 + 3  # 2 x h_q = block_m + 6 rows
    prob = random_problem(COLUMN_LENS, 2, h_q, causal=True, seed=cfg.block_m + cfg.wg_mode * 7 + cfg.stages)
    out, lse, cache, meta, splits = _run(prob, fp8, cfg, device)
    if runs_columns(cfg, fp8):
        assert meta.shape[1] > 1  # the column build really ran columns of items
    assert out.isfinite().all()
    _check_against_reference(prob, fp8, out, lse, cache, meta, splits, device)
    again = _run(prob, fp8, cfg, device)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


# ---------------------------------------------------------------- all requests empty


KINDS = [(True, 3), (True, 2), (False, 3), (False, 2)]
KIND_IDS = ["fp8-wgmma", "fp8-mma-sync", "bf16-wgmma", "bf16-mma-sync"]


@pytest.mark.parametrize("fp8,version", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("lens", [[0], [0, 0, 0]], ids=["b1", "b3"])
def test_a_batch_of_only_empty_requests_writes_zeros_and_inf(lens, fp8, version):
    """Gap: no GPU test has every request empty. The work list is empty, so no decode kernel is
    launched (DecodePlan.decode is None) and the combine alone must write every row: out 0,
    lse +inf over NaN-poisoned caller buffers, and in freshly allocated ones too."""
    device = torch.device("cuda")
    s_q, h_q = 2, 20
    prob = random_problem(lens, s_q, h_q, causal=True, seed=3)
    cfg, q, cache, lens_t, table, meta, splits = _heuristic_call(prob, fp8, version, device)
    assert meta.shape[0] * meta.shape[1] == 0 or bool((meta[:, :, 2] == meta[:, :, 1]).all())
    out, lse = _nan_outputs(len(lens), s_q, h_q, device)
    got = _decode(fp8)(q, cache, table, lens_t, meta, splits, prob.softmax_scale, True, config=cfg,
                       out=out, lse=lse)
    fresh = _decode(fp8)(q, cache, table, lens_t, meta, splits, prob.softmax_scale, True, config=cfg)
    torch.cuda.synchronize()
    for o, s in (got, fresh):
        assert bool((o == 0).all()), "an empty request's output must be exactly 0"
        assert bool((s == float("inf")).all()), "an empty request's lse must be +inf"


# ---------------------------------------------------------------- caller buffers


@pytest.mark.parametrize("fp8,version", KINDS, ids=KIND_IDS)
def test_caller_out_and_lse_are_written_in_place(fp8, version):
    """Gap: the suite passes out= / lse= but rebinds the names to the returned tensors, so a
    decode that wrote fresh tensors and left the caller's untouched would pass (only the FP8
    GraphWorkList test reads the caller's buffers). Here: the returned tensors are the caller's,
    fully overwritten (NaN-poisoned before), with out alone, lse alone and both, on a first
    call of the signature and on its replay, and the bits equal an out=None call's."""
    device = torch.device("cuda")
    lens = [0, 1, 65, 4097, 300]
    s_q, h_q = 2, 20
    prob = random_problem(lens, s_q, h_q, causal=True, seed=41)
    cfg, q, cache, lens_t, table, meta, splits = _heuristic_call(prob, fp8, version, device)
    decode = _decode(fp8)

    def call(out=None, lse=None):
        return decode(q, cache, table, lens_t, meta, splits, prob.softmax_scale, True, config=cfg,
                      out=out, lse=lse)

    ref_out, ref_lse = call()
    _check_against_reference(prob, fp8, ref_out, ref_lse, cache, meta, splits, device)
    for _ in range(2):  # the signature's first call, then its replayed plan
        for give_out, give_lse in ((True, True), (True, False), (False, True)):
            out, lse = _nan_outputs(len(lens), s_q, h_q, device)
            got = call(out if give_out else None, lse if give_lse else None)
            if give_out:
                assert got[0] is out
            if give_lse:
                assert got[1] is lse
            assert torch.equal(got[0], ref_out) and torch.equal(got[1], ref_lse)


# ---------------------------------------------------------------- metadata of another format / rows


@pytest.mark.parametrize("case", ["bf16-on-fp8-cluster-list", "bf16-flashmla-default-list",
                                  "fp8-on-bf16-column-list"])
def test_a_work_list_planned_for_another_format_decodes_right(case):
    """Gap: FlashMLA's callers plan with get_mla_metadata's default (fp8=True) and then decode a
    BF16 cache; decode_config_for then picks a fresh BF16 configuration but _split_fold still
    hands it the FP8 plan's fold (its counters, fold limit and cluster size: the BF16 wgmma
    kernel runs the FP8 plan's clusters). No GPU test decodes a list planned for the other
    format; each must still match the reference (NaN-poisoned outputs). A list planned for other
    rows is refused by name (tests/test_decode_host_args.py), as FlashMLA refuses its metadata."""
    from snapmla_cli.ops.decode import flash_mla_with_kvcache, get_mla_metadata, metadata_plan
    from snapmla_cli.ops.decode_config import heuristic_config, variant_config

    device = torch.device("cuda")
    if case == "bf16-on-fp8-cluster-list":
        lens, s_q, h_q, fp8 = [513, 0, 4097, 9000, 700, 2500, 1000, 4600], 1, 16, False
        plan_cfg = variant_config(16, 3, wg_mode=3, row_groups=1)
        plan_cfg = replace(plan_cfg, split=replace(plan_cfg.split, max_splits_per_request=2,
                                                   min_blocks_per_split=1)).with_sms(400)
        plan_rows, plan_fp8 = 16, True
    elif case == "bf16-flashmla-default-list":
        lens, s_q, h_q, fp8 = [0, 1, 65, 4097, 9000, 300], 2, 20, False
        plan_cfg, plan_rows, plan_fp8 = None, 40, True
    else:  # fp8-on-bf16-column-list
        lens, s_q, h_q, fp8 = COLUMN_LENS, 2, 64, True
        plan_cfg = heuristic_config(128, False, 3).with_sms(COLUMN_SMS)  # balanced columns
        plan_rows, plan_fp8 = 128, False
    prob = random_problem(lens, s_q, h_q, causal=True, seed=len(case))
    lens_t = prob.layout.cache_seqlens.to(device)
    table = prob.layout.block_table.to(device)
    meta, splits = get_mla_metadata(lens_t, plan_rows, 1, fp8=plan_fp8, config=plan_cfg)
    plan = metadata_plan(meta)
    if case == "bf16-on-fp8-cluster-list":
        assert plan is not None and plan.fold is not None and plan.fold.cluster == 2
    if case == "fp8-on-bf16-column-list":
        assert meta.shape[1] > 1  # a column work list
    q, cache = _operands(prob, fp8, device)
    if case == "bf16-flashmla-default-list":
        out, lse = flash_mla_with_kvcache(prob.q.to(device), cache, table, lens_t, 512, meta, splits,
                                          prob.softmax_scale, True)
    else:
        out, lse = _nan_outputs(len(lens), s_q, h_q, device)
        got = _decode(fp8)(q, cache, table, lens_t, meta, splits, prob.softmax_scale, True, out=out, lse=lse)
        assert got[0] is out and got[1] is lse
    torch.cuda.synchronize()
    assert out.isfinite().all()
    _check_against_reference(prob, fp8, out, lse, cache, meta, splits, device)


# ---------------------------------------------------------------- tuner split policies


POLICY_KERNELS = [(True, 1, 16), (True, 2, 32), (False, 2, 24)]  # (fp8, s_q, h_q)


@pytest.mark.parametrize("fp8,s_q,h_q", POLICY_KERNELS, ids=["fp8-alt16", "fp8-rows-m64", "bf16-wgmma48"])
def test_every_tuner_split_policy_of_the_default_kernel_matches_reference(fp8, s_q, h_q):
    """Gap: the tuner stores any of tuning/space.split_policies' policies (ctas_per_sm x waves 1,
    2, 4 at min_blocks 2 / 4 / 8 / 16, balanced columns at each min_blocks, auto balance); the
    suite pins only a few (the heuristic's, min_blocks 1, one huge one, max_splits 2/4/8). Each
    policy with the heuristic kernel must match the reference of its own split bounds, leave no
    NaN in the poisoned buffers, and repeat bit for bit; the policies must give several lists."""
    from snapmla_cli.ops.decode_config import heuristic_config
    from snapmla_cli.tuning.space import split_policies

    device = torch.device("cuda")
    kernel = heuristic_config(s_q * h_q, fp8).with_sms(_sms(device))
    policies = split_policies(kernel, kernel.split, fp8)
    assert len(policies) > 4
    prob = random_problem([0, 1, 63, 65, 4097, 9000, 300, 2500], s_q, h_q, causal=True, seed=h_q + s_q)
    shapes = set()
    for policy in policies:
        cfg = replace(kernel, split=policy)
        out, lse, cache, meta, splits = _run(prob, fp8, cfg, device)
        _check_against_reference(prob, fp8, out, lse, cache, meta, splits, device)
        again = _run(prob, fp8, cfg, device)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), policy
        shapes.add((tuple(meta.shape), tuple(splits.tolist())))
    assert len(shapes) >= 3  # the policies really differ in their work lists


# ---------------------------------------------------------------- GraphWorkList


@pytest.mark.parametrize("fp8,version", KINDS, ids=KIND_IDS)
def test_graph_work_list_replays_every_kernel_kind_and_an_all_empty_step(fp8, version):
    """Gap: GraphWorkList / CUDA-graph replay is tested with the FP8 default only, and never with
    a step whose requests are all empty. Here the mma.sync kernels (empty places: load Q, write
    a scratch slot) and the BF16 kernels too, h_q 20 with s_q 2 causal; each replay over
    NaN-poisoned buffers matches that step's reference; the first step's lengths again give its
    bits."""
    from snapmla_cli.ops.decode_config import heuristic_config
    from snapmla_cli.ops.graph_work_list import GraphWorkList

    device = torch.device("cuda")
    s_q, h_q = 2, 20
    longest = [5000, 64, 700, 4097, 9000]
    steps = [longest, [0, 0, 0, 0, 0], [130, 3, 0, 4000, 65], longest]
    prob = random_problem(longest, s_q, h_q, causal=True, seed=version + 10 * fp8)
    config = None if version == 3 else heuristic_config(s_q * h_q, fp8, version).with_sms(_sms(device))
    work = GraphWorkList(len(longest), s_q * h_q, device, fp8=fp8, config=config)
    q, cache = _operands(prob, fp8, device)
    table = prob.layout.block_table.to(device)
    lens = torch.tensor(longest, dtype=torch.int32, device=device)
    out, lse = _nan_outputs(len(longest), s_q, h_q, device)
    work.update(torch.tensor(longest, dtype=torch.int32))

    def step():
        _decode(fp8)(q, cache, table, lens, work.metadata, work.num_splits, prob.softmax_scale, True,
                     out=out, lse=lse)

    def check(host: torch.Tensor) -> None:
        _check_against_reference(prob, fp8, out, lse, cache, work.metadata, work.num_splits, device,
                                 lens=host.tolist())

    results = replay_steps(step, work, lens, out, lse, steps, check)
    assert bool((results[1][0] == 0).all()) and bool((results[1][1] == float("inf")).all())
    assert torch.equal(results[0][0], results[-1][0]) and torch.equal(results[0][1], results[-1][1])


# ---------------------------------------------------------------- prep


P = load("test_prep")  # its data and checks: wide_rows, poisoned caches, reference_append, ...


def _other_prep_variants() -> list[dict[str, int]]:
    from snapmla_cli.runtime.registry import KERNEL_SOURCES, PREP_DEFINES, PREP_SOURCE

    return [dict(v.defines) for v in KERNEL_SOURCES[PREP_SOURCE] if dict(v.defines) != PREP_DEFINES]


PREP_VARIANTS = _other_prep_variants()


@pytest.mark.parametrize("defines", PREP_VARIANTS,
                         ids=["-".join(f"{k.lower()}{v}" for k, v in sorted(d.items())) for d in PREP_VARIANTS])
def test_registered_prep_variants_give_the_reference_bytes_on_the_gpu(defines):
    """Gap: the prep builds the registry adds (4 warps x 1 row per warp; the strided content
    map) run only in the host emulation (test_prep_emulation.py), never on the GPU, where the
    PTX stores and the real lane timing differ. Each kernel of each build against the reference
    bytes: Q-quant, append (int32 and int64 slots, -1 padding, out of range, into an
    0xFF-poisoned cache), paged / slot / SoA fetch."""
    from snapmla_cli.cache.layout import quantize_tokens, unpack_tokens
    from snapmla_cli.numerics.formats import D_QK, FP8_TOKEN_BYTES, PAGE_SIZE
    from snapmla_cli.ops.prep import fetch_dequant_slots, fetch_dequant_soa
    from snapmla_cli.runtime.launch import get_kernel, i32, i64, launch
    from snapmla_cli.runtime.registry import PREP_SOURCE

    dev = torch.device("cuda")
    per_cta = defines["PREP_WARPS_PER_CTA"] * defines["PREP_ROWS_PER_WARP"]
    block = 32 * defines["PREP_WARPS_PER_CTA"]

    def run(name, rows, args):
        kernel = get_kernel(PREP_SOURCE, name, defines, device=dev.index or 0)
        launch(kernel, max(1, -(-rows // per_cta)), block, args)

    # Q-quant, an odd row count (the last CTA partial)
    rows = 1003
    q = P.wide_rows(rows, seed=1)
    content = torch.full((rows, 512), 0xAB, dtype=torch.uint8, device=dev)
    scale = torch.full((rows,), float("nan"), device=dev)
    rope = torch.full((rows, 64), float("nan"), dtype=torch.bfloat16, device=dev)
    qd = q.to(dev)
    run("snapmla_quantize_q", rows, [qd, content, scale, rope, i64(rows)])
    ref = quantize_rows(q)
    P.assert_bytes_equal("content", content, ref.content)
    P.assert_bytes_equal("scale", scale, ref.scale)
    P.assert_bytes_equal("rope", rope, ref.rope)

    # K-append, both slot types, padding and out-of-range slots
    n, blocks = 301, 7
    num_slots = blocks * PAGE_SIZE
    kv = P.wide_rows(n, seed=2)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(3))[:n].to(torch.int32)
    slots[::17] = -1
    slots[1], slots[2] = num_slots, -12345
    for name, slot_dtype in (("snapmla_append_kv", torch.int32), ("snapmla_append_kv_i64", torch.int64)):
        ref_cache = P.poisoned_cache(blocks)
        P.reference_append(kv, slots, ref_cache)
        cache = P.poisoned_cache(blocks).to(dev)
        run(name, n, [kv.to(dev), slots.to(dev, slot_dtype), i64(n), cache, i64(num_slots)])
        P.assert_bytes_equal(name, cache, ref_cache)

    # fetch: paged (an empty request, partial pages, zero rows past the total), slots, SoA
    layout, tokens, cache = P.paged_problem([70, 0, 1, 128, 5], seed=4)
    ref_rows = torch.cat([P.ref_dequant(t) for t in tokens])
    total = ref_rows.shape[0] + 9
    cu = torch.zeros(len(tokens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(layout.cache_seqlens, 0)
    out = torch.full((total, D_QK), float("nan"), dtype=torch.bfloat16, device=dev)
    table = layout.block_table.to(dev)
    run("snapmla_fetch_dequant_paged", total,
        [cache.to(dev), i64(cache.shape[0] * PAGE_SIZE), table, i32(table.shape[1]), cu.to(dev),
         i32(len(tokens)), out, i64(total)])
    P.assert_bytes_equal("paged", out[: ref_rows.shape[0]], ref_rows)
    assert bool((out[ref_rows.shape[0]:] == 0).all())
    flat = quantize_tokens(P.wide_rows(5 * PAGE_SIZE, seed=6))  # [320, 656], every slot a token
    g = torch.Generator().manual_seed(5)
    fslots = torch.randint(-2, flat.shape[0] + 3, (777,), generator=g, dtype=torch.int32)
    paged = flat.view(-1, PAGE_SIZE, FP8_TOKEN_BYTES)
    for name, slot_dtype in (("snapmla_fetch_dequant_slots", torch.int32), ("snapmla_fetch_dequant_slots_i64", torch.int64)):
        out = torch.full((777, D_QK), float("nan"), dtype=torch.bfloat16, device=dev)
        run(name, 777, [paged.to(dev), i64(flat.shape[0]), fslots.to(dev, slot_dtype), i64(777), out])
        P.assert_bytes_equal(name, out, fetch_dequant_slots(paged, fslots))
    soa = unpack_tokens(flat)
    soa_content = soa.content.view(torch.uint8).contiguous()
    for name, slot_dtype in (("snapmla_fetch_dequant_soa", torch.int32), ("snapmla_fetch_dequant_soa_i64", torch.int64)):
        out = torch.full((777, D_QK), float("nan"), dtype=torch.bfloat16, device=dev)
        run(name, 777, [soa_content.to(dev), soa.scale.to(dev), soa.rope.to(dev), i64(flat.shape[0]),
                        fslots.to(dev, slot_dtype), i64(777), out])
        P.assert_bytes_equal(name, out, fetch_dequant_soa(soa_content, soa.scale, soa.rope, fslots))


def test_append_kv_int64_slots_beyond_int32_are_skipped_not_truncated():
    """Gap: the int64-slot append is tested only with small valid slots. Slots past 2^31 / 2^32
    whose low 32 bits name a real slot (2^32 + 5 -> 5), below -2^31 and -1 padding must write
    nothing; an empty call must leave the cache alone. The fetch side: a -1 block-table entry and
    a negative length read as zeros (unchecked path)."""
    from snapmla_cli.numerics.formats import FP8_TOKEN_BYTES, PAGE_SIZE
    from snapmla_cli.ops.prep import append_kv, fetch_dequant

    dev = torch.device("cuda")
    blocks = 2
    num_slots = blocks * PAGE_SIZE
    slots = torch.tensor([0, 2**32 + 5, -1, 2**40 + 9, -(2**33) + 3, num_slots, 7, 2**31 + 3, 2**32 - 1],
                         dtype=torch.int64)
    kv = P.wide_rows(len(slots), seed=30)
    ref = P.poisoned_cache(blocks)
    P.reference_append(kv, slots, ref)  # slots 0 and 7 only
    got = P.poisoned_cache(blocks).to(dev)
    append_kv(kv.to(dev), slots.to(dev), got)
    P.assert_bytes_equal("int64 slots", got, ref)
    flat = got.view(-1, FP8_TOKEN_BYTES).cpu()
    for untouched in (3, 5, 9, num_slots - 1):
        assert bool((flat[untouched] == 0xFF).all()), f"slot {untouched} was written"
    for slot_dtype in (torch.int32, torch.int64):  # n = 0
        append_kv(kv[:0].to(dev), torch.empty(0, dtype=slot_dtype, device=dev), got)
    P.assert_bytes_equal("after empty appends", got, ref)

    layout, _tokens, cache = P.paged_problem([130, 70, 5], seed=31)
    table = layout.block_table.clone()
    table[0, 1] = -1  # request 0's tokens 64..127 have no page
    lens = layout.cache_seqlens.clone()
    lens[2] = -4  # a negative length counts as 0
    n = 130 + 70
    out = fetch_dequant(cache.to(dev), table.to(dev), lens.to(dev), total_tokens=n + 3).cpu()
    good = fetch_dequant(cache, layout.block_table, layout.cache_seqlens)
    P.assert_bytes_equal("request 0 before the missing page", out[:64], good[:64])
    assert bool((out[64:128] == 0).all())
    P.assert_bytes_equal("request 0 after it", out[128:130], good[128:130])
    P.assert_bytes_equal("request 1", out[130:200], good[130:200])
    assert bool((out[200:] == 0).all())


# ---------------------------------------------------------------- caches past 2^31 bytes

# a cache's pages at byte offsets past 2^31 (FP8: 41,984 B a page, BF16: 73,728): every global
# offset of the decode kernels must be 64-bit (the kernel audit of the fifty-fifth session read
# them all; this runs them)
HIGH_PAGES = {True: 60_000, False: 40_000}
HIGH_LENS = [300, 70, 0, 129]


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_pages_past_two_gigabytes_give_the_bits_of_the_same_pages_low(fp8):
    """The same requests once in their own small cache and once in a large one (2.5-3 GB) whose
    pages they read sit at its far end, the rest of it NaN: the same bits, and the right ones."""
    device = torch.device("cuda")
    prob = random_problem(HIGH_LENS, 2, 16, causal=True, seed=55)
    cfg, q, cache, lens_t, table, meta, splits = _heuristic_call(prob, fp8, 3, device)
    pages = HIGH_PAGES[fp8]
    assert (pages - 1) * cache[0].numel() * cache.element_size() > 2**31
    big = torch.empty((pages, *cache.shape[1:]), dtype=cache.dtype, device=device)
    big.view(torch.uint8).fill_(0xFF)  # NaN in E4M3, in bf16 and in the float32 scales
    high = pages - 1 - torch.arange(cache.shape[0], device=device)  # small block i -> big block high[i]
    big[high] = cache
    big_table = torch.where(table >= 0, high[table.clamp(min=0).long()].int(), table)
    low = _decode(fp8)(q, cache, table, lens_t, meta, splits, prob.softmax_scale, True, config=cfg,
                       out=_nan_outputs(*prob.q.shape[:3], device)[0])
    far = _decode(fp8)(q, big, big_table, lens_t, meta, splits, prob.softmax_scale, True, config=cfg,
                       out=_nan_outputs(*prob.q.shape[:3], device)[0])
    torch.cuda.synchronize()
    assert torch.equal(low[0], far[0]) and torch.equal(low[1], far[1])
    _check_against_reference(prob, fp8, far[0], far[1], cache, meta, splits, device)
