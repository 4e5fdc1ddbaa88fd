"""``SNAPMLA_CHECK_FINITE``: the opt-in NaN / inf checks of CUDA inputs (``ops.finite``).

Off (the default), CUDA calls never read values back, so a NaN query row only makes its own
output rows NaN; on, every entry point refuses a non-finite input with a one-line error naming
it, before anything is written, and refuses to run inside CUDA-graph capture.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.formats import FP8_TOKEN_BYTES
from snapmla_cli.numerics.problem import random_problem
from snapmla_cli.numerics.quant import quantize_rows
from snapmla_cli.ops.decode import decode_fp8, flash_mla_with_kvcache, get_mla_metadata
from snapmla_cli.ops.finite import GPU_CHECKS, set_gpu_checks
from snapmla_cli.ops.prep import append_kv, fetch_dequant, quantize_q

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _switch(enabled: bool) -> Iterator[None]:
    was = GPU_CHECKS.on
    set_gpu_checks(enabled)
    try:
        yield
    finally:
        set_gpu_checks(was)


@pytest.fixture
def checks_on() -> Iterator[None]:
    yield from _switch(True)


@pytest.fixture
def checks_off() -> Iterator[None]:
    yield from _switch(False)


def _problem():
    prob = random_problem([65, 300], 2, 20, causal=True, seed=7)
    seqlens = prob.layout.cache_seqlens.to(DEV)
    meta, splits = get_mla_metadata(seqlens, 2 * 20, 1, fp8=True)
    meta16, splits16 = get_mla_metadata(seqlens, 2 * 20, 1, fp8=False)
    return prob, prob.layout.block_table.to(DEV), seqlens, (meta, splits), (meta16, splits16)


@pytest.mark.usefixtures("checks_off")
def test_off_nan_stays_in_its_rows() -> None:
    prob, table, seqlens, (meta, splits), _ = _problem()
    q = prob.q.to(DEV)
    q[1, 0, 3, 10] = float("nan")
    out, _ = flash_mla_with_kvcache(q, prob.fp8_cache().to(DEV), table, seqlens, 512, meta, splits,
                                    prob.softmax_scale, True)
    nan_rows = out.isnan().any(dim=-1).cpu()
    assert bool(nan_rows[1, 0, 3]) and int(nan_rows.sum()) == 1


@pytest.mark.usefixtures("checks_on")
def test_decode_entry_points_refuse_non_finite_q() -> None:
    prob, table, seqlens, (meta, splits), (meta16, splits16) = _problem()
    q = prob.q.to(DEV)
    q[0, 1, 19, 575] = float("inf")
    with pytest.raises(SnapmlaError, match="^q: 1 of 46080 values are NaN or inf"):
        flash_mla_with_kvcache(q, prob.fp8_cache().to(DEV), table, seqlens, 512, meta, splits,
                               prob.softmax_scale, True)
    bf16_cache = prob.bf16_cache().to(DEV)
    clean = prob.q.to(DEV)
    flash_mla_with_kvcache(clean, bf16_cache, table, seqlens, 512, meta16, splits16,
                           prob.softmax_scale, True)  # a plan for this signature: the replay path
    for _ in range(2):
        with pytest.raises(SnapmlaError, match="^q: 1 of 46080"):
            flash_mla_with_kvcache(q, bf16_cache, table, seqlens, 512, meta16, splits16,
                                   prob.softmax_scale, True)
    rows = quantize_rows(prob.q.to(DEV))
    rows.scale[0, 0, 0] = float("nan")
    with pytest.raises(SnapmlaError, match="^q.scale: 1 of 80 values"):
        decode_fp8(rows, prob.fp8_cache().to(DEV), table, seqlens, meta, splits, prob.softmax_scale, True)


@pytest.mark.usefixtures("checks_on")
def test_prep_refuses_non_finite_and_writes_nothing() -> None:
    q = torch.randn(4, 576, device=DEV, dtype=torch.bfloat16)
    q[2, 0] = float("nan")
    with pytest.raises(SnapmlaError, match="^q: 1 of 2304 values"):
        quantize_q(q)
    cache = torch.full((2, 64, FP8_TOKEN_BYTES), 0xFF, dtype=torch.uint8, device=DEV)
    kv = torch.randn(3, 576, device=DEV, dtype=torch.bfloat16)
    kv[1, 24] = -float("inf")
    with pytest.raises(SnapmlaError, match="^kv: 1 of 1728 values"):
        append_kv(kv, torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV), cache)
    assert bool((cache == 0xFF).all())
    append_kv(kv, torch.tensor([0, -1, 2], dtype=torch.int32, device=DEV), cache)  # padding row skipped
    assert not bool((cache[0, 2] == 0xFF).all())


@pytest.mark.usefixtures("checks_on")
def test_prep_refuses_a_rope_that_overflows_its_scale() -> None:
    """Finite rows whose pre-scaled RoPE is inf in bf16 (zero content, RoPE 1e30): refused by
    the same switch, on the GPU as on the CPU, before anything is written."""
    q = torch.randn(4, 576, device=DEV, dtype=torch.bfloat16)
    q[3, :512] = 0.0
    q[3, 512] = 1e30
    with pytest.raises(SnapmlaError, match=r"^q\[3\]: its RoPE part"):
        quantize_q(q)
    cache = torch.full((2, 64, FP8_TOKEN_BYTES), 0xFF, dtype=torch.uint8, device=DEV)
    with pytest.raises(SnapmlaError, match=r"^kv\[3\]: its RoPE part"):
        append_kv(q, torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEV), cache)
    assert bool((cache == 0xFF).all())


@pytest.mark.usefixtures("checks_on")
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture holds nothing
def test_checks_refuse_graph_capture() -> None:
    q = torch.randn(4, 576, device=DEV, dtype=torch.bfloat16)
    quantize_q(q)  # compile and plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(SnapmlaError, match="during CUDA-graph capture"), torch.cuda.graph(graph):
        quantize_q(q)


@pytest.mark.usefixtures("checks_on")
def test_checks_refuse_a_block_table_that_does_not_cover_the_lengths() -> None:
    """The kernels index the table without bounds; with the switch on a length beyond its row of
    the table, or a page outside the cache, is refused before anything runs, both formats, on
    the first call of a signature and on its replays."""
    prob, table, seqlens, (meta, splits), (meta16, splits16) = _problem()
    fp8_cache, bf16_cache = prob.fp8_cache().to(DEV), prob.bf16_cache().to(DEV)
    q = prob.q.to(DEV)
    for cache, (m, s) in ((fp8_cache, (meta, splits)), (bf16_cache, (meta16, splits16))):
        flash_mla_with_kvcache(q, cache, table, seqlens, 512, m, s, prob.softmax_scale, True)  # a plan
        too_long = seqlens.clone()
        too_long[0] = table.shape[1] * 64 + 1
        with pytest.raises(SnapmlaError, match=r"^cache_seqlens\[0\]: expected 0\.\."):
            flash_mla_with_kvcache(q, cache, table, too_long, 512, m, s, prob.softmax_scale, True)
        outside = table.clone()
        outside[1, 0] = cache.shape[0]
        with pytest.raises(SnapmlaError, match=r"^block_table\[1, 0\]: expected a block index"):
            flash_mla_with_kvcache(q, cache, outside, seqlens, 512, m, s, prob.softmax_scale, True)
        # another softmax scale is another signature: its first call (no plan yet) checks too
        with pytest.raises(SnapmlaError, match=r"^block_table\[1, 0\]: expected a block index"):
            flash_mla_with_kvcache(q, cache, outside, seqlens, 512, m, s, prob.softmax_scale / 2, True)


@pytest.mark.usefixtures("checks_on")
def test_checks_name_a_misshapen_q_not_the_table() -> None:
    """The table check reads q's batch, so it runs after q's shape check (first calls)."""
    prob, table, seqlens, (meta, splits), (meta16, splits16) = _problem()
    q = prob.q.to(DEV)
    with pytest.raises(SnapmlaError, match=r"^q: expected \[b, s_q, h_q, 576\]"):
        flash_mla_with_kvcache(q[0], prob.bf16_cache().to(DEV), table, seqlens, 512, meta16, splits16,
                               prob.softmax_scale, True)
    rows = quantize_q(q)
    flat = type(rows)(rows.content, rows.scale[0, 0, 0], rows.rope)
    with pytest.raises(SnapmlaError, match=r"^q.scale: expected \[b, s_q, h_q\]"):
        decode_fp8(flat, prob.fp8_cache().to(DEV), table, seqlens, meta, splits, prob.softmax_scale, True)


def test_fetch_dequant_refuses_a_bad_table_under_the_switch(checks_on: None) -> None:
    """As the CPU path always does: a page outside the cache, a length beyond the table row."""
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8, device=DEV)
    table = torch.tensor([[0, 9]], dtype=torch.int32, device=DEV)
    with pytest.raises(SnapmlaError, match=r"block_table\[0, 1\]: expected a block index in 0..3"):
        fetch_dequant(cache, table, torch.tensor([70], dtype=torch.int32, device=DEV))
    with pytest.raises(SnapmlaError, match=r"cache_seqlens\[0\]: expected 0..128"):
        fetch_dequant(cache, table, torch.tensor([129], dtype=torch.int32, device=DEV), total_tokens=200)
    assert fetch_dequant(cache, table[:, :1], torch.tensor([-3], dtype=torch.int32, device=DEV)).shape == (0, 576)

