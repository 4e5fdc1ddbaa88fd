"""decode_reference (SPEC section 2) against a naive loop over query rows."""

from __future__ import annotations

import math

import pytest
import torch

from snapmla_cli.cache.layout import PagedLayout, scatter_to_pages
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.formats import D_QK, D_V
from snapmla_cli.numerics.problem import DecodeProblem, random_problem


def naive_decode(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row at a time, straight from SPEC section 2."""
    b, s_q, h_q, _ = problem.q.shape
    out = torch.zeros(b, s_q, h_q, D_V, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i in range(b):
        keys = problem.tokens[i].double()
        n = keys.shape[0]
        for t in range(s_q):
            visible = min(max(n - s_q + t + 1, 0), n) if problem.causal else n
            if visible == 0:
                continue
            for h in range(h_q):
                logits = problem.softmax_scale * (keys[:visible] @ problem.q[i, t, h].double())
                top = logits.max()
                weights = torch.exp(logits - top)
                out[i, t, h] = (weights / weights.sum()) @ keys[:visible, :D_V]
                lse[i, h, t] = top + torch.log(weights.sum())
    return out, lse


def _reference(problem: DecodeProblem, cache: torch.Tensor | None = None, table: torch.Tensor | None = None):
    cache = problem.bf16_cache().squeeze(2) if cache is None else cache
    table = problem.layout.block_table if table is None else table
    return decode_reference(problem.q, cache, table, problem.layout.cache_seqlens,
                            problem.softmax_scale, problem.causal)


@pytest.mark.parametrize("h_q", [1, 3, 20])
def test_matches_naive_loop_any_head_count(h_q: int) -> None:
    problem = random_problem([70, 1, 128], s_q=1, h_q=h_q, seed=h_q)
    out, lse = _reference(problem)
    ref_out, ref_lse = naive_decode(problem)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
def test_causal_mtp_matches_naive_loop(s_q: int) -> None:
    problem = random_problem([2, 65, 130], s_q=s_q, h_q=3, causal=True, seed=10 + s_q)
    out, lse = _reference(problem)
    ref_out, ref_lse = naive_decode(problem)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_an_explicit_softmax_scale_is_used() -> None:
    """SPEC section 2: logits are ``softmax_scale * q . k``; a caller's scale (here far from the
    576 ** -0.5 default) must reach the logits, not be replaced by the default."""
    problem = random_problem([70, 130], s_q=2, h_q=3, causal=True, seed=21, softmax_scale=0.013)
    out, lse = _reference(problem)
    ref_out, ref_lse = naive_decode(problem)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_empty_sequences_give_zero_output_and_infinite_lse() -> None:
    problem = random_problem([0, 5, 0], s_q=2, h_q=2, seed=3)
    out, lse = _reference(problem)
    for i in (0, 2):
        assert out[i].eq(0).all()
        assert torch.isinf(lse[i]).all() and (lse[i] > 0).all()
    assert torch.isfinite(lse[1]).all()


def test_rows_without_visible_keys_under_causal_masking() -> None:
    problem = random_problem([2], s_q=4, h_q=2, causal=True, seed=4)  # tokens 0, 1 see nothing
    out, lse = _reference(problem)
    assert out[0, :2].eq(0).all() and torch.isinf(lse[0, :, :2]).all()
    assert torch.isfinite(lse[0, :, 2:]).all()


def test_poisoned_rows_and_garbage_block_table_entries_never_change_a_result() -> None:
    problem = random_problem([3, 64, 100], s_q=2, h_q=4, causal=True, seed=5)
    out, lse = _reference(problem)  # unused rows NaN, unused table entries -7
    assert torch.isfinite(out).all()
    layout = problem.layout
    other_fill = torch.full((D_QK,), 3.0e4, dtype=torch.bfloat16)
    other_cache = scatter_to_pages(problem.tokens, layout, other_fill)
    table = layout.block_table.clone()
    for i, n in enumerate(layout.cache_seqlens.tolist()):
        table[i, (n + 63) // 64 :] = 10**6 + i  # different garbage, far out of range
    out2, lse2 = _reference(problem, other_cache, table)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert isinstance(layout, PagedLayout)


def test_logits_beyond_the_reference_dtype_are_refused() -> None:
    """Finite values near 1e20 make q . k overflow float32: a float32 reference returned NaN rows
    with no word of why. Refused (naming the request and the remedy); float64 holds them."""
    problem = random_problem([70, 5], s_q=1, h_q=2, seed=8)
    huge = DecodeProblem(problem.q * 1e20, [t * 1e20 for t in problem.tokens], problem.layout, False,
                         problem.softmax_scale)
    cache = huge.bf16_cache().squeeze(2)
    args = (huge.layout.block_table, huge.layout.cache_seqlens)
    out, lse = decode_reference(huge.q, cache, *args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    with pytest.raises(SnapmlaError, match=r"^q, kv_cache: request 0's logits overflow float32 \(row 0 .*compute in "
                                           r"float64\)$"):
        decode_reference(huge.q, cache, *args, dtype=torch.float32)


@pytest.mark.parametrize(("tokens", "dtype"), [(1, torch.bfloat16), (130, torch.float32), (200, torch.bfloat16)])
def test_attending_all_tokens_is_the_paged_reference_bit_for_bit(tokens: int, dtype: torch.dtype) -> None:
    """quantize's per-layer attention skips the paged copy (twice the layer's size beside its
    float64 keys), not a digit of decode_reference's answer; NaN queries or keys are refused as there."""
    from snapmla_cli.numerics.decode_ref import attend_all_tokens

    gen = torch.Generator().manual_seed(tokens)
    kv = torch.randn(tokens, D_QK, generator=gen).to(dtype)
    q = torch.randn(3, 5, D_QK, generator=gen).to(dtype)
    pages = -(-tokens // 64)
    paged = torch.full((pages * 64, D_QK), math.nan, dtype=dtype)  # the tail past the tokens unread
    paged[:tokens] = kv
    table = torch.arange(pages, dtype=torch.int32)[None]
    expected, _ = decode_reference(q[None], paged.view(pages, 64, D_QK), table, torch.tensor([tokens], dtype=torch.int32), 0.07)
    got = attend_all_tokens(q, kv, 0.07)
    assert got.dtype == torch.float64 and torch.equal(got, expected[0])
    kv[tokens // 2, 3] = math.nan
    with pytest.raises(SnapmlaError, match="kv_cache: request 0 reads non-finite values in its keys"):
        attend_all_tokens(q, kv, 0.07)
    q[1, 2, 0] = math.inf
    with pytest.raises(SnapmlaError, match="^q: expected finite values"):
        attend_all_tokens(q, kv, 0.07)


def test_attending_all_tokens_checks_its_arguments_as_the_reference_does() -> None:
    from snapmla_cli.numerics.decode_ref import attend_all_tokens
    from snapmla_cli.numerics.formats import default_softmax_scale

    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(D_QK, 90, generator=gen, dtype=torch.float64).T  # non-contiguous keys
    q = torch.randn(2, 3, D_QK, generator=gen)
    pages = torch.full((2 * 64, D_QK), math.nan, dtype=torch.float64)
    pages[:90] = kv
    expected, _ = decode_reference(q[None], pages.view(2, 64, D_QK), torch.arange(2, dtype=torch.int32)[None],
                                   torch.tensor([90], dtype=torch.int32), None)
    assert torch.equal(attend_all_tokens(q, kv, None), expected[0])  # None: SPEC's default scale
    assert torch.equal(attend_all_tokens(q, kv, default_softmax_scale()), expected[0])
    for scale, words in ((math.nan, "^softmax_scale: expected a finite number"), (-1.0, "^softmax_scale: ")):
        with pytest.raises(SnapmlaError, match=words):
            attend_all_tokens(q, kv, scale)
    with pytest.raises(SnapmlaError, match=r"^q: expected a float tensor \[n, h_q, 576\], got \(2, 3, 576\) int64"):
        attend_all_tokens(q.long(), kv, None)
    with pytest.raises(SnapmlaError, match=r"^kv: expected a float tensor \[tokens, 576\], got \(90, 512\)"):
        attend_all_tokens(q, kv[:, :512], None)
