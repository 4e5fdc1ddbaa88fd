"""The vectorised FP8 emulation against a literal, block-by-block reading of SPEC section 5, and
its distance from the float64 reference."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch

from snapmla_cli.analysis.verify import (
    EMULATION,
    GateCheck,
    Gates,
    Implementation,
    ImplErrors,
    _gate_checks,
    default_implementations,
    make_problem,
    request_tokens,
    run_case,
    run_emulation,
    synthetic_source,
)
from snapmla_cli.cache.layout import (
    gather_from_pages,
    quantize_tokens,
    random_paged_layout,
    scatter_to_pages,
    unpack_tokens,
)
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.emulation import emulate_fp8_decode
from snapmla_cli.numerics.formats import D_V, P_BLOCK_TOKENS
from snapmla_cli.numerics.metrics import ErrorMetrics, compare
from snapmla_cli.numerics.problem import DecodeProblem, random_problem
from snapmla_cli.numerics.quant import QuantizedRows, e4m3_round

# SPEC section 5's constants, written out here rather than imported from the code under test
E4M3_MAX = 448.0
P_SCALE_FLOOR = 2.0**-64


def literal_decode(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC section 5 line by line: float32 logits and softmax, float64 state (O, L)."""
    q = problem.q_quantized()
    cache = problem.fp8_cache()
    b, s_q, h_q = q.scale.shape
    scale = torch.tensor(problem.softmax_scale, dtype=torch.float32)
    out = torch.zeros(b, s_q, h_q, D_V, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i in range(b):
        n = int(problem.layout.cache_seqlens[i])
        keys = unpack_tokens(gather_from_pages(cache, problem.layout.block_table[i], n))
        k_c, k_s, k_r = keys.content.float(), keys.scale, keys.rope.float()
        for t in range(s_q):
            visible = min(max(n - s_q + t + 1, 0), n) if problem.causal else n
            for h in range(h_q):
                q_c, q_s, q_r = q.content[i, t, h].float(), q.scale[i, t, h], q.rope[i, t, h].float()
                m = torch.tensor(-math.inf)
                sigma = torch.tensor(1.0)
                big_o = torch.zeros(D_V, dtype=torch.float64)
                big_l = torch.tensor(0.0, dtype=torch.float64)
                for start in range(0, visible, P_BLOCK_TOKENS):
                    j = torch.arange(start, min(start + P_BLOCK_TOKENS, visible))
                    raw = (k_c[j].double() @ q_c.double() + k_r[j].double() @ q_r.double()).float()
                    s = scale * q_s * k_s[j] * raw
                    m_new = torch.maximum(m, s.max())
                    e = torch.exp(s - m_new)
                    et = e * k_s[j]
                    sigma_k = torch.clamp(et.max() / E4M3_MAX, min=P_SCALE_FLOOR)
                    p = e4m3_round(et / sigma_k).float()
                    gamma = 0.0 if start == 0 else math.exp(float(m) - float(m_new)) * float(sigma) / float(sigma_k)
                    big_o = gamma * big_o + p.double() @ k_c[j, :D_V].double()
                    big_l = gamma * big_l + (e.double() / float(sigma_k)).sum()
                    m, sigma = m_new, sigma_k
                if visible:
                    out[i, t, h] = big_o / big_l
                    lse[i, h, t] = float(m) + math.log(float(sigma) * float(big_l))
    return out, lse


@pytest.mark.parametrize(("seqlens", "s_q", "causal"), [
    ([130, 81], 1, False),   # partial last blocks
    ([64, 200], 3, True),    # causal MTP
    ([1, 0, 65], 2, True),   # a tiny and an empty request
])
def test_emulation_matches_the_literal_block_loop(seqlens: list[int], s_q: int, causal: bool) -> None:
    problem = random_problem(seqlens, s_q=s_q, h_q=3, causal=causal, seed=sum(seqlens) + s_q)
    out, lse = run_emulation(problem)
    ref_out, ref_lse = literal_decode(problem)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-9)


def test_emulation_uses_an_explicit_softmax_scale() -> None:
    """The softmax scale enters every logit (SPEC section 5, first line); a non-default one must
    match the literal block loop, which reads the problem's scale."""
    problem = random_problem([130, 40], s_q=2, h_q=3, causal=True, seed=23, softmax_scale=0.013)
    out, lse = run_emulation(problem)
    ref_out, ref_lse = literal_decode(problem)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-9)


def test_split_kv_equals_unsplit_to_rounding() -> None:
    problem = random_problem([300, 129], s_q=2, h_q=4, causal=True, seed=7)
    q, cache, layout = problem.q_quantized(), problem.fp8_cache(), problem.layout
    args = (q, cache, layout.block_table, layout.cache_seqlens, problem.softmax_scale, True)
    whole = emulate_fp8_decode(*args)
    split = emulate_fp8_decode(*args, split_bounds=[[0, 64, 192, 300], [0, 128, 129]])
    assert compare(split[0], whole[0]).rel_l2 < 1e-5
    assert compare(split[1], whole[1]).max_abs < 1e-5


def test_query_content_as_raw_bytes_is_read_as_e4m3() -> None:
    """The decode calls take q.content as uint8 bytes too; the emulation and dequantize must read
    them as E4M3, bit for bit the same result, not as the integers 0..255."""
    problem = random_problem([130, 7], s_q=2, h_q=3, causal=True, seed=11)
    q, cache, layout = problem.q_quantized(), problem.fp8_cache(), problem.layout
    as_bytes = QuantizedRows(q.content.view(torch.uint8), q.scale, q.rope)
    args = (cache, layout.block_table, layout.cache_seqlens, problem.softmax_scale, True)
    for a, b in zip(emulate_fp8_decode(q, *args), emulate_fp8_decode(as_bytes, *args)):
        assert torch.equal(a, b)
    assert torch.equal(as_bytes.dequantize(), q.dequantize())


def test_the_cache_as_an_e4m3_view_and_the_default_scale() -> None:
    """SPEC section 2: the FP8 cache may come as a float8_e4m3fn view, and softmax_scale defaults
    to 576 ** -0.5; the CPU definitions take both as the decode calls do."""
    problem = random_problem([70, 3], s_q=2, h_q=3, causal=True, seed=12)
    q, cache, layout = problem.q_quantized(), problem.fp8_cache(), problem.layout
    tables = (layout.block_table, layout.cache_seqlens)
    plain = emulate_fp8_decode(q, cache, *tables, 576**-0.5, True)
    for a, b in zip(plain, emulate_fp8_decode(q, cache.view(torch.float8_e4m3fn).unsqueeze(2), *tables, causal=True)):
        assert torch.equal(a, b)
    dense = problem.bf16_cache()
    default = decode_reference(problem.q, dense, *tables, causal=True)
    for a, b in zip(default, decode_reference(problem.q, dense, *tables, 576**-0.5, True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("part", "bad", "needle"), [
    ("content", lambda q: q.content.float(), "q.content: expected dtype float8_e4m3fn or uint8, got float32"),
    ("scale", lambda q: q.scale.double(), "q.scale: expected dtype float32, got float64"),
    ("rope", lambda q: q.rope.float(), "q.rope: expected dtype bfloat16, got float32"),
    ("scale", lambda q: q.scale * 0, "q.scale: expected positive scales"),
    ("scale", lambda q: -q.scale, "q.scale: expected positive scales"),
])
def test_emulation_refuses_queries_that_are_not_quantized_rows(part: str, bad, needle: str) -> None:
    problem = random_problem([70], s_q=1, h_q=2, seed=12)
    q, layout = problem.q_quantized(), problem.layout
    parts = {"content": q.content, "scale": q.scale, "rope": q.rope}
    parts[part] = bad(q)
    with pytest.raises(SnapmlaError, match=re.escape(needle)):
        emulate_fp8_decode(QuantizedRows(**parts), problem.fp8_cache(), layout.block_table, layout.cache_seqlens,
                           problem.softmax_scale)


@pytest.mark.parametrize(("content", "rope"), [(1e20, 1.0), (0.0, 1e10)], ids=["huge-values", "zero-content-rope-1e10"])
def test_logits_beyond_float32_are_refused_not_read_as_no_key(content: float, rope: float) -> None:
    """Finite queries and keys that quantize_q / append_kv accept can give logits beyond float32:
    values near 1e20, or a RoPE of 1e10 beside zero content (its scale at the 2^-32 floor, so the
    pre-scaled RoPE dot product is about 1e41 before the scales bring it back to 1e21). The
    emulation's block maximum was then +inf and the request read as having no visible key: out 0
    and lse +inf, while the float64 reference's lse is finite. Refused, with the request."""
    gen = torch.Generator().manual_seed(31)

    def rows(*lead: int) -> torch.Tensor:
        x = torch.randn(*lead, 576, generator=gen)
        return torch.cat([x[..., :512] * content, x[..., 512:] * rope], dim=-1).to(torch.bfloat16)

    problem = DecodeProblem(rows(1, 1, 2), [rows(70)], random_paged_layout([70], generator=gen), False, 576**-0.5)
    layout = problem.layout
    _, ref_lse = decode_reference(problem.q, problem.bf16_cache(), layout.block_table, layout.cache_seqlens)
    assert torch.isfinite(ref_lse).all()
    with pytest.raises(SnapmlaError, match=r"^q, fp8_cache: request 0's logits overflow float32 \(row 0 "):
        run_emulation(problem)


def test_emulation_is_within_the_fp8_storage_floor_on_synthetic_data() -> None:
    source = synthetic_source(None)
    tokens = request_tokens(source, batch=2, ctx=2048)
    for heads, mtp in ((16, 1), (20, 2)):
        case = run_case(make_problem(source, tokens, heads, mtp, causal=True),
                        default_implementations(torch.device("cpu")))
        emul = case.impls[0]
        assert emul.passed, (heads, mtp, emul.vs_ref64.rel_l2, case.floor.rel_l2)
        assert emul.vs_ref64.rel_l2 <= 1.10 * case.floor.rel_l2 + 1e-3
        assert 0 < case.floor.rel_l2 < 0.2


def test_poison_and_garbage_never_change_the_emulation() -> None:
    problem = random_problem([70, 3, 128], s_q=2, h_q=2, causal=True, seed=8)
    layout = problem.layout
    out, lse = run_emulation(problem)  # 0xFF (NaN) poison, garbage -7 in the table
    assert torch.isfinite(out).all()
    gen = torch.Generator().manual_seed(1)
    random_fill = torch.randint(0, 255, (656,), generator=gen, dtype=torch.uint8)
    other = scatter_to_pages([quantize_tokens(t) for t in problem.tokens], layout, random_fill)
    table = layout.block_table.clone()
    table[table < 0] = 123456
    out2, lse2 = emulate_fp8_decode(problem.q_quantized(), other, table, layout.cache_seqlens,
                                    problem.softmax_scale, True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_a_nan_where_the_reference_is_finite_makes_every_metric_infinite() -> None:
    """SPEC section 6: NaN or inf where the reference is finite fails; the metrics say +inf, so
    that no gate can pass it by a comparison with NaN being False."""
    gen = torch.Generator().manual_seed(31)
    ref = torch.randn(256, generator=gen, dtype=torch.float64)
    x = ref + 1e-3 * torch.randn(256, generator=gen, dtype=torch.float64)
    assert math.isfinite(compare(x, ref).rel_l2)
    for bad in (math.nan, math.inf):
        x[7] = bad
        assert all(v == math.inf for v in compare(x, ref).as_dict().values()), bad


def test_non_finite_reference_positions_must_match_exactly() -> None:
    """Where the reference is non-finite (lse +inf of an empty row, or NaN) the value must be the
    same special value; NaN matches NaN, and the finite rest is measured as usual."""
    gen = torch.Generator().manual_seed(32)
    ref = torch.randn(128, generator=gen, dtype=torch.float64)
    ref[3], ref[9] = math.nan, math.inf
    x = ref + 1e-3 * torch.randn(128, generator=gen, dtype=torch.float64)
    x[3], x[9] = math.nan, math.inf
    metrics = compare(x, ref)
    assert 0 < metrics.rel_l2 < 1e-2 and math.isfinite(metrics.rmse)
    x[3] = 0.0
    assert compare(x, ref).rel_l2 == math.inf


def test_cos_diff_of_identical_vectors_is_not_negative() -> None:
    """1 - cos rounds to -2e-16 (or +2e-16) for many random vectors compared with themselves; the
    distance is clamped at 0 so that tables and gates never show a negative one."""
    for seed in range(8):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        metrics = compare(x, x.clone())
        assert 0.0 <= metrics.cos_diff < 1e-15 and metrics.rel_l2 == 0.0, seed


def test_fp8_gates_check_the_emulation_too_and_a_value_at_its_limit_passes() -> None:
    """SPEC section 6: an FP8 kernel is gated against ref64 (floor_factor x floor + floor_abs)
    and, when given, against the emulation; a value exactly at its limit passes."""
    gates = Gates()
    floor = ErrorMetrics(rmse=1e-3, cos_diff=1e-6, rel_l2=2e-2, max_abs=4e-2)
    vs_ref = ErrorMetrics(rmse=1e-3, cos_diff=1e-6, rel_l2=2.1e-2, max_abs=4e-2)
    far_from_emul = ErrorMetrics(rmse=1e-3, cos_diff=1e-6, rel_l2=6e-3, max_abs=4e-2)
    lse_close = ErrorMetrics(rmse=1e-4, cos_diff=0.0, rel_l2=1e-5, max_abs=1e-3)
    kernel = ImplErrors(vs_ref, lse_close, far_from_emul, lse_close)
    checks = _gate_checks("fp8", "fp8-kernel", kernel, floor, gates)
    assert [c.name for c in checks] == ["rel_l2 vs ref64", "rel_l2 vs emul", "lse max_abs vs emul"]
    assert checks[0].limit == pytest.approx(1.10 * 2e-2 + 1e-3) and checks[0].passed
    assert checks[1].limit == gates.emul_rel_l2 and not checks[1].passed
    assert checks[2].limit == gates.lse_max_abs and checks[2].passed
    emulation = ImplErrors(vs_ref, lse_close, None, None)
    assert [c.name for c in _gate_checks("fp8", "fp8-emul", emulation, floor, gates)] == ["rel_l2 vs ref64"]
    assert GateCheck("rel_l2 vs emul", 5e-3, 5e-3).passed and not GateCheck("x", 5.0000001e-3, 5e-3).passed
    with pytest.raises(SnapmlaError, match="^implementation fp16-kernel: unknown kind 'fp16'"):
        _gate_checks("fp16", "fp16-kernel", emulation, floor, gates)


def test_a_kernel_whose_lse_is_nan_or_shifted_fails_verify() -> None:
    """lse is half of what a decode call returns (engines merge split partials with it): an FP8
    kernel with the emulation's out but a NaN or shifted lse, or a BF16 one with ref64's out and a
    shifted lse, must fail; the same kernels with the right lse pass."""
    problem = random_problem([300, 70], 2, 5, causal=True, seed=3)

    def emulated(lse_change: Callable[[torch.Tensor], torch.Tensor]) -> Implementation:
        def run(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = run_emulation(p)
            return out, lse_change(lse)
        return Implementation("fp8-kernel", "fp8", run)

    def referenced(shift: float) -> Implementation:
        def run(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
            layout = p.layout
            out, lse = decode_reference(p.q, p.bf16_cache().squeeze(2), layout.block_table, layout.cache_seqlens,
                                        p.softmax_scale, p.causal)
            return out, lse + shift
        return Implementation("bf16-kernel", "bf16", run)

    emul = Implementation(EMULATION, "fp8", run_emulation)
    good = run_case(problem, [emul, emulated(lambda lse: lse), referenced(0.0)])
    assert good.passed
    for bad in (emulated(lambda lse: torch.full_like(lse, math.nan)), emulated(lambda lse: lse + 0.1),
                referenced(0.1)):
        (_, result) = run_case(problem, [emul, bad]).impls
        assert not result.passed and [c.name for c in result.checks if not c.passed] == [
            "lse max_abs vs emul" if result.kind == "fp8" else "lse max_abs vs ref64"]


def test_request_tokens_refuses_an_empty_batch() -> None:
    """``--batch 0`` is a one-line error, not zero requests that make an empty problem."""
    with pytest.raises(SnapmlaError, match="^--batch: expected at least 1, got 0"):
        request_tokens(synthetic_source(None), 0, 64)


@pytest.mark.parametrize(("relative_noise", "passes"), [(1.4e-3, True), (6.3e-3, False)])
def test_the_bf16_gate_is_spec_cos_diff_against_ref64(relative_noise: float, passes: bool) -> None:
    """A BF16 kernel with ref64's lse and ref64's out plus noise: cos_diff about 1e-6 passes SPEC
    section 6's 5e-6, about 2e-5 fails it, and on that check alone."""
    problem = random_problem([300, 70], 2, 5, causal=True, seed=4)

    def run(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
        layout = p.layout
        out, lse = decode_reference(p.q, p.bf16_cache().squeeze(2), layout.block_table, layout.cache_seqlens,
                                    p.softmax_scale, p.causal)
        gen = torch.Generator().manual_seed(0)
        noise = torch.randn(out.shape, generator=gen, dtype=torch.float64) * out.double().pow(2).mean().sqrt()
        return (out.double() + relative_noise * noise).to(out.dtype), lse

    (_, result) = run_case(problem, [Implementation(EMULATION, "fp8", run_emulation),
                                     Implementation("bf16-kernel", "bf16", run)]).impls
    (cos,) = [c for c in result.checks if c.name == "cos_diff vs ref64"]
    assert cos.limit == 5e-6 and (cos.value < 2e-6 if passes else cos.value > 1e-5), cos
    assert result.passed == passes
    assert [c.name for c in result.checks if not c.passed] == ([] if passes else ["cos_diff vs ref64"])
