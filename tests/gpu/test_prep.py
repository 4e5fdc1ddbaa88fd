"""The CUDA prep kernels produce exactly the reference bytes (SPEC section 3).

Q-quant and K-append must equal ``quantize_rows`` / ``pack_tokens`` byte for byte, on data that
exercises every rounding corner: per-row scales over ten decades, RoPE up to 1e3 (and beyond, to
overflow), all-zero rows, rows whose maximum lands exactly on 448, E4M3 subnormals and ties,
float32/bf16 subnormals, negative zeros. Fetch-dequant must equal
``dequantize(float32).to(bfloat16)``. Writes never leave their slots (0xFF-poisoned caches),
and a captured CUDA graph replays to the same bytes.
"""

from __future__ import annotations

import pytest
import torch

from snapmla_cli.cache.layout import (
    nan_token_bytes,
    quantize_tokens,
    random_paged_layout,
    scatter_to_pages,
    unpack_tokens,
)
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.formats import D_QK, FP8_DTYPE, FP8_TOKEN_BYTES, PAGE_SIZE
from snapmla_cli.numerics.quant import QuantizedRows, quantize_rows
from snapmla_cli.ops.prep import (
    append_kv,
    fetch_dequant,
    fetch_dequant_slots,
    fetch_dequant_soa,
    quantize_q,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"


# ---------------------------------------------------------------- data


def wide_rows(n: int, seed: int = 0) -> torch.Tensor:
    """bf16 ``[n, 576]``: random rows with per-row content scale 1e-6..1e4 and RoPE up to 1e3,
    the first rows replaced by hand-made corner cases (as many as fit)."""
    g = torch.Generator().manual_seed(seed)
    content_scale = 10.0 ** (torch.rand(n, 1, generator=g) * 10 - 6)
    rope_scale = 10.0 ** (torch.rand(n, 1, generator=g) * 6 - 3)
    x = torch.cat(
        [
            torch.randn(n, 512, generator=g) * content_scale,
            torch.randn(n, 64, generator=g) * rope_scale,
        ],
        dim=1,
    )
    special = corner_rows(g)
    k = min(n, special.shape[0])
    x[:k] = special[:k]
    return x.to(torch.bfloat16)


def corner_rows(g: torch.Generator) -> torch.Tensor:
    rows = []
    rows.append(torch.zeros(576))  # all zero: s = 2^-32, everything 0
    r = torch.zeros(576)
    r[:512] = -0.0
    r[512:] = -0.0
    rows.append(r)  # negative zeros: E4M3 0x80, bf16 0x8000
    for k in (-20, -3, 0, 5, 12):  # amax = 448 * 2^k: s = 2^k exactly, max element -> 448
        # every other element stays below the maximum
        r = torch.randn(576, generator=g).clamp(-1, 1) * 400.0 * 2.0**k
        r[7] = 448.0 * 2.0**k
        r[300] = -448.0 * 2.0**k
        rows.append(r)
    for amax in (3.0, 1e-3, 7.77e3, 123.456):  # s = RN(amax/448) != amax/448: saturation at 448
        r = torch.randn(576, generator=g).clamp(-1, 1) * amax / 2
        r[11] = amax
        r[511] = -amax
        rows.append(r)
    r = torch.zeros(576)  # s = 1: E4M3 subnormals 2^-9.., ties at 2^-10, 3*2^-10, values < 2^-10
    r[0] = 448.0
    vals = [
        2.0**-9,
        2.0**-10,
        3 * 2.0**-10,
        5 * 2.0**-11,
        2.0**-11,
        2.0**-7,
        0.015625 * 1.0625,
        17.0,
        464.0 / 2,
    ]
    r[1 : 1 + len(vals)] = torch.tensor(vals)
    r[20 : 20 + len(vals)] = -torch.tensor(vals)
    r[512:] = torch.tensor([2.0**-130, -(2.0**-133), 1e-38, 3.0, -7.5] * 12 + [0.0] * 4)
    rows.append(r)
    r = torch.full((576,), 1e-39)  # bf16/float32 subnormal content: s = floor, content -> 0
    r[512:] = torch.tensor([1e-39, -2e-39, 5e-40, 1e-30] * 16)
    rows.append(r)
    r = torch.zeros(576)  # tiny content, huge RoPE: r / 2^-32 overflows float32 -> inf
    r[3] = 1e-30
    r[512:520] = torch.tensor([3e38, -3e38, 1e30, 1e28, 1.0, -1.0, 6e37, 1e-20])
    rows.append(r)
    # large content with subnormal RoPE quotients (r / s < 2^-126)
    r = torch.randn(576, generator=g) * 1e4
    r[512:] = torch.tensor([2.0**-126, 2.0**-133, -(2.0**-127), 1e-38] * 16)
    rows.append(r)
    return torch.stack(rows)


def reference_append(kv: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
    """The reference of ``append_kv``: SPEC section 3's bytes of each row written to its slot,
    padding and out-of-range slots skipped. Not the API's CPU path, which refuses the corner row
    whose pre-scaled RoPE overflows (``check_quantizable``); the kernels, unchecked, must still
    write that row's bytes exactly."""
    flat = cache.view(-1, FP8_TOKEN_BYTES)
    valid = (slots >= 0) & (slots < flat.shape[0])
    flat[slots[valid].long()] = quantize_tokens(kv[valid])


def poisoned_cache(blocks: int) -> torch.Tensor:
    return nan_token_bytes().expand(blocks, PAGE_SIZE, FP8_TOKEN_BYTES).clone()


def assert_bytes_equal(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    got = got.detach().cpu().contiguous().view(torch.uint8).reshape(-1)
    ref = ref.detach().cpu().contiguous().view(torch.uint8).reshape(-1)
    assert got.shape == ref.shape, f"{name}: {got.shape} vs {ref.shape}"
    diff = (got != ref).nonzero()
    if diff.numel():
        i = int(diff[0])
        pytest.fail(
            f"{name}: {diff.numel()} bytes differ; first at byte {i}: "
            f"got 0x{int(got[i]):02x}, expected 0x{int(ref[i]):02x}"
        )


def ref_dequant(raw: torch.Tensor) -> torch.Tensor:
    return unpack_tokens(raw).dequantize(torch.float32).to(torch.bfloat16)


# ---------------------------------------------------------------- Q-quant


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 2, 16), (64, 1, 128), (7, 4, 33)])
def test_quantize_q_bytes(shape: tuple[int, int, int]) -> None:
    n = shape[0] * shape[1] * shape[2]
    q = wide_rows(n, seed=n).view(*shape, D_QK)
    got = quantize_q(q.to(DEV))
    torch.cuda.synchronize()
    ref = quantize_rows(q)
    assert got.content.dtype == FP8_DTYPE and got.content.shape == (*shape, 512)
    assert got.scale.shape == shape and got.rope.shape == (*shape, 64)
    assert_bytes_equal("content", got.content, ref.content)
    assert_bytes_equal("scale", got.scale, ref.scale)
    assert_bytes_equal("rope", got.rope, ref.rope)


def test_quantize_q_64k_rows() -> None:
    q = wide_rows(65_536 + 3, seed=11)
    got = quantize_q(q.to(DEV))
    ref = quantize_rows(q)
    assert_bytes_equal("content", got.content, ref.content)
    assert_bytes_equal("scale", got.scale, ref.scale)
    assert_bytes_equal("rope", got.rope, ref.rope)


def test_quantize_q_empty_and_checks() -> None:
    out = quantize_q(torch.zeros(0, 4, D_QK, dtype=torch.bfloat16, device=DEV))
    assert out.content.shape == (0, 4, 512)
    with pytest.raises(SnapmlaError, match="q: expected dtype bfloat16"):
        quantize_q(torch.zeros(2, D_QK, device=DEV))
    unaligned = torch.zeros(1 + 2 * D_QK, dtype=torch.bfloat16, device=DEV)[1:].view(2, D_QK)
    with pytest.raises(SnapmlaError, match="16-byte boundary"):
        quantize_q(unaligned)


def test_quantize_q_out_and_cached_plan_checks() -> None:
    q = wide_rows(2 * 3 * 16, seed=4).view(2, 3, 16, D_QK)
    ref = quantize_rows(q)
    q_dev = q.to(DEV)
    first = quantize_q(q_dev)  # builds the shape's plan
    out = QuantizedRows(
        content=torch.full((2, 3, 16, 512), 0x55, dtype=torch.uint8, device=DEV).view(FP8_DTYPE),
        scale=torch.full((2, 3, 16), -1.0, device=DEV),
        rope=torch.full((2, 3, 16, 64), 7.0, dtype=torch.bfloat16, device=DEV),
    )
    assert quantize_q(q_dev, out=out) is out
    for got in (first, out):
        assert_bytes_equal("content", got.content, ref.content)
        assert_bytes_equal("scale", got.scale, ref.scale)
        assert_bytes_equal("rope", got.rope, ref.rope)
    # same shape again (cached plan): the per-call checks still run
    flat = torch.zeros(1 + q.numel(), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(SnapmlaError, match="16-byte boundary"):
        quantize_q(flat[1:].view(q.shape))
    rope_buf = torch.empty(2 * 3 * 16 * 64 + 1, dtype=torch.bfloat16, device=DEV)
    bad = QuantizedRows(out.content, out.scale, rope_buf[1:].view(2, 3, 16, 64))
    with pytest.raises(SnapmlaError, match="out.rope: data must start on a 4-byte"):
        quantize_q(q_dev, out=bad)
    with pytest.raises(SnapmlaError, match=r"out.scale: expected shape \[2, 3, 16\]"):
        quantize_q(q_dev, out=QuantizedRows(out.content, out.scale[:1], out.rope))


# ---------------------------------------------------------------- K-append


@pytest.mark.parametrize("n", [1, 100, 100_003])
def test_append_kv_bytes_and_untouched_slots(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    kv = wide_rows(n, seed=n + 1)
    blocks = (n + 2 * PAGE_SIZE - 1) // PAGE_SIZE + 2
    num_slots = blocks * PAGE_SIZE
    slots = torch.randperm(num_slots, generator=g)[:n].to(torch.int32)
    if n > 1:  # padding, past the end, below -1
        slots[:: max(2, n // 50)] = -1
        slots[1] = num_slots
        slots[-1] = -12345
    if n > 10:
        slots[5] = num_slots + 10_000
    cache_cpu = poisoned_cache(blocks)
    reference_append(kv, slots, cache_cpu)
    cache_gpu = poisoned_cache(blocks).to(DEV)
    append_kv(kv.to(DEV), slots.to(DEV), cache_gpu)
    torch.cuda.synchronize()
    assert_bytes_equal("cache", cache_gpu, cache_cpu)  # written tokens and the 0xFF elsewhere
    valid = (slots >= 0) & (slots < num_slots)
    flat = cache_gpu.view(-1, FP8_TOKEN_BYTES).cpu()
    assert_bytes_equal("tokens", flat[slots[valid].long()], quantize_tokens(kv[valid]))


@pytest.mark.parametrize("form", ["fp8-4d", "int64-slots"])
def test_append_kv_cache_forms(form: str) -> None:
    kv = wide_rows(70, seed=3)
    slots = torch.arange(70, dtype=torch.int32) * 2
    cache_cpu = poisoned_cache(4)
    reference_append(kv, slots, cache_cpu)
    cache_gpu = poisoned_cache(4).to(DEV)
    if form == "fp8-4d":
        target = cache_gpu.view(FP8_DTYPE).view(4, PAGE_SIZE, 1, FP8_TOKEN_BYTES)
        append_kv(kv.to(DEV), slots.to(DEV), target)
    else:
        append_kv(kv.to(DEV), slots.to(DEV, torch.int64), cache_gpu)
    assert_bytes_equal("cache", cache_gpu, cache_cpu)


def test_append_kv_neighbours_in_separate_calls() -> None:
    """Odd slots start 16 bytes into a 32-byte sector that the previous (even) slot ends in: the
    two halves of that sector are written by different calls and must both survive."""
    blocks = 3
    n = blocks * PAGE_SIZE
    kv = wide_rows(n, seed=12)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    even, odd = order[order % 2 == 0], order[order % 2 == 1]
    ref = poisoned_cache(blocks)
    got = poisoned_cache(blocks).to(DEV)
    for part in (even, odd[: len(odd) // 2], odd[len(odd) // 2 :]):
        rows = kv[part.long()]
        reference_append(rows, part, ref)
        append_kv(rows.to(DEV), part.to(DEV), got)
    assert_bytes_equal("cache", got, ref)


def test_append_kv_device_mismatch() -> None:
    kv = wide_rows(2).to(DEV)
    with pytest.raises(SnapmlaError, match="k_cache: expected a tensor on cuda"):
        append_kv(kv, torch.zeros(2, dtype=torch.int32, device=DEV), poisoned_cache(1))


# ---------------------------------------------------------------- fetch-dequant


def paged_problem(seqlens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layout = random_paged_layout(seqlens, generator=g)
    tokens = [quantize_tokens(wide_rows(n, seed + i)) for i, n in enumerate(seqlens)]
    cache = scatter_to_pages(tokens, layout, nan_token_bytes())
    return layout, tokens, cache


@pytest.mark.parametrize("seqlens", [[1], [70, 0, 1, 128, 5], [4096, 17, 999]])
def test_fetch_dequant_bytes(seqlens: list[int]) -> None:
    layout, tokens, cache = paged_problem(seqlens, seed=len(seqlens))
    ref = torch.cat([ref_dequant(t) for t in tokens])
    args = (cache.to(DEV), layout.block_table.to(DEV), layout.cache_seqlens.to(DEV))
    out = fetch_dequant(*args)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert_bytes_equal("dequant", out, ref)
    padded = fetch_dequant(*args, total_tokens=ref.shape[0] + 70)
    assert_bytes_equal("padded", padded[: ref.shape[0]], ref)
    assert bool((padded[ref.shape[0] :] == 0).all())
    cpu = fetch_dequant(
        cache, layout.block_table, layout.cache_seqlens, total_tokens=ref.shape[0] + 70
    )
    assert_bytes_equal("gpu vs cpu path", padded, cpu)
    # SPEC section 3: the same tokens as SGLang-FluentLLM's structure of arrays, slot for slot
    flat = unpack_tokens(cache.reshape(-1, FP8_TOKEN_BYTES).to(DEV))
    soa = (flat.content.view(torch.uint8), flat.scale, flat.rope)
    assert_bytes_equal("soa through fetch_dequant", fetch_dequant(soa, *args[1:]), ref)


def test_fetch_dequant_garbage_table_entries() -> None:
    """Unchecked (the switch off), a page outside the cache reads as zeros, never out of bounds;
    the CPU path refuses it, so its reference is the good table's rows."""
    layout, _, cache = paged_problem([70, 3], seed=9)
    table = layout.block_table.clone()
    table[0, 1] = cache.shape[0] + 1
    out = fetch_dequant(cache.to(DEV), table.to(DEV), layout.cache_seqlens.to(DEV))
    good = fetch_dequant(cache, layout.block_table, layout.cache_seqlens)
    assert_bytes_equal("rows before the bad page", out[:64], good[:64])
    assert_bytes_equal("the other request", out[70:], good[70:])
    assert bool((out[64:70] == 0).all())


def test_fetch_dequant_slots_bytes_large() -> None:
    n_tok = 100_003
    kv = wide_rows(n_tok, seed=21)
    blocks = (n_tok + PAGE_SIZE - 1) // PAGE_SIZE
    cache = poisoned_cache(blocks)
    cache.view(-1, FP8_TOKEN_BYTES)[:n_tok] = quantize_tokens(kv)
    g = torch.Generator().manual_seed(1)
    slots = torch.randint(0, n_tok, (n_tok,), generator=g, dtype=torch.int32)
    slots[::97] = -1
    slots[1] = blocks * PAGE_SIZE
    out = fetch_dequant_slots(cache.to(DEV), slots.to(DEV))
    assert_bytes_equal("slots", out, fetch_dequant_slots(cache, slots))
    one_slot = torch.tensor([12_345], dtype=torch.int32)
    one = fetch_dequant_slots(cache.to(DEV), one_slot.to(DEV))
    assert_bytes_equal("n=1", one, ref_dequant(cache.view(-1, FP8_TOKEN_BYTES)[12_345:12_346]))


def test_fetch_dequant_int64_slots() -> None:
    kv = wide_rows(300, seed=22)
    cache = poisoned_cache(5)
    cache.view(-1, FP8_TOKEN_BYTES)[:300] = quantize_tokens(kv)
    slots = torch.tensor([0, 299, -1, 5 * PAGE_SIZE, 2**40, 17, 17], dtype=torch.int64)
    ok = torch.tensor([0, 299, 17, 17])
    out = fetch_dequant_slots(cache.to(DEV), slots.to(DEV)).cpu()
    assert_bytes_equal("int64 slots", out[[0, 1, 5, 6]], ref_dequant(cache.view(-1, 656)[ok]))
    assert bool((out[2:5] == 0).all())
    rows = quantize_rows(kv)
    content = rows.content.view(torch.uint8).contiguous()
    soa = fetch_dequant_soa(
        content.to(DEV), rows.scale.to(DEV), rows.rope.to(DEV), slots.clamp(max=400).to(DEV)
    )
    ref = fetch_dequant_soa(content, rows.scale, rows.rope, slots.clamp(max=400))
    assert_bytes_equal("soa int64 slots", soa, ref)


def test_fetch_dequant_many_requests() -> None:
    """1500 requests (the request search takes three 32-way steps), many of them empty."""
    g = torch.Generator().manual_seed(7)
    seqlens = torch.randint(0, 6, (1500,), generator=g)
    seqlens[torch.rand(1500, generator=g) < 0.3] = 0
    layout = random_paged_layout(seqlens.tolist(), generator=g)
    n = int(seqlens.sum())
    tokens = quantize_tokens(wide_rows(n, seed=8))
    per_req = list(torch.split(tokens, seqlens.tolist()))
    cache = scatter_to_pages(per_req, layout, nan_token_bytes())
    args = (cache.to(DEV), layout.block_table.to(DEV), layout.cache_seqlens.to(DEV))
    out = fetch_dequant(*args, total_tokens=n + 5)
    assert_bytes_equal("many requests", out[:n], ref_dequant(tokens))
    assert bool((out[n:] == 0).all())


def test_fetch_dequant_soa_bytes() -> None:
    rows = quantize_rows(wide_rows(5000, seed=5))
    content = rows.content.view(torch.uint8).contiguous()
    g = torch.Generator().manual_seed(2)
    slots = torch.randint(-3, 5003, (7000,), generator=g, dtype=torch.int32)
    out = fetch_dequant_soa(content.to(DEV), rows.scale.to(DEV), rows.rope.to(DEV), slots.to(DEV))
    ref = fetch_dequant_soa(content, rows.scale, rows.rope, slots)
    assert_bytes_equal("soa", out, ref)
    valid = (slots >= 0) & (slots < 5000)
    full = rows.dequantize(torch.float32).to(torch.bfloat16)
    assert_bytes_equal("soa vs dequantize", out.cpu()[valid], full[slots[valid].long()])


# ---------------------------------------------------------------- CUDA graphs


def test_cuda_graph_capture_and_replay() -> None:
    n, blocks, rows = 64, 4, 64 * 16
    kv = torch.empty(n, D_QK, dtype=torch.bfloat16, device=DEV)
    q = torch.empty(rows // 16, 1, 16, D_QK, dtype=torch.bfloat16, device=DEV)
    slots = torch.empty(n, dtype=torch.int32, device=DEV)
    cache = poisoned_cache(blocks).to(DEV)
    table = torch.arange(blocks, dtype=torch.int32, device=DEV).view(1, blocks)
    seqlens = torch.tensor([n], dtype=torch.int32, device=DEV)
    kv.copy_(wide_rows(n, seed=1).to(DEV))
    q.copy_(wide_rows(rows, seed=2).view(q.shape).to(DEV))
    slots.copy_(torch.arange(n, dtype=torch.int32) * 3)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and loads the kernels outside capture
        append_kv(kv, slots, cache)
        quantize_q(q)
        fetch_dequant(cache, table, seqlens, total_tokens=n * 3)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    q_static = quantize_q(q)  # preallocated Q-quant buffers, written in place by the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_kv(kv, slots, cache)
        q_out = quantize_q(q)
        quantize_q(q, out=q_static)
        deq = fetch_dequant(cache, table, seqlens, total_tokens=n * 3)

    new_kv, new_q = wide_rows(n, seed=7), wide_rows(rows, seed=8).view(q.shape)
    new_slots = torch.randperm(blocks * PAGE_SIZE, generator=torch.Generator().manual_seed(3))[
        :n
    ].to(torch.int32)
    new_slots[0] = -1
    kv.copy_(new_kv.to(DEV))
    q.copy_(new_q.to(DEV))
    slots.copy_(new_slots.to(DEV))
    cache.copy_(poisoned_cache(blocks).to(DEV))
    graph.replay()
    torch.cuda.synchronize()

    ref_cache = poisoned_cache(blocks)
    reference_append(new_kv, new_slots, ref_cache)
    assert_bytes_equal("graph cache", cache, ref_cache)
    ref_q = quantize_rows(new_q)
    assert_bytes_equal("graph q content", q_out.content, ref_q.content)
    assert_bytes_equal("graph q scale", q_out.scale, ref_q.scale)
    assert_bytes_equal("graph q rope", q_out.rope, ref_q.rope)
    assert_bytes_equal("graph q content (out=)", q_static.content, ref_q.content)
    assert_bytes_equal("graph q scale (out=)", q_static.scale, ref_q.scale)
    assert_bytes_equal("graph q rope (out=)", q_static.rope, ref_q.rope)
    # The fetch reads slots 0..n-1; those the replay did not write still hold 0xFF (NaN, whose
    # bf16 payload differs between torch and the GPU): compare written rows bit for bit.
    ref_deq = fetch_dequant(ref_cache, table.cpu(), seqlens.cpu(), total_tokens=n * 3)
    written = torch.zeros(n * 3, dtype=torch.bool)
    hit = new_slots[(new_slots >= 0) & (new_slots < n)].long()
    written[hit] = True
    written[n:] = True  # rows past the request: zeros on both paths
    assert_bytes_equal("graph dequant", deq.cpu()[written], ref_deq[written])
    assert bool(torch.isnan(deq.cpu()[~written].float()).all())

    graph.replay()  # replaying again over the same inputs gives the same bytes
    torch.cuda.synchronize()
    assert_bytes_equal("graph cache, second replay", cache, ref_cache)
