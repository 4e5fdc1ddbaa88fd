"""GPU checks of the FP8 and BF16 decode kernels against the reference numerics.

Fresh random data per case; unused cache rows are NaN bytes, unused block-table entries are
garbage, outputs are NaN-poisoned before each call; lengths mix 0, 1, 63, 64, 65, 4097 and a
long one; h_q includes 1 and 20 (not a power of two). References run in float64 on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from graph_steps import replay_steps  # this folder is sys.path[0]

from snapmla_cli.cache.layout import dequantize_cache
from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.emulation import emulate_fp8_decode
from snapmla_cli.numerics.formats import PAGE_SIZE
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.numerics.problem import random_problem
from snapmla_cli.numerics.quant import quantize_rows

pytestmark = pytest.mark.gpu

EMUL_GATE = 5e-3
FLOOR_FACTOR, FLOOR_ABS = 1.10, 1e-3
BF16_COS_GATE = 5e-6

CASES = [
    # (seqlens, s_q, h_q, causal)
    ([64], 1, 16, False),
    ([1, 63, 64, 65], 1, 1, False),
    ([0, 1, 63, 64, 65, 4097], 2, 20, True),
    ([4097, 0, 300], 3, 64, True),
    ([33000], 1, 128, False),
    ([777, 2048, 65], 2, 128, True),
    ([5000] * 3 + [0], 1, 16, False),
    ([100, 200], 4, 32, True),
    ([130, 0, 2500], 1, 24, True),
]


def _run_fp8(prob, device, split=None):
    from snapmla_cli.ops.decode import decode_fp8, get_mla_metadata

    b, s_q, h_q, _ = prob.q.shape
    cache = prob.fp8_cache().to(device)
    q = prob.q.to(device)
    table = prob.layout.block_table.to(device)
    seqlens = prob.layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(seqlens, s_q * h_q, 1, fp8=True, config=split)
    out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((b, h_q, s_q), float("nan"), dtype=torch.float32, device=device)
    out, lse = decode_fp8(quantize_rows(q), cache, table, seqlens, meta, splits, prob.softmax_scale,
                          prob.causal, config=split, out=out, lse=lse)
    return out, lse, cache, meta, splits


def _config(rows, version, device, **kernel):
    from dataclasses import replace

    from snapmla_cli.ops.decode_config import fp8_config_valid, variant_config

    cfg = variant_config(rows, version, **kernel)
    if not fp8_config_valid(cfg):  # e.g. two 64-row CTAs per SM do not fit: one
        cfg = replace(cfg, min_ctas_per_sm=1)
    cfg = replace(cfg, split=replace(cfg.split, ctas_per_sm=cfg.min_ctas_per_sm))
    return cfg.with_sms(torch.cuda.get_device_properties(device).multi_processor_count)


# (kernel version, overrides): the wgmma kernel at its heuristic, with the dims split at its
# smallest pipeline / two CTAs per SM (the 16-row heuristic until the twenty-first session), in
# its other warpgroup layouts, and unpromoted (diagnostic); the mma.sync kernel
KERNELS = [(3, {}), (3, {"wg_mode": 0, "stages": 2, "min_ctas_per_sm": 2}), (3, {"wg_mode": 1}), (3, {"wg_mode": 2}),
           (3, {"wg_mode": 3}), (3, {"wg_mode": 3, "stages": 2}), (3, {"wg_mode": 4, "row_groups": 4}),
           (3, {"wg_mode": 4, "row_groups": 4, "stages": 2}), (3, {"wg_mode": 6, "row_groups": 4}),
           (3, {"wg_mode": 6, "row_groups": 4, "stages": 2}),
           (3, {"wg_mode": 3, "stages": 5, "rope_ring": 3}), (3, {"wg_mode": 3, "stages": 2, "rope_ring": 2}),
           (3, {"wg_mode": 3, "rope_ring": 0}),
           (3, {"wg_mode": 0, "qk_promote": 0, "pv_promote": 0}), (2, {})]


@pytest.mark.parametrize("version,kernel", KERNELS,
                         ids=["v3", "v3-dims-st2-c2", "v3-rows", "v3-pingpong", "v3-alt", "v3-alt-st2",
                              "v3-rows-m", "v3-rows-m-st2", "v3-vt", "v3-vt-st2", "v3-alt-rr3", "v3-alt-st2-rr2",
                              "v3-alt-rr0",
                              "v3-unpromoted", "v2"])
@pytest.mark.parametrize("seqlens,s_q,h_q,causal", CASES)
def test_fp8_decode_matches_emulation_and_float64(seqlens, s_q, h_q, causal, version, kernel):
    device = torch.device("cuda")
    prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=len(seqlens) * 31 + h_q)
    cfg = _config(s_q * h_q, version, device, **kernel)
    out, lse, cache, meta, splits = _run_fp8(prob, device, cfg)
    from snapmla_cli.ops.schedule import split_token_bounds

    table = prob.layout.block_table.to(device)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    q_rows = quantize_rows(prob.q.to(device))
    bounds = split_token_bounds(splits, meta, seqlens)
    emul_out, emul_lse = emulate_fp8_decode(q_rows, cache, table, seqlens_t, prob.softmax_scale,
                                            causal, split_bounds=bounds)
    ref_out, _ref_lse = decode_reference(prob.q.to(device), prob.bf16_cache().squeeze(2).to(device),
                                        table, seqlens_t, prob.softmax_scale, causal)
    floor_out, _ = decode_reference(q_rows.dequantize(), dequantize_cache(cache), table, seqlens_t,
                                    prob.softmax_scale, causal)
    vs_emul = compare(out, emul_out)
    vs_ref = compare(out, ref_out)
    floor = compare(floor_out, ref_out)
    assert vs_emul.rel_l2 <= EMUL_GATE, vs_emul
    assert vs_ref.rel_l2 <= FLOOR_FACTOR * floor.rel_l2 + FLOOR_ABS, (vs_ref, floor)
    lse_err = compare(lse, emul_lse)
    assert lse_err.max_abs < 1e-2, lse_err
    # empty rows: out exactly 0, lse +inf
    for i, n in enumerate(seqlens):
        if n == 0:
            assert torch.all(out[i] == 0) and torch.all(lse[i] == float("inf"))


# Kernel switches that reorder work without changing a float32 operation (A/B defines of the
# benchmarks, not DecodeConfig fields): define -> (the value other than the kernel's default: the
# code it replaced, or the one on trial; [(s_q, h_q, configuration)])
ALT_1CTA = {"wg_mode": 3, "min_ctas_per_sm": 1}
ROWS_M = {"wg_mode": 4, "row_groups": 4}
ROWS_M_SWITCH_CASES = [(1, 64, ROWS_M), (2, 64, ROWS_M), (1, 40, ROWS_M)]
EXACT_SWITCH_CASES = {
    # a turn's two PVs as one pair (alternate pages, up to 32 rows, one CTA per SM)
    "PV_PAIRS": (0, [(2, 16, {**ALT_1CTA, "stages": 4}), (1, 24, {**ALT_1CTA, "stages": 4}),
                     (1, 16, {**ALT_1CTA, "stages": 4}), (1, 16, {"wg_mode": 3, "stages": 2, "min_ctas_per_sm": 2})]),
    # every warp derives the rows' new state (alternate pages, up to 32 rows)
    "WARP_ROW_STATE": (0, [(2, 16, {**ALT_1CTA, "stages": 4}), (1, 24, {**ALT_1CTA, "stages": 4}),
                           (1, 16, {**ALT_1CTA, "stages": 5}), (1, 16, {**ALT_1CTA, "stages": 2})]),
    # the warp statistics of a thread's 4 or 8 rows reduced by transposition (swapped layouts,
    # <= 32 rows per softmax)
    "TRANSPOSED_STATS": (0, [(2, 16, {**ALT_1CTA, "stages": 4}), (1, 24, {**ALT_1CTA, "stages": 4}),
                             (1, 16, {**ALT_1CTA, "stages": 5}),
                             (1, 64, {"wg_mode": 0, "row_groups": 4, "stages": 3})]),
    # promoted QK with three chunk accumulators in flight (the pipelined swapped layouts)
    "QK_DEPTH": (2, [(2, 16, {**ALT_1CTA, "stages": 4}), (1, 24, {**ALT_1CTA, "stages": 4}),
                     (1, 16, {**ALT_1CTA, "stages": 4}), (1, 16, {"wg_mode": 3, "stages": 2, "min_ctas_per_sm": 2})]),
    # the paired PVs' V^T fragments built two m-tiles ahead
    "PV_FRAG_AHEAD": (0, [(2, 16, {**ALT_1CTA, "stages": 4}), (1, 24, {**ALT_1CTA, "stages": 4}),
                          (1, 16, {**ALT_1CTA, "stages": 4})]),
    # rows = M: a partial page's tail zeroed in shared memory instead of PV's byte masks
    "TAIL_ZERO": (0, ROWS_M_SWITCH_CASES),
    # rows = M: a whole page's scale loads and exponentials without per-token tests
    "ROWS_M_WHOLE": (0, ROWS_M_SWITCH_CASES),
    # the V^T fragments addressed from one offset per page (alternate pages' single and paired
    # PVs, with and without the RoPE ring, one and two CTAs per SM)
    "V_OFFSETS": (0, [*ROWS_M_SWITCH_CASES, (1, 16, {**ALT_1CTA, "stages": 4}), (1, 32, {"wg_mode": 3}),
                      (2, 16, {**ALT_1CTA, "stages": 4, "rope_ring": 0}), (1, 24, {"wg_mode": 3}),
                      (1, 16, {"wg_mode": 3, "stages": 2, "min_ctas_per_sm": 2})]),
}
EXACT_SWITCHES = [(define, old, s_q, h_q, kernel)
                  for define, (old, cases) in EXACT_SWITCH_CASES.items() for s_q, h_q, kernel in cases]


@pytest.mark.parametrize("define,old_value,s_q,h_q,kernel", EXACT_SWITCHES,
                         ids=[f"{d}-{s * h}rows-{i}" for i, (d, _, s, h, _) in enumerate(EXACT_SWITCHES)])
def test_fp8_exact_switches_keep_every_bit(define, old_value, s_q, h_q, kernel):
    """Each switch runs the same float32 operations on the same values in the same order as the
    code it replaced (``define=old_value``), so the output and lse are the same bits: partial
    last pages, empty and single-page work items, odd page counts and the causal mask included."""
    from snapmla_cli.bench.decode_case import extra_defines

    device = torch.device("cuda")
    prob = random_problem([9000, 70, 0, 4097, 129, 64, 1], s_q, h_q, causal=True, seed=11)
    cfg = _config(s_q * h_q, 3, device, **kernel)
    new = _run_fp8(prob, device, cfg)
    with extra_defines({define: old_value}):
        old = _run_fp8(prob, device, cfg)
    assert new[0].isfinite().all()
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


@pytest.mark.parametrize("s_q,h_q,rope_ring,stages", [(2, 16, 3, 5), (1, 32, 3, 5), (1, 16, 3, 5), (1, 24, 2, 2)])
def test_fp8_rope_ring_keeps_every_bit(s_q, h_q, rope_ring, stages):
    """The RoPE ring moves where a page's RoPE tile and scales wait, not what is computed: the
    same output and lse bits as the same layout with them in the page's stage."""
    device = torch.device("cuda")
    prob = random_problem([9000, 70, 0, 4097, 129, 64, 1], s_q, h_q, causal=True, seed=13)
    ring = _config(s_q * h_q, 3, device, wg_mode=3, stages=stages, rope_ring=rope_ring)
    plain = _config(s_q * h_q, 3, device, wg_mode=3, stages=min(stages, 4), rope_ring=0)
    assert ring.rope_ring == rope_ring and plain.rope_ring == 0
    a, b = _run_fp8(prob, device, ring), _run_fp8(prob, device, plain)
    assert a[0].isfinite().all()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("switch", ["TAIL_ZERO", "ROWS_M_WHOLE", "V_OFFSETS"])
def test_fp8_rows_m_switches_keep_every_bit_in_balanced_columns(switch):
    """The rows = M switches of EXACT_SWITCH_CASES in the column build (balanced columns: several
    requests' pieces per CTA, NaN-poisoned unused cache rows, empty and one-token requests)."""
    from snapmla_cli.bench.decode_case import extra_defines
    from snapmla_cli.ops.decode_config import runs_columns

    device = torch.device("cuda")
    prob = random_problem(COLUMN_LENS, 2, 64, causal=True, seed=17)
    cfg = _balanced(_config(128, 3, device, **ROWS_M))
    assert runs_columns(cfg, True)
    new = _run_fp8(prob, device, cfg)
    with extra_defines({switch: 0}):
        old = _run_fp8(prob, device, cfg)
    assert new[0].isfinite().all()
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


@pytest.mark.parametrize("s_q,h_q", [(1, 16), (1, 64), (2, 64), (1, 48)])
def test_bf16_handover_first_keeps_every_bit(s_q, h_q):
    """The BF16 wgmma kernel's turn that takes the hand-over and issues PV(it - 1) before QK(it)
    (HANDOVER_FIRST) runs the same float32 operations in the same order as the QK-first turn:
    the same bits, partial last pages, empty and single-page items and the causal mask included."""
    from snapmla_cli.bench.decode_case import extra_defines

    device = torch.device("cuda")
    prob = random_problem([9000, 70, 0, 4097, 129, 64, 1], s_q, h_q, causal=True, seed=13)
    cfg = _bf16_config(s_q * h_q, 3, device)
    new = _run_bf16(prob, device, cfg)
    with extra_defines({"HANDOVER_FIRST": 0}, bf16=True):
        old = _run_bf16(prob, device, cfg)
    assert new[0].isfinite().all()
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


@pytest.mark.parametrize("version,kernel", [(3, {"wg_mode": m}) for m in (0, 1, 2, 3, 4, 6)]
                         + [(3, {"wg_mode": 3, "stages": 5, "rope_ring": 3}), (2, {})],
                         ids=["v3-dims", "v3-rows", "v3-pingpong", "v3-alt", "v3-rows-m", "v3-vt", "v3-alt-rr3", "v2"])
def test_fp8_decode_bitwise_deterministic_and_split_invariant(version, kernel):
    from dataclasses import replace

    device = torch.device("cuda")
    prob = random_problem([9000, 70, 0, 4097], 2, 64, causal=True, seed=7)
    cfg = _config(128, version, device, **kernel)
    a = _run_fp8(prob, device, cfg)
    b = _run_fp8(prob, device, cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    fine = replace(cfg, split=replace(cfg.split, min_blocks_per_split=1, num_sms=512))
    c = _run_fp8(prob, device, split=fine.with_sms(512))
    assert c[3].shape[0] > a[3].shape[0]  # more splits
    assert compare(c[0], a[0]).rel_l2 < 5e-3


def _run_bf16(prob, device, cfg):
    from snapmla_cli.ops.decode import decode_bf16, get_mla_metadata

    b, s_q, h_q, _ = prob.q.shape
    table = prob.layout.block_table.to(device)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    cache = prob.bf16_cache().to(device)
    meta, splits = get_mla_metadata(seqlens_t, s_q * h_q, 1, fp8=False, config=cfg)
    out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((b, h_q, s_q), float("nan"), dtype=torch.float32, device=device)
    out, lse = decode_bf16(prob.q.to(device), cache, table, seqlens_t, meta, splits,
                           prob.softmax_scale, prob.causal, config=cfg, out=out, lse=lse)
    return out, lse, cache, meta


def _bf16_config(rows, version, device):
    from snapmla_cli.ops.decode_config import heuristic_config

    return heuristic_config(rows, False, version).with_sms(torch.cuda.get_device_properties(device).multi_processor_count)


@pytest.mark.parametrize("version", [3, 2], ids=["wgmma", "mma-sync"])
@pytest.mark.parametrize("seqlens,s_q,h_q,causal", CASES)
def test_bf16_decode_matches_float64(seqlens, s_q, h_q, causal, version):
    device = torch.device("cuda")
    prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=h_q + 5)
    out, lse, cache, _ = _run_bf16(prob, device, _bf16_config(s_q * h_q, version, device))
    table = prob.layout.block_table.to(device)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    ref_out, ref_lse = decode_reference(prob.q.to(device), cache.squeeze(2), table, seqlens_t,
                                        prob.softmax_scale, causal)
    err = compare(out, ref_out)
    assert err.cos_diff <= BF16_COS_GATE, err
    assert compare(lse, ref_lse).max_abs < 1e-2
    for i, n in enumerate(seqlens):
        if n == 0:
            assert torch.all(out[i] == 0) and torch.all(lse[i] == float("inf"))


# DeepSeek-V3's own scale: (128 + 64) ** -0.5 times YaRN's mscale ** 2 (mscale = 0.1 ln 40 + 1),
# what an engine passes (3.2x SPEC's 576 ** -0.5 default, which the random problems use)
MODEL_SOFTMAX_SCALE = 0.13523377886
SCALE_CASES = [([0, 65, 4097], 1, 16, True), ([300, 2048], 2, 16, True), ([1000, 64], 1, 64, False),
               ([777, 130], 2, 64, True)]


@pytest.mark.parametrize("fp8,version", [(True, 3), (True, 2), (False, 3), (False, 2)],
                         ids=["fp8-wgmma", "fp8-mma-sync", "bf16-wgmma", "bf16-mma-sync"])
@pytest.mark.parametrize("seqlens,s_q,h_q,causal", SCALE_CASES)
def test_a_model_softmax_scale_reaches_every_kernel(seqlens, s_q, h_q, causal, fp8, version):
    """Every other decode test runs the default softmax scale, so a kernel that dropped the
    caller's scale (or the host that folds it with log2 e) would pass them all. At DeepSeek-V3's
    scale the output must match the references at that scale, and the references at the two
    scales must differ by far more than the gate (so this test can fail)."""
    device = torch.device("cuda")
    prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=h_q + s_q, softmax_scale=MODEL_SOFTMAX_SCALE)
    table = prob.layout.block_table.to(device)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    bf16_cache = prob.bf16_cache().squeeze(2).to(device)
    ref_out, _ = decode_reference(prob.q.to(device), bf16_cache, table, seqlens_t, MODEL_SOFTMAX_SCALE, causal)
    default_out, _ = decode_reference(prob.q.to(device), bf16_cache, table, seqlens_t, None, causal)
    assert compare(default_out, ref_out).rel_l2 > 20 * EMUL_GATE
    if fp8:
        cfg = _config(s_q * h_q, version, device)
        out, lse, cache, meta, splits = _run_fp8(prob, device, cfg)
        from snapmla_cli.ops.schedule import split_token_bounds

        bounds = split_token_bounds(splits, meta, seqlens)
        emul_out, emul_lse = emulate_fp8_decode(quantize_rows(prob.q.to(device)), cache, table, seqlens_t,
                                                MODEL_SOFTMAX_SCALE, causal, split_bounds=bounds)
        assert compare(out, emul_out).rel_l2 <= EMUL_GATE
        assert compare(lse, emul_lse).max_abs < 1e-2
    else:
        out, lse, _, _ = _run_bf16(prob, device, _bf16_config(s_q * h_q, version, device))
        _, ref_lse = decode_reference(prob.q.to(device), bf16_cache, table, seqlens_t, MODEL_SOFTMAX_SCALE,
                                      causal)
        assert compare(out, ref_out).cos_diff <= BF16_COS_GATE
        assert compare(lse, ref_lse).max_abs < 1e-2


def test_bf16_wgmma_decode_bitwise_deterministic_and_split_invariant():
    from dataclasses import replace

    device = torch.device("cuda")
    prob = random_problem([9000, 70, 0, 4097], 2, 64, causal=True, seed=11)
    cfg = _bf16_config(128, 3, device)
    a = _run_bf16(prob, device, cfg)
    b = _run_bf16(prob, device, cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    fine = replace(cfg, split=replace(cfg.split, min_blocks_per_split=1, num_sms=512))
    c = _run_bf16(prob, device, fine.with_sms(512))
    assert c[3].shape[0] > a[3].shape[0]  # more splits
    assert compare(c[0], a[0]).rel_l2 < 5e-3


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_programmatic_combine_matches_a_plain_launch_and_replays_in_a_graph(fp8, monkeypatch):
    """The combine launched programmatically (runtime/pdl.py) gives the plain launch's bits, and
    a decode step captured in a CUDA graph (programmatic edge) replays to the same bits."""
    from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata

    device = torch.device("cuda")
    prob = random_problem([9000, 70, 0, 4097], 1, 16, seed=13)
    table = prob.layout.block_table.to(device)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(seqlens_t, 16, 1, fp8=fp8)
    assert meta.shape[0] > 4  # split requests: the combine has work
    if fp8:
        q, cache = quantize_rows(prob.q.to(device)), prob.fp8_cache().to(device)
        def step():
            return decode_fp8(q, cache, table, seqlens_t, meta, splits, prob.softmax_scale)
    else:
        q, cache = prob.q.to(device), prob.bf16_cache().to(device)
        def step():
            return decode_bf16(q, cache, table, seqlens_t, meta, splits, prob.softmax_scale)
    out_pdl, lse_pdl = step()
    monkeypatch.setenv("SNAPMLA_PDL", "0")
    out_plain, lse_plain = step()
    assert torch.equal(out_pdl, out_plain) and torch.equal(lse_pdl, lse_plain)
    monkeypatch.setenv("SNAPMLA_PDL", "1")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step()
    out_g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g, out_plain) and torch.equal(lse_g, lse_plain)


def test_prepared_launches_match_cupys_and_run_from_a_new_thread(monkeypatch):
    """The ops launch through prepared ``cuLaunchKernelEx`` calls (runtime/launch.py
    prepare_plain, KernelHandle): a step (Q-quant, K-append, decode) gives the bits of CuPy's
    launches, also from a thread that has made no CUDA call before (the driver's current
    context is the thread's own)."""
    from concurrent.futures import ThreadPoolExecutor

    from snapmla_cli.ops import decode_launch
    from snapmla_cli.ops.decode import decode_fp8, get_mla_metadata
    from snapmla_cli.ops.prep import append_kv, quantize_q
    from snapmla_cli.runtime import launch, pdl

    device = torch.device("cuda")
    prob = random_problem([9000, 70, 0, 4097], 2, 24, seed=21)
    table = prob.layout.block_table.to(device)
    lens = prob.layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(lens, 48, 1, fp8=True)
    cache0 = prob.fp8_cache().to(device)
    q = prob.q.to(device)
    gen = torch.Generator().manual_seed(5)
    new_kv = torch.randn(8, 576, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.arange(8, dtype=torch.int32, device=device) * 7  # inside request 0's first pages

    def step():
        cache = cache0.clone()
        append_kv(new_kv, slots, cache)
        out, lse = decode_fp8(quantize_q(q), cache, table, lens, meta, splits, prob.softmax_scale)
        torch.cuda.synchronize()
        return out, lse, cache

    def forget_launches():
        decode_launch.clear_plans()
        for handle in list(launch._HANDLES):
            handle._launches.clear()

    prepared = step()
    assert pdl.available()
    with ThreadPoolExecutor(max_workers=1) as pool:  # (its thread starts at the submit)
        from_thread = pool.submit(step).result()
    monkeypatch.setattr(pdl, "available", lambda: False)  # CuPy's launches (and a plain combine)
    forget_launches()
    try:
        plain = step()
    finally:
        monkeypatch.undo()
        forget_launches()
    for got in (from_thread, plain):
        assert all(torch.equal(a, b) for a, b in zip(prepared, got, strict=True))
    assert not torch.equal(prepared[2], cache0)  # the append wrote


def test_flash_mla_with_kvcache_dispatches_on_cache_format():
    from snapmla_cli.ops.decode import flash_mla_with_kvcache, get_mla_metadata

    device = torch.device("cuda")
    prob = random_problem([500, 64], 1, 16, seed=3)
    table = prob.layout.block_table.to(device)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    q = prob.q.to(device)
    meta, splits = get_mla_metadata(seqlens_t, 16, 1)
    o8, _ = flash_mla_with_kvcache(q, prob.fp8_cache().to(device), table, seqlens_t, 512, meta, splits)
    meta16, splits16 = get_mla_metadata(seqlens_t, 16, 1, fp8=False)
    o16, _ = flash_mla_with_kvcache(q, prob.bf16_cache().to(device), table, seqlens_t, 512, meta16, splits16)
    assert compare(o8, o16).rel_l2 < 0.1
    with pytest.raises(ValueError, match="head_dim_v"):
        flash_mla_with_kvcache(q, prob.bf16_cache().to(device), table, seqlens_t, 576, meta16, splits16)
    # FlashMLA's flag: a SnapMLA cache decodes to the same bits; one whose first token of a request
    # has DeepSeek-V3.2's extra scales in the pad bytes is refused, naming the request
    snap_cache = prob.fp8_cache().to(device)  # (kept alive: the check runs once per cache address)
    flagged, _ = flash_mla_with_kvcache(q, snap_cache, table, seqlens_t, 512, meta, splits, is_fp8_kvcache=True)
    assert torch.equal(flagged, o8)
    v32_like = snap_cache.clone()
    v32_like.view(-1, PAGE_SIZE, 656)[int(table[1, 0]), 0, 516:528] = 0x3F  # request 1's first token
    with pytest.raises(ValueError, match="^k_cache: request 1 reads token 0 with nonzero pad bytes 516..527"):
        flash_mla_with_kvcache(q, v32_like, table, seqlens_t, 512, meta, splits, is_fp8_kvcache=True)


@pytest.mark.parametrize("seqlens,s_q,h_q,causal", [([0, 65, 4097], 2, 20, True), ([777], 1, 128, False),
                                                   ([64, 1, 300, 0], 1, 16, True)])
def test_flash_mla_fp8_replays_quantize_and_decode_from_one_workspace(seqlens, s_q, h_q, causal):
    """flash_mla_with_kvcache on an FP8 cache: the first call plans, later ones replay the fused
    plan (Q's FP8 rows and the split rows carved out of one workspace). Each call, on each
    layer's cache, with a new Q each time, gives the bits of quantize_q + decode_fp8; inside a
    CUDA graph too. Between calls the block the workspace was freed to is filled with NaN bytes,
    so a part read before it is written, or at another offset, shows."""
    from dataclasses import replace

    from snapmla_cli.ops import decode_launch
    from snapmla_cli.ops.decode import decode_fp8, flash_mla_with_kvcache, get_mla_metadata
    from snapmla_cli.ops.prep import quantize_q

    device = torch.device("cuda")
    probs = [random_problem(seqlens, s_q, h_q, causal=causal, seed=s) for s in (41, 42, 43)]
    probs = [probs[0]] + [replace(p, layout=probs[0].layout) for p in probs[1:]]
    table = probs[0].layout.block_table.to(device)
    lens = probs[0].layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(lens, s_q * h_q, 1)
    caches = [p.fp8_cache().to(device) for p in probs]
    scale = probs[0].softmax_scale
    decode_launch.clear_plans()
    for i, prob in enumerate(probs):
        q = prob.q.to(device)
        got = flash_mla_with_kvcache(q, caches[i], table, lens, 512, meta, splits, scale, causal)
        want = decode_fp8(quantize_q(q), caches[i], table, lens, meta, splits, scale, causal)
        assert got[0].isfinite().all()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"call {i}"
        fused = [plan for plan in decode_launch.stored_plans() if plan.q_quant is not None]
        assert len(fused) == 1
        workspace_bytes = fused[0].q_quant.nbytes + fused[0].partial_floats * 4
        # the freed workspace's block (the allocator hands it out again at this size): NaN bytes
        torch.full((workspace_bytes,), 0xFF, dtype=torch.uint8, device=device)
    q = probs[1].q.to(device)
    want = decode_fp8(quantize_q(q), caches[2], table, lens, meta, splits, scale, causal)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_mla_with_kvcache(q, caches[2], table, lens, 512, meta, splits, scale, causal)
    captured[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], want[0]) and torch.equal(captured[1], want[1])


@pytest.mark.parametrize("spec", ["default", "v2", "v3", "v3-rows", "v3-pingpong"])
@pytest.mark.parametrize("heads,mtp", [(16, 1), (128, 2)])
def test_fp8_decode_meets_verify_gates_on_synthetic_default(spec, heads, mtp):
    """What `snapmla verify --ctx 32k --fp8-kernel SPEC` checks: the synthetic default model's
    last layer, 4 requests of 32k tokens, SPEC section 6 gates against float64 and the
    emulation. The random-data tests above are not enough: their attention is peaky, while the
    synthetic layer spreads it over many tokens, which exposes accumulation error."""
    from snapmla_cli.analysis.verify import (
        fp8_kernel_implementation,
        make_problem,
        request_tokens,
        run_case,
        synthetic_source,
    )

    device = torch.device("cuda")
    source = synthetic_source(None)
    prob = make_problem(source, request_tokens(source, 4, 32 * 1024), heads, mtp, causal=True).to(device)
    result = run_case(prob, [fp8_kernel_implementation(spec)])
    impl = result.impls[0]
    assert impl.passed, [(c.name, c.value, c.limit) for c in impl.checks]


# Column work lists (balanced split policy): (s_q, h_q, FP8 kernel overrides) of kernels that run
# a column's items in turn (16 rows with two CTAs or five stages, 32 rows alternate pages, 64 rows
# dims split, V^T in shared memory and rows = M, 128 rows rows = M), and of kernels that run one
# item per CTA and must still run such a list (the one-item build of rows = M, the default at
# 64+ rows under the split plan, and the mma.sync kernel).
COLUMN_KERNELS = [(1, 16, 3, {}), (1, 16, 3, {"wg_mode": 3, "stages": 5, "min_ctas_per_sm": 1}),
                  (2, 16, 3, {"wg_mode": 3, "stages": 4, "rope_ring": 0}),
                  (1, 20, 3, {"wg_mode": 3, "stages": 4, "rope_ring": 0}),
                  (2, 32, 3, {"wg_mode": 0, "row_groups": 4, "stages": 2}),
                  (1, 64, 3, {"wg_mode": 6, "row_groups": 4}), (1, 64, 3, {"wg_mode": 4, "row_groups": 4}),
                  (2, 64, 3, {"wg_mode": 4, "row_groups": 4, "stages": 3})]
ONE_ITEM_KERNELS = [(2, 64, 3, {"wg_mode": 4, "row_groups": 4}), (2, 16, 2, {})]
COLUMN_LENS = [0, 1, 63, 64, 65, 4097, 9000, 300, 0, 2500]
COLUMN_SMS = 11  # few columns, so that most cross request boundaries


def _balanced(cfg):
    from snapmla_cli.ops.decode_config import balanced

    return balanced(cfg).with_sms(COLUMN_SMS)


def _check_fp8_against_emulation(prob, out, lse, cache, meta, splits, device):
    from snapmla_cli.ops.schedule import split_token_bounds

    seqlens = prob.layout.cache_seqlens.tolist()
    bounds = split_token_bounds(splits, meta, seqlens)
    emul_out, emul_lse = emulate_fp8_decode(quantize_rows(prob.q.to(device)), cache,
                                            prob.layout.block_table.to(device),
                                            prob.layout.cache_seqlens.to(device), prob.softmax_scale,
                                            prob.causal, split_bounds=bounds)
    assert compare(out, emul_out).rel_l2 <= EMUL_GATE
    assert compare(lse, emul_lse).max_abs < 1e-2
    for i, n in enumerate(seqlens):
        if n == 0:
            assert torch.all(out[i] == 0) and torch.all(lse[i] == float("inf"))


@pytest.mark.parametrize("s_q,h_q,version,kernel", COLUMN_KERNELS,
                         ids=["v3-c2", "v3-alt16-st5", "v3-alt32", "v3-alt20", "v3-dims64", "v3-vt", "v3-rows-m64",
                              "v3-rows-m128-st3"])
def test_fp8_balanced_columns_match_emulation_and_repeat_bitwise(s_q, h_q, version, kernel):
    """A CTA runs several requests' pieces in turn (the pipeline starts over for each): the
    result matches the emulation of the same split bounds and repeats bit for bit."""
    from snapmla_cli.ops.decode_config import runs_columns

    device = torch.device("cuda")
    prob = random_problem(COLUMN_LENS, s_q, h_q, causal=True, seed=h_q * 7 + s_q)
    cfg = _balanced(_config(s_q * h_q, version, device, **kernel))
    assert runs_columns(cfg, True)
    out, lse, cache, meta, splits = _run_fp8(prob, device, cfg)
    assert meta.shape[0] <= COLUMN_SMS * cfg.split.ctas_per_sm and meta.shape[1] > 1  # columns of items
    _check_fp8_against_emulation(prob, out, lse, cache, meta, splits, device)
    again = _run_fp8(prob, device, cfg)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@pytest.mark.parametrize("s_q,h_q,version,kernel", ONE_ITEM_KERNELS, ids=["v3-rows-m", "v2"])
def test_fp8_one_item_kernels_run_a_column_work_list(s_q, h_q, version, kernel):
    """A work list built for a kernel that runs columns, given to one that runs an item per CTA:
    each place is a CTA, the empty places write only the scratch slot."""
    from snapmla_cli.ops.decode import decode_fp8
    from snapmla_cli.ops.decode_config import runs_columns
    from snapmla_cli.ops.schedule import build_metadata

    device = torch.device("cuda")
    prob = random_problem(COLUMN_LENS, s_q, h_q, causal=True, seed=h_q + s_q)
    cfg = _config(s_q * h_q, version, device, **kernel)
    assert not runs_columns(cfg, True)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    meta, splits = build_metadata(seqlens_t, s_q * h_q, cfg.block_m, _balanced(cfg).split, runs_columns=True)
    assert meta.shape[1] > 1 and bool((meta[:, :, 2] == meta[:, :, 1]).any())  # empty places
    cache = prob.fp8_cache().to(device)
    b = len(COLUMN_LENS)
    out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((b, h_q, s_q), float("nan"), dtype=torch.float32, device=device)
    out, lse = decode_fp8(quantize_rows(prob.q.to(device)), cache, prob.layout.block_table.to(device),
                          seqlens_t, meta, splits, prob.softmax_scale, True, config=cfg, out=out, lse=lse)
    _check_fp8_against_emulation(prob, out, lse, cache, meta, splits, device)


def test_fp8_rows_m_column_build_matches_its_one_item_build_bitwise():
    """Rows = M's column build reads PV's gammas from shared memory and derives the V^T
    fragments' lane offsets per page (its column loop leaves no registers for them): on the same
    column work list it must give the one-item build's bits (each place of the list run as its
    own CTA), with NaN-poisoned outputs and partial pages."""
    from snapmla_cli.ops.decode import decode_fp8
    from snapmla_cli.ops.decode_config import runs_columns
    from snapmla_cli.ops.schedule import build_metadata

    device = torch.device("cuda")
    s_q, h_q = 2, 64
    prob = random_problem(COLUMN_LENS, s_q, h_q, causal=True, seed=31)
    one_item = _config(s_q * h_q, 3, device, wg_mode=4, row_groups=4)
    columns = _balanced(one_item)
    assert runs_columns(columns, True) and not runs_columns(one_item, True)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    meta, splits = build_metadata(seqlens_t, s_q * h_q, one_item.block_m, columns.split, runs_columns=True)
    assert meta.shape[1] > 1
    cache = prob.fp8_cache().to(device)
    q = quantize_rows(prob.q.to(device))
    results = []
    for cfg in (one_item, columns):
        out = torch.full((len(COLUMN_LENS), s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((len(COLUMN_LENS), h_q, s_q), float("nan"), dtype=torch.float32, device=device)
        results.append(decode_fp8(q, cache, prob.layout.block_table.to(device), seqlens_t, meta, splits,
                                  prob.softmax_scale, True, config=cfg, out=out, lse=lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    _check_fp8_against_emulation(prob, *results[1], cache, meta, splits, device)


def test_bf16_wgmma_balanced_columns_match_float64():
    device = torch.device("cuda")
    prob = random_problem(COLUMN_LENS, 2, 16, causal=True, seed=23)
    cfg = _balanced(_bf16_config(32, 3, device))
    out, lse, cache, meta = _run_bf16(prob, device, cfg)
    assert meta.shape[1] > 1
    table = prob.layout.block_table.to(device)
    seqlens_t = prob.layout.cache_seqlens.to(device)
    ref_out, ref_lse = decode_reference(prob.q.to(device), cache.squeeze(2), table, seqlens_t,
                                        prob.softmax_scale, True)
    assert compare(out, ref_out).cos_diff <= BF16_COS_GATE
    assert compare(lse, ref_lse).max_abs < 1e-2
    again = _run_bf16(prob, device, cfg)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_replayed_launch_plan_takes_each_calls_tensors(fp8):
    """A second call with the same metadata and cache replays the first call's prepared launch
    (ops/decode_launch.py): with another Q, the cache's contents rewritten in place and new
    output buffers it must give exactly what a freshly planned call gives, and differ from the
    first call's output; inside a CUDA graph too."""
    from dataclasses import replace

    from snapmla_cli.ops import decode_launch
    from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata

    device = torch.device("cuda")
    first, second = (random_problem([5000, 64, 0, 777], 1, 16, causal=True, seed=s) for s in (11, 12))
    second = replace(second, layout=first.layout)  # new tokens in the same pages
    table = first.layout.block_table.to(device)
    lens = first.layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(lens, 16, 1, fp8=fp8)

    def operands(prob):
        if fp8:
            return quantize_rows(prob.q.to(device)), prob.fp8_cache().to(device)
        return prob.q.to(device), prob.bf16_cache().to(device)

    def call(q, cache):
        fn = decode_fp8 if fp8 else decode_bf16
        return fn(q, cache, table, lens, meta, splits, first.softmax_scale, True)

    q1, cache = operands(first)
    q2, cache2 = operands(second)
    assert cache2.shape == cache.shape
    decode_launch.clear_plans()
    out1, _ = call(q1, cache)
    cache.copy_(cache2)  # an engine's cache: same tensor, new contents
    replayed = call(q2, cache)
    assert len(decode_launch._PLANS) == 1  # the second call found the first one's plan
    decode_launch.clear_plans()
    fresh = call(q2, cache)
    assert replayed[0].isfinite().all()
    assert torch.equal(replayed[0], fresh[0]) and torch.equal(replayed[1], fresh[1])
    assert not torch.equal(replayed[0], out1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(q2, cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], fresh[0]) and torch.equal(captured[1], fresh[1])


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_layers_on_their_own_caches_share_a_plan_and_graphs_keep_their_maps(fp8, monkeypatch):
    """An engine's step: every layer on its own cache with the step's one work list. The second
    layer replays the first one's plan with its own cache (its TMA maps), bitwise what a freshly
    planned call gives. A graph captured on a cache keeps that cache's maps even once the map
    cache evicted them and the caching allocator handed their memory out again (junk bytes)."""
    from dataclasses import replace

    from snapmla_cli.ops import decode_launch
    from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata
    from snapmla_cli.runtime import tensor_map

    device = torch.device("cuda")
    first, second = (random_problem([3000, 64, 0, 513], 1, 16, causal=True, seed=s) for s in (21, 22))
    second = replace(second, layout=first.layout)
    table = first.layout.block_table.to(device)
    lens = first.layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(lens, 16, 1, fp8=fp8)
    if fp8:
        q = quantize_rows(first.q.to(device))
        layer_caches = [prob.fp8_cache().to(device) for prob in (first, second)]
    else:
        q = first.q.to(device)
        layer_caches = [prob.bf16_cache().to(device) for prob in (first, second)]

    def call(cache):
        fn = decode_fp8 if fp8 else decode_bf16
        return fn(q, cache, table, lens, meta, splits, first.softmax_scale, True)

    decode_launch.clear_plans()
    out_first, _ = call(layer_caches[0])
    replayed = call(layer_caches[1])
    assert len(decode_launch._PLANS) == 1  # the second layer replayed the first one's plan
    decode_launch.clear_plans()
    fresh = call(layer_caches[1])
    assert fresh[0].isfinite().all() and not torch.equal(fresh[0], out_first)
    assert torch.equal(replayed[0], fresh[0]) and torch.equal(replayed[1], fresh[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(layer_caches[1])
    monkeypatch.setattr(tensor_map, "MAX_CACHED_MAPS", 1)
    for pages in (4, 5, 6):  # other caches' maps evict the captured one's
        other = torch.zeros((pages, *layer_caches[1].shape[1:]), dtype=layer_caches[1].dtype, device=device)
        (tensor_map.fp8_cache_tensor_maps if fp8 else tensor_map.bf16_cache_tensor_map)(other)
    junk = [torch.full((256,), 0xFF, dtype=torch.uint8, device=device) for _ in range(64)]  # freed blocks reused
    captured[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], fresh[0]) and torch.equal(captured[1], fresh[1])
    del junk


def test_metadata_from_host_lengths_waits_for_nothing():
    """An engine that keeps its lengths on the host plans with ``device``: the call returns while
    a sleep kernel queued before it still runs (no read from the GPU, asynchronous copies), and
    its work list, split counts and configuration equal those planned from the same lengths on
    the GPU, so the decode gives the same bits."""
    from snapmla_cli.ops.decode import decode_fp8, get_mla_metadata, metadata_plan

    device = torch.device("cuda")
    prob = random_problem([5000, 64, 0, 777, 20000], 2, 16, causal=True, seed=21)
    rows = 2 * 16
    host_lens = prob.layout.cache_seqlens.clone()
    get_mla_metadata(host_lens, rows, 1, device=device)  # the first call's one-time lookups
    shorter = (host_lens - 100).clamp(min=0).to(torch.int32)  # other pages: planned afresh
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s
    queued = torch.cuda.Event()
    queued.record()
    meta_h, splits_h = get_mla_metadata(shorter, rows, 1, device=device)
    assert not queued.query(), "get_mla_metadata waited for the GPU"
    torch.cuda.synchronize()
    assert meta_h.device.type == "cuda" and splits_h.device.type == "cuda"
    meta_g, splits_g = get_mla_metadata(shorter.to(device), rows, 1)
    assert torch.equal(meta_h, meta_g) and torch.equal(splits_h, splits_g)
    assert metadata_plan(meta_h).config == metadata_plan(meta_g).config
    # the decode of the longer lengths, planned both ways
    gpu_lens = host_lens.to(device)
    cache, q = prob.fp8_cache().to(device), quantize_rows(prob.q.to(device))
    table = prob.layout.block_table.to(device)
    outs = [decode_fp8(q, cache, table, gpu_lens, *get_mla_metadata(lens, rows, 1, device=device),
                       prob.softmax_scale, True) for lens in (host_lens, gpu_lens)]
    assert outs[0][0].isfinite().all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("s_q,h_q", [(2, 16), (1, 64), (2, 64)])
def test_graph_work_list_replays_every_steps_plan(s_q, h_q):
    """A decode step captured once in a CUDA graph with a GraphWorkList (fixed-shape work list,
    rewritten in place per step) gives each step's result on replay: three steps whose lengths
    differ (a request empty, then long; split counts below and above the fold's limit) each
    match the emulation of that step's split bounds, the output buffers poisoned with NaN
    before each replay; a replay of the first step's lengths again repeats its bits."""
    from dataclasses import replace

    from snapmla_cli.ops.decode import decode_fp8
    from snapmla_cli.ops.graph_work_list import GraphWorkList

    device = torch.device("cuda")
    longest = [9000, 64, 700, 4097, 20000]
    prob = random_problem(longest, s_q, h_q, causal=True, seed=31 + h_q)
    steps = [[9000, 64, 700, 4097, 20000], [8000, 0, 1, 65, 19937], [130, 3, 0, 4000, 64]]
    rows = s_q * h_q
    work = GraphWorkList(len(longest), rows, device)
    cache, q = prob.fp8_cache().to(device), quantize_rows(prob.q.to(device))
    table = prob.layout.block_table.to(device)
    lens = torch.tensor(steps[0], dtype=torch.int32, device=device)
    out = torch.empty((len(longest), s_q, h_q, 512), dtype=torch.bfloat16, device=device)
    lse = torch.empty((len(longest), h_q, s_q), dtype=torch.float32, device=device)
    work.update(torch.tensor(steps[0], dtype=torch.int32))

    def step():
        decode_fp8(q, cache, table, lens, work.metadata, work.num_splits, prob.softmax_scale, True,
                   out=out, lse=lse)

    def check(host: torch.Tensor) -> None:
        step_prob = replace(prob, layout=replace(prob.layout, cache_seqlens=host))
        _check_fp8_against_emulation(step_prob, out, lse, cache, work.metadata, work.num_splits, device)

    results = replay_steps(step, work, lens, out, lse, steps + steps[:1], check)
    assert torch.equal(results[0][0], results[-1][0]) and torch.equal(results[0][1], results[-1][1])
    assert work.metadata.shape == (work.capacity, 1, 4)


# The small-work rule's smaller tiles over 64+ rows (decode_config.heuristic_for_work), through the
# default path with no database entry: (seqlens, s_q, h_q, causal, row groups the rule picks on
# 132 SMs). Odd lengths, an empty request, 80 rows (not a power of two).
SMALL_WORK_CASES = [
    ([4000], 1, 64, False, 1),
    ([4097, 63, 0, 4000], 1, 64, False, 2),
    ([16000], 1, 128, False, 2),
    ([4001], 2, 40, True, 1),
    ([3000, 65], 2, 64, True, 2),
]


@pytest.mark.parametrize("seqlens,s_q,h_q,causal,groups", SMALL_WORK_CASES)
def test_small_work_tiles_run_the_default_path_and_match_emulation(seqlens, s_q, h_q, causal, groups, monkeypatch):
    """Without a database entry get_mla_metadata picks the rule's tile from the lengths, the
    decode runs it, and the result matches the emulation (NaN-poisoned output and cache rows)."""
    from snapmla_cli.ops.config_choice import metadata_plan
    from snapmla_cli.tuning import lookup

    device = torch.device("cuda")
    if torch.cuda.get_device_properties(device).multi_processor_count != 132:
        pytest.skip("the expected tiles are those of a 132-SM GPU")
    monkeypatch.setattr(lookup, "lookup_decode_config", lambda **kw: None)  # the heuristic runs
    prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=sum(seqlens) + h_q)
    out, lse, cache, meta, splits = _run_fp8(prob, device)
    plan = metadata_plan(meta)
    assert plan is not None and plan.config.row_groups == groups
    _check_fp8_against_emulation(prob, out, lse, cache, meta, splits, device)
