"""CPU paths of the prep ops (reference fallbacks) and their argument checks.

The CUDA paths are compared byte for byte with these same references in tests/gpu/test_prep.py.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snapmla_cli.cache.layout import (
    as_token_bytes,
    nan_token_bytes,
    quantize_tokens,
    random_paged_layout,
    scatter_to_pages,
    soa_to_rows,
    unpack_tokens,
)
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.formats import D_CONTENT, D_QK, FP8_DTYPE, FP8_TOKEN_BYTES, PAGE_SIZE
from snapmla_cli.numerics.quant import QuantizedRows, quantize_rows
from snapmla_cli.ops.finite import set_gpu_checks
from snapmla_cli.ops.prep import (
    append_kv,
    fetch_dequant,
    fetch_dequant_slots,
    fetch_dequant_soa,
    quantize_q,
    row_offsets,
)


def _kv(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    content = torch.randn(n, 512, generator=g) * torch.logspace(-3, 3, n)[:, None]
    rope = torch.randn(n, 64, generator=g) * 100
    return torch.cat([content, rope], dim=1).to(torch.bfloat16)


def _poisoned_cache(blocks: int) -> torch.Tensor:
    return nan_token_bytes().expand(blocks, PAGE_SIZE, FP8_TOKEN_BYTES).clone()


def _ref_dequant(raw: torch.Tensor) -> torch.Tensor:
    return unpack_tokens(raw).dequantize(torch.float32).to(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


# ---------------------------------------------------------------- quantize_q


def test_quantize_q_cpu_keeps_the_query_shape() -> None:
    """On the CPU ``quantize_q`` is the reference quantizer (whose values test_quant.py checks
    against SPEC independently); what the API adds is the ``[b, s_q, h_q]`` shape of its parts."""
    q = _kv(2 * 3 * 4).view(2, 3, 4, D_QK)
    got = quantize_q(q)
    assert got.content.dtype == FP8_DTYPE and got.content.shape == (2, 3, 4, 512)
    assert got.scale.dtype == torch.float32 and got.scale.shape == (2, 3, 4)
    assert got.rope.dtype == torch.bfloat16 and got.rope.shape == (2, 3, 4, 64)
    flat = quantize_rows(q.reshape(-1, D_QK))  # row order: request, token, head
    assert torch.equal(got.scale.reshape(-1), flat.scale)


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.zeros(4, 575, dtype=torch.bfloat16), r"q: expected shape \[\.\.\., 576\]"),
        (torch.zeros(4, 576, dtype=torch.int32), "q: expected dtype"),
        (torch.zeros(576, 4, dtype=torch.bfloat16).T, "q: expected shape|q: expected a contiguous"),
        (torch.zeros(4, 1152, dtype=torch.bfloat16)[:, ::2], "q: expected a contiguous"),
        ("not a tensor", "q: expected a torch.Tensor"),
        (torch.tensor(0.5, dtype=torch.bfloat16), r"q: expected shape \[\.\.\., 576\].*got \(\)"),  # 0-d
    ],
)
def test_quantize_q_rejects(bad: object, match: str) -> None:
    with pytest.raises(SnapmlaError, match=match):
        quantize_q(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- append_kv


@pytest.mark.parametrize("layout", ["3d", "4d", "fp8"])
def test_append_kv_cpu_writes_only_valid_slots(layout: str) -> None:
    blocks = 3
    cache = _poisoned_cache(blocks)
    view = {
        "3d": cache,
        "4d": cache.view(blocks, PAGE_SIZE, 1, FP8_TOKEN_BYTES),
        "fp8": cache.view(FP8_DTYPE),
    }[layout]
    kv = _kv(6)
    slots = torch.tensor([5, -1, 64 * blocks, 130, -9, 0], dtype=torch.int32)
    out = append_kv(kv, slots, view)
    assert out is view
    flat = cache.view(-1, FP8_TOKEN_BYTES)
    packed = quantize_tokens(kv)
    assert torch.equal(flat[5], packed[0]) and torch.equal(flat[130], packed[3])
    assert torch.equal(flat[0], packed[5])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[[0, 5, 130]] = False
    assert bool((flat[untouched] == 0xFF).all())


def test_a_zero_dimensional_cache_is_named() -> None:
    """A 0-d cache was an IndexError (its last dimension read before its rank) in every prep op."""
    scalar = torch.tensor(1, dtype=torch.uint8)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(SnapmlaError, match=f"^k_cache: expected last dim {FP8_TOKEN_BYTES}, got \\(\\)"):
        append_kv(_kv(1), torch.zeros(1, dtype=torch.int32), scalar)
    with pytest.raises(SnapmlaError, match=f"^k_cache: expected last dim {FP8_TOKEN_BYTES}"):
        fetch_dequant(scalar, table, lens)


def test_append_kv_cpu_accepts_int64_slots_and_empty() -> None:
    cache = _poisoned_cache(1)
    kv = _kv(2)
    append_kv(kv, torch.tensor([3, 2**40], dtype=torch.int64), cache)
    assert torch.equal(cache.view(-1, FP8_TOKEN_BYTES)[3], quantize_tokens(kv)[0])
    before = cache.clone()
    append_kv(kv[:0], torch.zeros(0, dtype=torch.int32), cache)
    assert torch.equal(before, cache)


def test_append_kv_rejects() -> None:
    cache = _poisoned_cache(2)
    kv = _kv(3)
    slots = torch.arange(3, dtype=torch.int32)
    with pytest.raises(SnapmlaError, match=r"kv: expected shape \[n, 576\]"):
        append_kv(kv[:, :500], slots, cache)
    with pytest.raises(SnapmlaError, match=r"slots: expected shape \[3\]"):
        append_kv(kv, slots[:2], cache)
    with pytest.raises(SnapmlaError, match="slots: expected dtype int32 or int64"):
        append_kv(kv, slots.float(), cache)
    with pytest.raises(SnapmlaError, match="k_cache: expected uint8 or float8_e4m3fn"):
        append_kv(kv, slots, cache.to(torch.int16))
    with pytest.raises(SnapmlaError, match="k_cache: expected shape"):
        append_kv(kv, slots, cache.view(4, 32, FP8_TOKEN_BYTES))
    with pytest.raises(SnapmlaError, match="k_cache: expected last dim 656"):
        append_kv(kv, slots, cache[..., :600])
    with pytest.raises(SnapmlaError, match="k_cache: expected a contiguous"):
        append_kv(
            kv, slots, torch.zeros(2, PAGE_SIZE, 2 * FP8_TOKEN_BYTES, dtype=torch.uint8)[..., ::2]
        )
    with pytest.raises(SnapmlaError, match="slots: expected a tensor on cpu"):
        append_kv(kv, slots.to("meta"), cache)
    with pytest.raises(SnapmlaError, match="kv: expected a contiguous"):  # as on the GPU
        append_kv(kv.T.contiguous().T, slots, cache)
    with pytest.raises(SnapmlaError, match="^kv: expected a CPU or CUDA tensor, got meta"):
        append_kv(kv.to("meta"), slots.to("meta"), cache.to("meta"))


# ---------------------------------------------------------------- fetch_dequant


def _paged_problem(seqlens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layout = random_paged_layout(seqlens, generator=g)
    tokens = [quantize_tokens(_kv(n, seed + i)) for i, n in enumerate(seqlens)]
    cache = scatter_to_pages(tokens, layout, nan_token_bytes())
    return layout, tokens, cache


def test_fetch_dequant_cpu_matches_reference() -> None:
    seqlens = [70, 0, 1, 128, 5]
    layout, tokens, cache = _paged_problem(seqlens)
    out = fetch_dequant(cache, layout.block_table, layout.cache_seqlens)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(seqlens), D_QK)
    ref = torch.cat([_ref_dequant(t) for t in tokens])
    assert _same_bits(out, ref)
    assert bool(torch.isfinite(out.float()).all())  # NaN pages past the ends were never read


def test_fetch_dequant_total_tokens_pads_and_truncates() -> None:
    seqlens = [10, 20]
    layout, tokens, cache = _paged_problem(seqlens, seed=3)
    ref = torch.cat([_ref_dequant(t) for t in tokens])
    longer = fetch_dequant(cache, layout.block_table, layout.cache_seqlens, total_tokens=40)
    assert _same_bits(longer[:30], ref) and bool((longer[30:] == 0).all())
    shorter = fetch_dequant(cache, layout.block_table, layout.cache_seqlens, total_tokens=12)
    assert _same_bits(shorter, ref[:12])
    assert fetch_dequant(cache, layout.block_table, layout.cache_seqlens, total_tokens=0).shape == (
        0,
        D_QK,
    )


def test_fetch_dequant_refuses_a_bad_table() -> None:
    """A page outside the cache or a length beyond its table row is an error on the CPU (on
    CUDA under the checks switch), not rows of zeros; negative lengths still count as empty."""
    layout, _, cache = _paged_problem([70], seed=4)
    table = layout.block_table.clone()
    table[0, 1] = cache.shape[0] + 5  # second page points past the cache
    seqlens = torch.tensor([70], dtype=torch.int32)
    with pytest.raises(SnapmlaError, match=rf"block_table\[0, 1\]: expected a block index in 0..{cache.shape[0] - 1}"):
        fetch_dequant(cache, table, seqlens)
    table[0, 1] = -1
    with pytest.raises(SnapmlaError, match=r"block_table\[0, 1\].*got -1"):
        fetch_dequant(cache, table, seqlens, total_tokens=80)
    with pytest.raises(SnapmlaError, match=r"cache_seqlens\[0\]: expected 0..64"):
        fetch_dequant(cache, table[:, :1], seqlens)
    out = fetch_dequant(cache, table, torch.tensor([-5], dtype=torch.int32))
    assert out.shape == (0, D_QK)


def test_row_offsets_cap_instead_of_wrapping() -> None:
    """Lengths adding up past int32 (only reachable unchecked on CUDA with total_tokens): the
    offsets stay ordered at the cap, so the first request's rows stay where they belong."""
    big = 2**31 - 1
    offsets = row_offsets(torch.tensor([big, big, 10], dtype=torch.int32))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, big, big, big]
    assert row_offsets(torch.tensor([5, 0, 7], dtype=torch.int32)).tolist() == [0, 5, 5, 12]
    assert row_offsets(torch.zeros(0, dtype=torch.int32)).tolist() == [0]


def test_fetch_dequant_rejects() -> None:
    layout, _, cache = _paged_problem([5, 6])
    bt, sl = layout.block_table, layout.cache_seqlens
    with pytest.raises(SnapmlaError, match="block_table: expected dtype int32"):
        fetch_dequant(cache, bt.long(), sl)
    with pytest.raises(SnapmlaError, match="block_table: expected shape"):
        fetch_dequant(cache, bt[0], sl)
    with pytest.raises(SnapmlaError, match=r"cache_seqlens: expected shape \[2\]"):
        fetch_dequant(cache, bt, sl[:1])
    with pytest.raises(SnapmlaError, match="cache_seqlens: expected dtype int32"):
        fetch_dequant(cache, bt, sl.float())
    with pytest.raises(SnapmlaError, match="total_tokens"):
        fetch_dequant(cache, bt, sl, total_tokens=-1)
    with pytest.raises(SnapmlaError, match="block_table: expected a tensor on cpu"):
        fetch_dequant(cache, bt.to("meta"), sl)



def test_a_first_tensor_without_data_is_named_itself() -> None:
    """The devices were compared with the first tensor's before its own was checked: a 'meta' kv
    (or cache) among host tensors named the next argument, asking for a tensor on meta ("slots:
    expected a tensor on meta (like kv), got cpu"), a device no call takes."""
    layout, _, cache = _paged_problem([5, 6])
    kv = torch.randn(2, D_QK).to(torch.bfloat16)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(SnapmlaError, match="^kv: expected a CPU or CUDA tensor, got meta$"):
        append_kv(kv.to("meta"), slots, cache)
    with pytest.raises(SnapmlaError, match="^k_cache: expected a CPU or CUDA tensor, got meta$"):
        fetch_dequant(cache.to("meta"), layout.block_table, layout.cache_seqlens)
    with pytest.raises(SnapmlaError, match="^k_cache: expected a CPU or CUDA tensor, got meta$"):
        fetch_dequant_slots(cache.to("meta"), slots)
    rows = unpack_tokens(cache.view(-1, FP8_TOKEN_BYTES))
    with pytest.raises(SnapmlaError, match="^content: expected a CPU or CUDA tensor, got meta$"):
        fetch_dequant_soa(rows.content.to("meta"), rows.scale, rows.rope, slots)

def test_fetch_dequant_slots_cpu() -> None:
    _, _, cache = _paged_problem([100], seed=5)
    flat = as_token_bytes(cache).reshape(-1, FP8_TOKEN_BYTES)
    slots = torch.tensor([7, -1, flat.shape[0], 3, 7], dtype=torch.int32)
    out = fetch_dequant_slots(cache, slots)
    assert out.shape == (5, D_QK)
    assert _same_bits(out[0], _ref_dequant(flat[7])) and _same_bits(out[3], _ref_dequant(flat[3]))
    assert _same_bits(out[4], out[0])
    assert bool((out[1] == 0).all()) and bool((out[2] == 0).all())
    with pytest.raises(SnapmlaError, match="slots: expected shape"):
        fetch_dequant_slots(cache, slots.view(5, 1))


def test_fetch_dequant_soa_cpu() -> None:
    rows = quantize_rows(_kv(9, seed=6))
    content = rows.content.view(torch.uint8).contiguous()
    slots = torch.tensor([8, 0, -1, 9, 4], dtype=torch.int32)
    out = fetch_dequant_soa(content, rows.scale, rows.rope, slots)
    ref = rows.dequantize(torch.float32).to(torch.bfloat16)
    assert _same_bits(out[0], ref[8]) and _same_bits(out[1], ref[0]) and _same_bits(out[4], ref[4])
    assert bool((out[2] == 0).all()) and bool((out[3] == 0).all())
    fp8_view = fetch_dequant_soa(rows.content, rows.scale, rows.rope, slots)
    assert _same_bits(fp8_view, out)
    with pytest.raises(SnapmlaError, match=r"scale: expected shape \[9\]"):
        fetch_dequant_soa(content, rows.scale[:8], rows.rope, slots)
    with pytest.raises(SnapmlaError, match="rope: expected dtype bfloat16"):
        fetch_dequant_soa(content, rows.scale, rows.rope.float(), slots)
    with pytest.raises(SnapmlaError, match=r"content: expected shape \[slots, 512\]"):
        fetch_dequant_soa(content[:, :256], rows.scale, rows.rope, slots)
    with pytest.raises(SnapmlaError, match=r"rope: expected shape \[9, 64\], got \(8, 64\)"):
        fetch_dequant_soa(content, rows.scale, rows.rope[:8], slots)  # one slot short


def _as_soa(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paged cache's tokens as SGLang-FluentLLM's structure of arrays, slot for slot."""
    rows = unpack_tokens(as_token_bytes(cache).reshape(-1, FP8_TOKEN_BYTES))
    return rows.content.view(torch.uint8), rows.scale, rows.rope


def test_fetch_dequant_takes_the_structure_of_arrays_form() -> None:
    """SPEC section 3: fetch_dequant also reads SGLang-FluentLLM's (content, scale, rope); the block
    table addresses its slots as a paged cache's, so both forms give the same bits."""
    seqlens = [70, 0, 1, 128, 5]
    layout, _, cache = _paged_problem(seqlens, seed=8)
    soa = _as_soa(cache)
    paged = fetch_dequant(cache, layout.block_table, layout.cache_seqlens)
    assert _same_bits(fetch_dequant(soa, layout.block_table, layout.cache_seqlens), paged)
    assert bool(torch.isfinite(paged.float()).all())  # NaN slots past the ends were never read
    padded = fetch_dequant(list(soa), layout.block_table, layout.cache_seqlens, total_tokens=210)
    assert _same_bits(padded[:204], paged) and bool((padded[204:] == 0).all())
    assert _same_bits(fetch_dequant(soa, layout.block_table, layout.cache_seqlens, total_tokens=9), paged[:9])
    table = layout.block_table.clone()
    table[0, 1] = cache.shape[0]  # one page past the slot arrays
    with pytest.raises(SnapmlaError, match=r"block_table\[0, 1\]: expected a block index"):
        fetch_dequant(soa, table, layout.cache_seqlens)
    with pytest.raises(SnapmlaError, match="k_cache: expected the paged FP8 cache or a structure of arrays"):
        fetch_dequant(soa[:2], layout.block_table, layout.cache_seqlens)
    with pytest.raises(SnapmlaError, match="structure of arrays .* got a tuple of 4"):  # one array too many
        fetch_dequant((*soa, soa[2]), layout.block_table, layout.cache_seqlens)
    with pytest.raises(SnapmlaError, match="rope: expected dtype bfloat16"):
        fetch_dequant((soa[0], soa[1], soa[2].float()), layout.block_table, layout.cache_seqlens)
    empty = torch.zeros(0, 1, dtype=torch.int32)
    assert fetch_dequant(soa, empty, torch.zeros(0, dtype=torch.int32), total_tokens=3).shape == (3, D_QK)
    # a partial last page of slots cannot be addressed by a block table: the message says so
    short = tuple(t[:100] for t in soa)
    with pytest.raises(SnapmlaError, match=r"holds 100 slots: 1 whole page of 64"):
        fetch_dequant(short, torch.tensor([[1]], dtype=torch.int32), torch.tensor([36], dtype=torch.int32))


@pytest.mark.parametrize("soa", [False, True])
def test_fetch_dequant_too_large_for_the_host_is_one_line(soa: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """total_tokens past what the host holds: one line before any allocation (the structure of
    arrays' index tensors were allocated first and the process was killed for memory)."""
    from snapmla_cli import host_memory

    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**30)
    layout, _, cache = _paged_problem([70], seed=9)
    k_cache = _as_soa(cache) if soa else cache
    with pytest.raises(SnapmlaError, match=r"^total_tokens=2147483647: fetch_dequant's rows: needs about"):
        fetch_dequant(k_cache, layout.block_table, layout.cache_seqlens, total_tokens=2**31 - 1)
    assert fetch_dequant(k_cache, layout.block_table, layout.cache_seqlens).shape == (70, D_QK)


def test_dequant_reference_is_float32_multiply_then_bf16() -> None:
    """The kernels' rule, bf16(float32(x) * s), is what dequantize(float32).to(bf16) computes."""
    rows = quantize_rows(_kv(4, seed=7))
    s = rows.scale[:, None]
    manual = torch.cat([rows.content.float() * s, rows.rope.float() * s], dim=1).to(torch.bfloat16)
    assert _same_bits(manual, rows.dequantize(torch.float32).to(torch.bfloat16))


def test_prep_imports_and_runs_without_cupy() -> None:
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import torch\n"
        "from snapmla_cli.ops.prep import quantize_q\n"
        "r = quantize_q(torch.ones(2, 576, dtype=torch.bfloat16))\n"
        "assert r.scale.shape == (2,)\n"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=str(__import__("pathlib").Path(__file__).parents[1]),
    )


# ---------------------------------------------------------------- quantize_q(out=)


def test_quantize_q_cpu_out_is_filled_and_returned() -> None:
    q = _kv(2 * 5).view(2, 5, D_QK)
    ref = quantize_rows(q)
    out = QuantizedRows(
        content=torch.empty(2, 5, 512, dtype=FP8_DTYPE),
        scale=torch.empty(2, 5),
        rope=torch.empty(2, 5, 64, dtype=torch.bfloat16),
    )
    got = quantize_q(q, out=out)
    assert got is out
    assert torch.equal(out.content.view(torch.uint8), ref.content.view(torch.uint8))
    assert torch.equal(out.scale, ref.scale) and _same_bits(out.rope, ref.rope)


@pytest.mark.parametrize(
    "field,bad,match",
    [
        ("content", torch.empty(2, 5, 512, dtype=torch.uint8), "out.content: expected dtype"),
        ("scale", torch.empty(2, 4), r"out.scale: expected shape \[2, 5\]"),
        (
            "rope",
            torch.empty(2, 5, 128, dtype=torch.bfloat16)[..., ::2],
            "out.rope: expected a contiguous",
        ),
    ],
)
def test_quantize_q_out_rejects(field: str, bad: torch.Tensor, match: str) -> None:
    tensors = {
        "content": torch.empty(2, 5, 512, dtype=FP8_DTYPE),
        "scale": torch.empty(2, 5),
        "rope": torch.empty(2, 5, 64, dtype=torch.bfloat16),
    }
    tensors[field] = bad
    with pytest.raises(SnapmlaError, match=match):
        quantize_q(_kv(10).view(2, 5, D_QK), out=QuantizedRows(**tensors))
    with pytest.raises(SnapmlaError, match="out: expected QuantizedRows"):
        quantize_q(_kv(10).view(2, 5, D_QK), out=(1, 2, 3))  # type: ignore[arg-type]


# ---------------------------------------------------------------- the CUDA paths' host side
#
# The CUDA branches run here on CPU tensors with the kernel launch recorded instead of run:
# what reaches the launch (kernel, grid, raw arguments), the per-shape plan cache, and the
# per-call checks that stay after the first call (contiguity, alignment).


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    from snapmla_cli.runtime.launch import KernelHandle

    calls: list[tuple] = []

    def record(self, index, grid, block, args):
        calls.append((self.name, index, grid, block, tuple(args)))

    monkeypatch.setattr(KernelHandle, "launch", record)
    return calls


def _aligned_bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)  # fresh CPU tensors are 64-byte aligned


def test_cuda_path_quantize_q_launch_args(launches: list[tuple]) -> None:
    import numpy as np

    from snapmla_cli.ops import prep

    q = _aligned_bf16(3, 7, D_QK)
    res = prep._quantize_q_cuda(q)
    res2 = prep._quantize_q_cuda(q)  # cached plan, fresh outputs
    assert res.content.dtype == FP8_DTYPE and res.content.shape == (3, 7, 512)
    assert res.scale.shape == (3, 7) and res.rope.shape == (3, 7, 64)
    assert res2.content.data_ptr() != res.content.data_ptr()
    name, index, grid, block, args = launches[0]
    rows_per_cta = prep._WARPS_PER_CTA * prep._ROWS_PER_WARP
    assert name == "snapmla_quantize_q" and index == -1
    assert grid == (-(-21 // rows_per_cta), 1, 1) and block == (prep._THREADS, 1, 1)
    assert args[:4] == (
        q.data_ptr(),
        res.content.data_ptr(),
        res.scale.data_ptr(),
        res.rope.data_ptr(),
    )
    assert isinstance(args[4], np.int64) and int(args[4]) == 21
    out = prep._quantize_q_cuda(q, QuantizedRows(res.content, res.scale, res.rope))
    assert out.content is res.content and launches[-1][4][1] == res.content.data_ptr()
    assert len(launches) == 3
    prep._quantize_q_cuda(_aligned_bf16(0, 4, D_QK))  # no rows: no launch
    assert len(launches) == 3


def test_cuda_path_quantize_q_per_call_checks(launches: list[tuple]) -> None:
    from snapmla_cli.ops import prep

    q = _aligned_bf16(4, D_QK)
    prep._quantize_q_cuda(q)  # caches the plan for this shape
    with pytest.raises(SnapmlaError, match="q: expected a contiguous"):
        prep._quantize_q_cuda(_aligned_bf16(D_QK, 4).T)
    flat = _aligned_bf16(4 * D_QK + 1)
    with pytest.raises(SnapmlaError, match="16-byte boundary"):
        prep._quantize_q_cuda(flat[1:].view(4, D_QK))
    with pytest.raises(SnapmlaError, match="q: expected dtype bfloat16"):
        prep._quantize_q_cuda(torch.zeros(4, D_QK))
    good = prep._quantize_q_cuda(q)
    bad = QuantizedRows(good.content, good.scale[:3], good.rope)
    with pytest.raises(SnapmlaError, match=r"out.scale: expected shape \[4\]"):
        prep._quantize_q_cuda(q, bad)
    shifted = torch.empty(4 * 64 + 1, dtype=torch.bfloat16)[1:].view(4, 64)  # 2 mod 4
    with pytest.raises(SnapmlaError, match="out.rope: data must start on a 4-byte"):
        prep._quantize_q_cuda(q, QuantizedRows(good.content, good.scale, shifted))


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cuda_path_append_kv_launch_args(launches: list[tuple], slot_dtype: torch.dtype) -> None:
    from snapmla_cli.ops import prep

    kv = _aligned_bf16(5, D_QK)
    slots = torch.tensor([3, -1, 70, 2, 9], dtype=slot_dtype)
    cache = torch.zeros(2, PAGE_SIZE, 1, FP8_TOKEN_BYTES, dtype=torch.uint8).view(FP8_DTYPE)
    for _ in range(2):
        assert prep._append_kv_cuda(kv, slots, cache) is cache
    name, index, grid, _, args = launches[-1]
    assert name == ("snapmla_append_kv" if slot_dtype == torch.int32 else "snapmla_append_kv_i64")
    assert index == -1 and grid == (1, 1, 1)
    assert (args[0], args[1], args[3]) == (kv.data_ptr(), slots.data_ptr(), cache.data_ptr())
    assert int(args[2]) == 5 and int(args[4]) == 2 * PAGE_SIZE and len(launches) == 2
    prep._append_kv_cuda(kv[:0], slots[:0], cache)  # nothing to write: no launch
    assert len(launches) == 2
    with pytest.raises(SnapmlaError, match="slots: expected a contiguous"):
        prep._append_kv_cuda(kv, torch.zeros(5, 2, dtype=slot_dtype)[:, 0], cache)
    with pytest.raises(SnapmlaError, match="kv: expected dtype bfloat16"):
        prep._append_kv_cuda(kv.float(), slots, cache)
    with pytest.raises(SnapmlaError, match="k_cache: expected uint8 or float8_e4m3fn"):
        prep._append_kv_cuda(kv, slots, cache.view(torch.uint8).view(torch.int16))


# ---------------------------------------------------------------- NaN / inf inputs


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_quantize_q_cpu_rejects_non_finite(poison: float) -> None:
    q = _kv(6).view(2, 3, D_QK)
    q[1, 2, 100] = poison
    with pytest.raises(SnapmlaError, match=r"^q: 1 of 3456 values are NaN or inf"):
        quantize_q(q)


def test_append_kv_cpu_rejects_non_finite_rows_it_would_write() -> None:
    """A non-finite K row would poison its cache slot for every later decode: refused, and the
    cache is left as it was. A padding row (slot -1, skipped) may hold anything."""
    cache = _poisoned_cache(2)
    before = cache.clone()
    kv = _kv(4)
    kv[2, 7] = float("inf")
    with pytest.raises(SnapmlaError, match="^kv: 1 of 2304 values are NaN or inf"):
        append_kv(kv, torch.tensor([0, 1, 2, 3], dtype=torch.int32), cache)
    assert torch.equal(cache, before)
    append_kv(kv, torch.tensor([0, 1, -1, 3], dtype=torch.int32), cache)
    assert torch.equal(cache.view(-1, FP8_TOKEN_BYTES)[3], quantize_tokens(kv[3:4])[0])


def test_quantize_q_cpu_refuses_a_rope_that_overflows_its_scale() -> None:
    """Zero content puts the scale at its floor 2^-32; a RoPE of 1e30 pre-scales past bf16's
    range (inf in every logit of the row), one of 1e28 still fits (4.3e37)."""
    q = _kv(6).view(2, 3, D_QK)
    q[1, 2, :D_CONTENT] = 0.0
    q[1, 2, D_CONTENT:] = 1e28
    assert bool(torch.isfinite(quantize_q(q).rope.float()).all())
    q[1, 2, D_CONTENT + 5] = -1e30
    with pytest.raises(SnapmlaError, match=r"^q\[1, 2\]: its RoPE part \(\|x\| up to 1e\+30\) divided by"):
        quantize_q(q)


def test_a_rope_that_overflows_only_in_bf16_is_refused() -> None:
    """r / s may be finite in float32 and still round to inf in bf16 (above 3.396e38, bf16's
    largest value being 3.390e38): the check rounds as the quantizer does."""
    q = torch.randn(2, D_QK, generator=torch.Generator().manual_seed(5))
    q[1, :D_CONTENT] = 0.0
    q[1, D_CONTENT + 3] = 7.915e28  # / 2^-32 = 3.3995e38: finite in float32, inf in bf16
    assert bool(torch.isfinite(q[1, D_CONTENT:] / 2.0**-32).all())
    with pytest.raises(SnapmlaError, match=r"^q\[1\]: its RoPE part"):
        quantize_q(q)


def test_append_kv_cpu_refuses_a_rope_that_overflows_its_scale() -> None:
    cache = _poisoned_cache(2)
    before = cache.clone()
    kv = _kv(4)
    kv[1, :D_CONTENT] = 0.0
    kv[1, D_CONTENT] = 3e38
    kv[2, D_CONTENT] = 3e38  # a padding row (slot -1 below) may hold anything
    with pytest.raises(SnapmlaError, match=r"^kv\[1\]: its RoPE part"):
        append_kv(kv, torch.tensor([0, 1, -1, 3], dtype=torch.int32), cache)
    assert torch.equal(cache, before)
    append_kv(kv, torch.tensor([0, -1, -1, 3], dtype=torch.int32), cache)


def test_gpu_checks_switch_follows_the_environment() -> None:
    """The CUDA paths' switch is read from SNAPMLA_CHECK_FINITE once, at import."""
    code = "from snapmla_cli.ops.finite import GPU_CHECKS; print(GPU_CHECKS.on)"
    for value, expected in (("1", "True"), ("0", "False"), ("", "False")):
        env = {**os.environ, "SNAPMLA_CHECK_FINITE": value}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.strip() == expected, (value, result.stdout, result.stderr)


def test_public_api_names_resolve() -> None:
    """Every name ``snapmla_cli`` exports resolves through its lazy table (no GPU needed)."""
    import snapmla_cli

    for name in snapmla_cli.__all__:
        assert callable(getattr(snapmla_cli, name)), name
    assert snapmla_cli.set_gpu_checks is set_gpu_checks
    # a caller catches the library's refusals by the top-level name
    assert snapmla_cli.SnapmlaError is SnapmlaError
    # the types in the public signatures: quantize_q's result and out=, the decode calls' config=
    from snapmla_cli.numerics.quant import QuantizedRows
    from snapmla_cli.ops.decode_config import DecodeConfig

    assert snapmla_cli.QuantizedRows is QuantizedRows
    assert snapmla_cli.DecodeConfig is DecodeConfig
    for not_a_bool in ("false", 0, None):  # bool("false") is True: the switch would do the opposite
        with pytest.raises(SnapmlaError, match="enabled: expected True or False"):
            set_gpu_checks(not_a_bool)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        snapmla_cli.nope  # noqa: B018


@pytest.mark.parametrize("name", ["append_kv", "fetch_dequant_slots", "fetch_dequant_soa"])
def test_the_slot_functions_document_both_slot_dtypes(name: str) -> None:
    """Each takes int32 and int64 slots (``_SLOT_DTYPES``: the kernels read both natively); the
    docstrings of the fetches once said int32 only, or named no dtype."""
    from snapmla_cli.ops import prep

    assert prep._SLOT_DTYPES == (torch.int32, torch.int64)
    assert "int32 or int64" in " ".join((inspect.getdoc(getattr(prep, name)) or "").split())


def test_quantize_q_documents_that_a_host_q_is_contiguous_too() -> None:
    """The CPU path refuses a strided q as the CUDA one does; the docstring named contiguity for
    CUDA only."""
    strided = torch.zeros(2, 2 * D_QK)[:, ::2]
    with pytest.raises(SnapmlaError, match="^q: expected a contiguous tensor"):
        quantize_q(strided)
    doc = " ".join((inspect.getdoc(quantize_q) or "").split())
    assert "CPU: bf16, fp16 or fp32, contiguous too" in doc


def test_type_checkers_see_the_lazy_table() -> None:
    """The ``TYPE_CHECKING`` imports of ``snapmla_cli/__init__.py`` (what a caller's type checker
    reads; the lazy table is what runs) import every exported name from the module the table
    names: a name added to one and not the other would be Any to mypy or missing at run time."""
    import snapmla_cli

    tree = ast.parse(Path(snapmla_cli.__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.name: f"snapmla_cli.{node.module}"  # (relative imports: level 1)
             for node in block.body if isinstance(node, ast.ImportFrom) and node.level == 1
             for alias in node.names}
    assert typed == snapmla_cli._LAZY
    assert sorted(snapmla_cli._LAZY) == sorted(snapmla_cli.__all__)


def test_layout_helpers_refuse_other_widths_and_heads_and_read_scales_as_float32() -> None:
    """A 4-D cache must have one KV head; a structure of arrays must have 512 content and 64
    RoPE columns; its scales become float32 whatever their dtype."""
    gen = torch.Generator().manual_seed(12)
    with pytest.raises(SnapmlaError, match="k_cache: expected one KV head"):
        as_token_bytes(torch.zeros(2, PAGE_SIZE, 2, FP8_TOKEN_BYTES, dtype=torch.uint8))
    assert as_token_bytes(torch.zeros(2, PAGE_SIZE, 1, FP8_TOKEN_BYTES, dtype=torch.uint8)).shape == (
        2, PAGE_SIZE, FP8_TOKEN_BYTES)
    content = torch.randint(0, 0x7F, (5, 512), dtype=torch.uint8, generator=gen)
    scale = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    rope = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    rows = soa_to_rows(content, scale, rope)
    assert rows.scale.dtype == torch.float32 and torch.equal(rows.scale, scale.float())
    with pytest.raises(SnapmlaError, match=r"soa cache: expected content \[slots, 512\] and rope \[slots, 64\]"):
        soa_to_rows(content, scale, rope[:, :32])
