"""The default decode paths on shapes drawn at random (a fixed seed, so a failure reproduces):
batch 1-9, 1-4 query tokens (and three fixed draws of 5-16), any head count up to 128 (rarely a power of two), request lengths
mixing empty, shorter than a page, page-aligned and long, causal or not. The fixed CASES of
test_decode.py were chosen by hand; these shake out combinations nobody picked (a row count
between the tile sizes, an odd tail next to an empty request, a split count that leaves one CTA
a single page). Each draw: the FP8 kernel against the SPEC section 5 emulation and float64,
BF16 against float64, outputs NaN-poisoned before the call (unused cache rows are poisoned by
``random_problem``), empty requests exactly 0 / +inf, and a second call bitwise equal."""

from __future__ import annotations

import random

import pytest
import torch

from snapmla_cli.cache.layout import dequantize_cache
from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.emulation import emulate_fp8_decode
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.numerics.problem import DecodeProblem, random_problem
from snapmla_cli.numerics.quant import quantize_rows

pytestmark = pytest.mark.gpu

DRAWS = 16
SEED = 57
MAX_BATCH = 9
MAX_S_Q = 4
MAX_HEADS = 128
MAX_TOKENS_PER_DRAW = 24_000  # keeps the CPU-side references of a draw to a second or two
EMUL_GATE = 5e-3
FLOOR_FACTOR, FLOOR_ABS = 1.10, 1e-3
BF16_COS_GATE = 5e-6
LSE_GATE = 1e-2


def _length(rng: random.Random, budget: int) -> int:
    """One request's length: empty, inside one page, a page multiple, or long with a ragged tail."""
    kind = rng.choice(("empty", "short", "aligned", "long", "long"))
    if kind == "empty":
        return 0
    if kind == "short":
        return rng.randint(1, 63)
    if kind == "aligned":
        return 64 * rng.randint(1, max(1, min(budget, 4096) // 64))
    return rng.randint(max(65, budget // 2), max(65, budget))


def _draw(index: int) -> tuple[list[int], int, int, bool]:
    rng = random.Random(SEED * 1000 + index)
    b = rng.randint(1, MAX_BATCH)
    s_q = rng.randint(1, MAX_S_Q)
    h_q = rng.randint(1, MAX_HEADS // s_q)
    per_request = MAX_TOKENS_PER_DRAW // b
    seqlens = [_length(rng, per_request) for _ in range(b)]
    return seqlens, s_q, h_q, rng.random() < 0.5


# deeper speculative decoding than SPEC section 1's s_q 1..4, up to what the commands accept
# (sizes.MAX_QUERY_TOKENS): a row count that packs few heads per token, and a causal tail shorter
# than s_q in a request next to a long one
DEEP_MTP_CASES = [([700, 0, 130], 8, 16, True), ([2000, 9], 16, 5, True), ([65, 129], 5, 13, False)]
CASES = [_draw(i) for i in range(DRAWS)] + DEEP_MTP_CASES


def _case_id(case: tuple[list[int], int, int, bool]) -> str:
    seqlens, s_q, h_q, causal = case
    return f"b{len(seqlens)}-s{s_q}-h{h_q}-{'causal' if causal else 'full'}"


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _decode_twice(prob: DecodeProblem, fp8: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The default path (``get_mla_metadata`` then the decode) into NaN-filled outputs, twice;
    the second call's bits must equal the first's."""
    from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata

    b, s_q, h_q, _ = prob.q.shape
    table = prob.layout.block_table.to(device)
    lens = prob.layout.cache_seqlens.to(device)
    meta, splits = get_mla_metadata(lens, s_q * h_q, 1, fp8=fp8)
    results = []
    for _ in range(2):
        out = _poisoned((b, s_q, h_q, 512), torch.bfloat16, device)
        lse = _poisoned((b, h_q, s_q), torch.float32, device)
        if fp8:
            decode_fp8(quantize_rows(prob.q.to(device)), prob.fp8_cache().to(device), table, lens, meta, splits,
                       prob.softmax_scale, prob.causal, out=out, lse=lse)
        else:
            decode_bf16(prob.q.to(device), prob.bf16_cache().to(device), table, lens, meta, splits,
                        prob.softmax_scale, prob.causal, out=out, lse=lse)
        results.append((out, lse))
    (out, lse), (again_out, again_lse) = results
    assert torch.equal(out, again_out) and torch.equal(lse, again_lse), "a second call changed bits"
    return out, lse


def _check_empty_requests(seqlens: list[int], out: torch.Tensor, lse: torch.Tensor) -> None:
    for i, n in enumerate(seqlens):
        if n == 0:
            assert torch.all(out[i] == 0) and torch.all(lse[i] == float("inf")), f"empty request {i}"


def test_the_draws_cover_the_odd_sizes() -> None:
    """The seed's draws include what the brief asks for, so a new seed cannot quietly drop it."""
    lengths = [n for seqlens, _, _, _ in CASES for n in seqlens]
    heads = [h for _, _, h, _ in CASES]
    assert 0 in lengths and any(n % 64 for n in lengths) and any(n and n % 64 == 0 for n in lengths)
    assert any(len(seqlens) == 1 for seqlens, _, _, _ in CASES)
    assert any(h & (h - 1) for h in heads) and any(s_q > 1 for _, s_q, _, _ in CASES)
    assert max(lengths) > 8192  # a request split over many CTAs (the split merge runs)
    assert any(s_q * h > 64 for _, s_q, h, _ in CASES)  # more than one 64-row tile


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_fp8_default_path_on_a_random_shape(case: tuple[list[int], int, int, bool]) -> None:
    seqlens, s_q, h_q, causal = case
    device = torch.device("cuda")
    prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=sum(seqlens) + h_q)
    out, lse = _decode_twice(prob, True, device)
    assert not out.isnan().any() and not lse.isnan().any()
    _check_empty_requests(seqlens, out, lse)
    table = prob.layout.block_table.to(device)
    lens = prob.layout.cache_seqlens.to(device)
    q_rows = quantize_rows(prob.q.to(device))
    cache = prob.fp8_cache().to(device)
    emul_out, emul_lse = emulate_fp8_decode(q_rows, cache, table, lens, prob.softmax_scale, causal)
    ref_out, _ = decode_reference(prob.q.to(device), prob.bf16_cache().squeeze(2).to(device), table, lens,
                                  prob.softmax_scale, causal)
    floor_out, _ = decode_reference(q_rows.dequantize(), dequantize_cache(cache), table, lens,
                                    prob.softmax_scale, causal)
    if not any(seqlens):
        return  # nothing but empty requests: checked above
    vs_emul, vs_ref, floor = compare(out, emul_out), compare(out, ref_out), compare(floor_out, ref_out)
    assert vs_emul.rel_l2 <= EMUL_GATE, vs_emul
    assert vs_ref.rel_l2 <= FLOOR_FACTOR * floor.rel_l2 + FLOOR_ABS, (vs_ref, floor)
    finite = emul_lse.isfinite()
    assert torch.equal(finite, lse.isfinite())
    assert compare(lse[finite], emul_lse[finite]).max_abs < LSE_GATE


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bf16_default_path_on_a_random_shape(case: tuple[list[int], int, int, bool]) -> None:
    seqlens, s_q, h_q, causal = case
    device = torch.device("cuda")
    prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=sum(seqlens) + h_q + 1)
    out, lse = _decode_twice(prob, False, device)
    assert not out.isnan().any() and not lse.isnan().any()
    _check_empty_requests(seqlens, out, lse)
    if not any(seqlens):
        return
    table = prob.layout.block_table.to(device)
    lens = prob.layout.cache_seqlens.to(device)
    ref_out, _ = decode_reference(prob.q.to(device), prob.bf16_cache().squeeze(2).to(device), table, lens,
                                  prob.softmax_scale, causal)
    vs_ref = compare(out, ref_out)
    assert vs_ref.cos_diff <= BF16_COS_GATE, vs_ref
