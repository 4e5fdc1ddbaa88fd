"""Bad arguments to the CPU decode definitions (reference, emulation) and to the decode API's
configuration and switches: a one-line SnapmlaError naming the argument, never an IndexError
from a gather or a NaN read as "no key visible"."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.emulation import emulate_fp8_decode
from snapmla_cli.numerics.formats import SCALE_OFFSET
from snapmla_cli.numerics.problem import DecodeProblem, random_problem
from snapmla_cli.numerics.quant import QuantizedRows
from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata
from snapmla_cli.ops.decode_config import (
    DecodeConfig,
    checked_config,
    fp8_smem_bytes,
    heuristic_config,
)
from snapmla_cli.ops.finite import GPU_CHECKS, set_gpu_checks
from snapmla_cli.ops.graph_work_list import GraphWorkList
from snapmla_cli.ops.prep import quantize_q
from snapmla_cli.ops.schedule import SplitPolicy

SEQLENS = [100, 65, 0]


@pytest.fixture(scope="module")
def problem() -> DecodeProblem:
    return random_problem(SEQLENS, s_q=2, h_q=3, causal=True, seed=11)


def run_reference(problem: DecodeProblem, **changes: object) -> tuple[torch.Tensor, torch.Tensor]:
    args: dict[str, object] = {"q": problem.q, "kv_cache": problem.bf16_cache(),
                               "block_table": problem.layout.block_table,
                               "cache_seqlens": problem.layout.cache_seqlens,
                               "softmax_scale": problem.softmax_scale, "causal": problem.causal}
    args.update(changes)
    return decode_reference(**args)  # type: ignore[arg-type]


def run_emulation(problem: DecodeProblem, **changes: object) -> tuple[torch.Tensor, torch.Tensor]:
    args: dict[str, object] = {"q": problem.q_quantized(), "fp8_cache": problem.fp8_cache(),
                               "block_table": problem.layout.block_table,
                               "cache_seqlens": problem.layout.cache_seqlens,
                               "softmax_scale": problem.softmax_scale, "causal": problem.causal}
    args.update(changes)
    return emulate_fp8_decode(**args)  # type: ignore[arg-type]


def test_good_arguments_run_both_definitions_with_nan_poisoned_unused_rows(problem: DecodeProblem) -> None:
    """The fixtures' unused cache rows are NaN (bf16) / 0xFF (FP8) and the table's unused
    entries are -7: the checks must only look at what the requests read."""
    for run in (run_reference, run_emulation):
        out, lse = run(problem)
        assert torch.isfinite(out).all()
        assert torch.isinf(lse[2]).all() and (out[2] == 0).all()  # the empty request
        default_out, _ = run(problem, softmax_scale=None)  # SPEC's default scale
        assert torch.equal(out, default_out)
    four_d, _ = run_emulation(problem, fp8_cache=problem.fp8_cache().unsqueeze(2))
    assert torch.equal(four_d, run_emulation(problem)[0])


@pytest.mark.parametrize("run", [run_reference, run_emulation], ids=["reference", "emulation"])
@pytest.mark.parametrize(("change", "message"), [
    ({"cache_seqlens": torch.tensor([100, 65, 129], dtype=torch.int32)}, "cache_seqlens[2]: expected 0..128"),
    ({"cache_seqlens": torch.tensor([100, -1, 0], dtype=torch.int32)}, "cache_seqlens[1]: expected 0..128"),
    ({"cache_seqlens": torch.tensor([100, 65], dtype=torch.int32)}, "cache_seqlens: expected shape [batch]"),
    ({"cache_seqlens": torch.tensor([100.0, 65.0, 0.0])}, "cache_seqlens: expected an integer tensor"),
    ({"cache_seqlens": torch.tensor([True, True, False])}, "cache_seqlens: expected an integer tensor"),
    ({"block_table": torch.zeros(2, 2, dtype=torch.int32)}, "block_table: expected shape [batch, max_pages]"),
    ({"softmax_scale": math.nan}, "softmax_scale: expected a finite number"),
    ({"softmax_scale": "0.1"}, "softmax_scale: expected a number or None"),
    ({"softmax_scale": -0.04}, "softmax_scale: expected a number >= 0"),
    # finite, but infinite once the kernels take scale x log2(e) as a float32
    ({"softmax_scale": 3e38}, "softmax_scale: expected at most 2.358657e\\+38"),
    ({"causal": "false"}, "causal: expected True or False"),
])
def test_bad_arguments_name_the_argument(problem: DecodeProblem, run, change: dict, message: str) -> None:
    with pytest.raises(SnapmlaError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run(problem, **change)


@pytest.mark.parametrize("run", [run_reference, run_emulation], ids=["reference", "emulation"])
@pytest.mark.parametrize("entry", [-7, 10_000])
def test_a_page_outside_the_cache_is_refused(problem: DecodeProblem, run, entry: int) -> None:
    """A negative entry would otherwise read another page through Python's negative indexing."""
    table = problem.layout.block_table.clone()
    table[0, 1] = entry
    with pytest.raises(SnapmlaError, match=r"block_table\[0, 1\]: expected a block index"):
        run(problem, block_table=table)


@pytest.mark.parametrize("run", [run_reference, run_emulation], ids=["reference", "emulation"])
def test_a_cache_of_no_blocks_is_named_as_such(problem: DecodeProblem,
                                               run: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
    """With no blocks there is no index to expect: the message said "expected a block index in
    0..-1", which reads as a typo rather than as the empty cache it is."""
    cache = problem.bf16_cache() if run is run_reference else problem.fp8_cache()
    name = "kv_cache" if run is run_reference else "fp8_cache"
    with pytest.raises(SnapmlaError, match=r"^block_table\[0, 0\]: expected no page \(the cache has 0 blocks\) "
                                           r"\(the request's 100 tokens read it\), got \d+$"):
        run(problem, **{name: cache[:0]})

@pytest.mark.parametrize("bounds", [[0, 32, 100], [0, 64], [0, 64, 100, 128]])
def test_split_bounds_must_cover_the_request_in_whole_blocks(problem: DecodeProblem,
                                                             bounds: list[int]) -> None:
    """SPEC section 5 quantizes P per 64-token block from the split's start: a split starting
    mid-block would regroup P's blocks, and bounds ending short of n_i would drop keys silently."""
    expect = f"split_bounds {bounds}: expected 0 to 100 in increasing multiples of 64"
    with pytest.raises(SnapmlaError, match=re.escape(expect)):
        run_emulation(problem, split_bounds=[bounds, [0, 65], [0, 0]])
    run_emulation(problem, split_bounds=[[0, 64, 100], [0, 65], [0, 0]])  # the same, well formed


def test_a_nan_key_token_is_refused_not_read_as_no_keys(problem: DecodeProblem) -> None:
    """One 0xFF token among a request's keys: the emulation's block maxima would have marked the
    whole request as having no visible key (out 0, lse +inf)."""
    cache = problem.fp8_cache()
    page = int(problem.layout.block_table[0, 0])
    cache[page, 5] = 0xFF
    with pytest.raises(SnapmlaError, match="fp8_cache: request 0 reads non-finite values"):
        run_emulation(problem, fp8_cache=cache)
    bf16 = problem.bf16_cache()
    bf16[page, 5] = float("nan")
    with pytest.raises(SnapmlaError, match="kv_cache: request 0 reads non-finite values"):
        run_reference(problem, kv_cache=bf16)


def test_the_emulation_refuses_a_token_of_another_fp8_encoding(problem: DecodeProblem) -> None:
    """Nonzero pad bytes (a DeepSeek-V3.2 fp8_ds_mla token keeps scales there) are not SnapMLA's
    encoding: refused naming the request and token, not decoded."""
    cache = problem.fp8_cache()
    page = int(problem.layout.block_table[1, 0])
    cache[page, 3, 520] = 1
    with pytest.raises(SnapmlaError, match=r"fp8_cache: request 1 reads token 3 with nonzero pad bytes"):
        run_emulation(problem, fp8_cache=cache)


def test_non_finite_or_malformed_queries_are_refused(problem: DecodeProblem) -> None:
    q8 = problem.q_quantized()
    bad_scale = q8.scale.clone()
    bad_scale[0, 0, 0] = math.inf
    with pytest.raises(SnapmlaError, match="q.scale: expected finite values"):
        run_emulation(problem, q=type(q8)(q8.content, bad_scale, q8.rope))
    with pytest.raises(SnapmlaError, match="q: expected QuantizedRows"):
        run_emulation(problem, q=problem.q)
    with pytest.raises(SnapmlaError, match="q.rope: expected shape"):
        run_emulation(problem, q=type(q8)(q8.content, q8.scale, q8.rope[..., :32]))
    q = problem.q.clone()
    q[1, 0, 2, 7] = float("nan")
    with pytest.raises(SnapmlaError, match="q: expected finite values"):
        run_reference(problem, q=q)
    with pytest.raises(SnapmlaError, match="q: expected a float tensor"):
        run_reference(problem, q=problem.q[..., :512])
    with pytest.raises(SnapmlaError, match="split_bounds: expected one list of bounds per request"):
        run_emulation(problem, split_bounds=[[0, 100]])


@pytest.mark.parametrize("run", [run_reference, run_emulation], ids=["reference", "emulation"])
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_a_wide_unsigned_block_table_is_named(problem: DecodeProblem, run, dtype: torch.dtype) -> None:
    """torch has no CPU comparison for uint16..uint64: the page check raised its
    NotImplementedError ('"lt_cpu" not implemented for UInt32') instead of naming the table."""
    table = problem.layout.block_table.clamp(min=0).to(dtype)
    with pytest.raises(SnapmlaError, match=rf"^block_table: expected a signed integer tensor .*got {str(dtype)[6:]}$"):
        run(problem, block_table=table)


def test_the_float64_reference_takes_finite_values_beyond_float32(problem: DecodeProblem) -> None:
    """The finite check widened every part to float32, so finite float64 values above 3.4e38
    were refused as 'NaN or inf': the very inputs the reference's overflow error sends to float64."""
    big = 1e40
    out, lse = run_reference(problem, q=problem.q.double() * big, softmax_scale=problem.softmax_scale / big)
    want_out, want_lse = run_reference(problem, q=problem.q.double())
    assert torch.allclose(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.allclose(lse[:2], want_lse[:2], rtol=1e-12)
    kv = problem.bf16_cache().double() * big
    run_reference(problem, q=problem.q.double(), kv_cache=kv, softmax_scale=problem.softmax_scale / big)


def test_decode_fp8_names_a_non_finite_host_query(problem: DecodeProblem) -> None:
    """decode_bf16 names a NaN in a host Q before the missing GPU; decode_fp8 said only 'expected a
    CUDA tensor' for the same mistake in a hand-built QuantizedRows (README: host values are
    always checked)."""
    args = _decode_args(problem)
    q = args["q"]
    assert isinstance(q, QuantizedRows)
    scale = q.scale.clone()
    scale[1, 0, 2] = math.nan
    with pytest.raises(SnapmlaError, match=re.escape("q.scale: 1 of 18 values are NaN or inf")):
        decode_fp8(**{**args, "q": replace(q, scale=scale)})  # type: ignore[arg-type]
    content = q.content.clone()
    content.view(torch.uint8)[0, 1, 0, 3] = 0x7F  # an E4M3 NaN byte
    with pytest.raises(SnapmlaError, match=re.escape("q.content: 1 of")):
        decode_fp8(**{**args, "q": replace(q, content=content)})  # type: ignore[arg-type]


def test_explicit_configs_are_checked_where_they_are_given() -> None:
    lens = torch.tensor([300, 70], dtype=torch.int32)
    with pytest.raises(SnapmlaError, match="config: expected a DecodeConfig or None, got int"):
        get_mla_metadata(lens, 16, 1, config=5)  # type: ignore[arg-type]
    with pytest.raises(SnapmlaError, match=r"config: not a configuration the FP8 decode kernels accept: row_groups 0 not in \(1, 2, 4\) "):
        get_mla_metadata(lens, 16, 1, config=DecodeConfig(row_groups=0))
    with pytest.raises(SnapmlaError, match="config: expected a DecodeConfig or None"):
        GraphWorkList(2, 16, "cpu", config=5)  # type: ignore[arg-type]
    with pytest.raises(SnapmlaError, match="fp8: expected True or False"):
        get_mla_metadata(lens, 16, 1, fp8="no")  # type: ignore[arg-type]
    with pytest.raises(SnapmlaError, match="DecodeConfig.row_groups: expected an int"):
        DecodeConfig(row_groups="4")  # type: ignore[arg-type]
    for field, value in (("num_sms", 0), ("ctas_per_sm", -2), ("waves", 1.5), ("balanced", 1)):
        with pytest.raises(SnapmlaError, match=f"SplitPolicy.{field}: expected"):
            SplitPolicy(**{field: value})  # type: ignore[arg-type]
    good = heuristic_config(16)
    assert checked_config(good, True) is good and checked_config(None, False) is None
    with pytest.raises(SnapmlaError, match="BF16 decode kernels"):
        checked_config(good, False)  # an FP8 wgmma configuration for the BF16 kernels
    _, splits = get_mla_metadata(lens, 16, 1, config=good)
    assert int(splits[-1]) >= 2


def test_fields_a_kernel_does_not_have_are_refused() -> None:
    """Token groups (``kv_split``) belong to the FP8 mma.sync kernel only: the wgmma kernel of
    either format would be built with a launch size its layout does not have."""
    fp8_wgmma = heuristic_config(16)
    assert fp8_wgmma.wgmma and checked_config(fp8_wgmma, True) is fp8_wgmma
    with pytest.raises(SnapmlaError, match="FP8 decode kernels accept"):
        checked_config(replace(fp8_wgmma, kv_split=2), True)
    for bf16 in (heuristic_config(64, False), heuristic_config(16, False, 2)):  # wgmma, mma.sync
        assert checked_config(bf16, False) is bf16
        with pytest.raises(SnapmlaError, match="BF16 decode kernels accept"):
            checked_config(replace(bf16, kv_split=2), False)
    with pytest.raises(SnapmlaError, match="BF16 decode kernels accept"):  # 8-token tiles: not a kernel's
        checked_config(replace(heuristic_config(16, False, 2), block_n=8), False)
    with pytest.raises(SnapmlaError, match="BF16 decode kernels accept"):  # two 64-row tiles per SM do not fit
        checked_config(replace(heuristic_config(64, False), min_ctas_per_sm=2), False)
    # 17-32 rows: the RoPE ring runs one item per CTA, so the heuristic is the split plan, not an
    # automatic balance left to the planner
    ring = heuristic_config(32)
    assert ring.rope_ring and not ring.split.auto_balance and not ring.split.balanced
    assert heuristic_config(64).split.auto_balance


def test_the_mma_sync_fp8_shared_memory_matches_the_kernels_formula() -> None:
    """The host sizes the mma.sync FP8 kernel's dynamic shared memory (the kernel does not check
    it, unlike the wgmma one): kSmemBytes of kernels/decode_fp8.cu, worked out by hand for the
    64-row heuristic (4 row groups, 1 token group, 2 stages): Q 64 x (528 + 144) = 43,008, pages
    2 x 41,984 = 83,968, exchange 2 x 8 warps x 8 tiles x 32 x 16 = 65,536, reduce 1 x 4 x 16 x 8
    = 512, barriers 2 x 8 = 16."""
    cfg = heuristic_config(64, True, 2)
    assert (cfg.row_groups, cfg.kv_split, cfg.stages) == (4, 1, 2)
    assert fp8_smem_bytes(cfg) == 43008 + 83968 + 65536 + 512 + 16


def test_num_heads_k_message_shows_what_was_passed() -> None:
    with pytest.raises(SnapmlaError, match=r"num_heads_k: expected 1 .* got '1'"):
        get_mla_metadata(torch.tensor([10], dtype=torch.int32), 16, "1")  # type: ignore[arg-type]


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


@pytest.mark.parametrize("run", [run_reference, run_emulation], ids=["reference", "emulation"])
@pytest.mark.parametrize("name", ["block_table", "cache_seqlens", "cache"])
def test_tensors_without_data_are_refused(problem: DecodeProblem, run, name: str) -> None:
    """A 'meta' tensor has no values: named, not a NotImplementedError from a copy."""
    if name == "cache":
        name, value = ("kv_cache", problem.bf16_cache()) if run is run_reference else ("fp8_cache", problem.fp8_cache())
    else:
        value = getattr(problem.layout, name)
    with pytest.raises(SnapmlaError, match=f"{name}: expected a CPU or CUDA tensor, got device meta"):
        run(problem, **{name: _meta(value)})


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_queries_without_data_or_nested_are_refused(problem: DecodeProblem) -> None:
    with pytest.raises(SnapmlaError, match="q: expected a CPU or CUDA tensor, got device meta"):
        run_reference(problem, q=_meta(problem.q))
    nested = torch.nested.nested_tensor([torch.randn(3, 576), torch.randn(2, 576)])
    with pytest.raises(SnapmlaError, match="q: expected a regular"):
        run_reference(problem, q=nested)
    q = problem.q_quantized()
    meta_q = QuantizedRows(_meta(q.content), q.scale, q.rope)
    with pytest.raises(SnapmlaError, match="q.content: expected a CPU or CUDA tensor, got device meta"):
        run_emulation(problem, q=meta_q)
    with pytest.raises(SnapmlaError, match="q: expected a regular"):
        quantize_q(nested)
    with pytest.raises(SnapmlaError, match="cache_seqlens: expected a CPU or CUDA tensor, got device meta"):
        get_mla_metadata(_meta(problem.layout.cache_seqlens), 16, 1)


def test_work_list_and_metadata_devices_and_bounds() -> None:
    with pytest.raises(SnapmlaError, match="device: expected 'cpu' or a CUDA device"):
        GraphWorkList(2, 16, "meta")
    with pytest.raises(SnapmlaError, match="device: expected 'cpu' or a CUDA device"):
        get_mla_metadata(torch.tensor([10], dtype=torch.int32), 16, 1, device="meta")
    with pytest.raises(SnapmlaError, match="max_context: expected .* int32 lengths"):
        GraphWorkList(2, 16, "cpu", max_context=2**31)
    assert GraphWorkList(2, 16, "cpu", max_context=2**31 - 1).max_context == 2**31 - 1


def test_unhashable_scalars_are_named_not_a_type_error() -> None:
    """The decode calls look their launch plan up by a key holding softmax_scale and causal: a
    list there must reach the argument checks (on a machine without a GPU, the device one)."""
    q = quantize_q(torch.randn(1, 1, 16, 576))
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    meta, splits = get_mla_metadata(lens, 16, 1)
    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    for change in ({"softmax_scale": [0.1]}, {"causal": [True]}):
        # without a GPU the device check speaks first; with one, the argument's own check
        with pytest.raises(SnapmlaError, match=r"^(q\.content: expected a CUDA tensor|softmax_scale: expected a "
                                               r"number or None|causal: expected True or False)"):
            decode_fp8(q, cache, table, lens, meta, splits, **change)


def test_quantize_q_leaves_autograd_alone() -> None:
    q = torch.randn(1, 1, 4, 576, requires_grad=True)
    rows = quantize_q(q)
    assert not any(t.requires_grad for t in (rows.content, rows.scale, rows.rope))



@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_key_scale_that_is_not_positive_is_refused(problem: DecodeProblem, value: float) -> None:
    """SPEC section 3's scales are at least 2^-32: a zero or negative one is a corrupt cache that
    would decode to plausible numbers, as the query side already refuses."""
    cache = problem.fp8_cache()
    page = int(problem.layout.block_table[1, 0])
    cache[page, 3, SCALE_OFFSET:SCALE_OFFSET + 4] = torch.tensor([value], dtype=torch.float32).view(torch.uint8)
    with pytest.raises(SnapmlaError, match=f"fp8_cache: request 1 reads token 3 with scale {value}"):
        run_emulation(problem, fp8_cache=cache)


def test_no_query_rows_give_empty_outputs_in_both_definitions(problem: DecodeProblem) -> None:
    """s_q * h_q = 0: empty results (as the reference always gave), not a reshape error."""
    empty = problem.q[:, :, :0]
    out_ref, lse_ref = run_reference(problem, q=empty)
    out, lse = run_emulation(problem, q=quantize_q(empty))
    assert out.shape == out_ref.shape == (3, 2, 0, 512) and lse.shape == lse_ref.shape == (3, 0, 2)


@pytest.mark.parametrize("bounds", [[[0, 64.0, 100], [0, 65], [0, 0]], [None, [0, 65], [0, 0]], "0,100"])
def test_split_bounds_that_are_not_integer_lists_are_named(problem: DecodeProblem, bounds: object) -> None:
    with pytest.raises(SnapmlaError, match="^split_bounds"):
        run_emulation(problem, split_bounds=bounds)


@pytest.mark.parametrize("dtype", [torch.int32, "float64", None, torch.float16, torch.bfloat16])
def test_the_reference_dtype_must_be_float64_or_float32(problem: DecodeProblem, dtype: object) -> None:
    """float16 once passed and returned inf / NaN silently (its logits overflow)."""
    with pytest.raises(SnapmlaError, match="^dtype: expected torch.float64 or torch.float32 for the reference"):
        run_reference(problem, dtype=dtype)


def _decode_args(problem: DecodeProblem) -> dict[str, object]:
    lens = problem.layout.cache_seqlens
    meta, splits = get_mla_metadata(lens, 2 * 3, 1)
    return {"q": problem.q_quantized(), "k_cache": problem.fp8_cache(), "block_table": problem.layout.block_table,
            "cache_seqlens": lens, "tile_scheduler_metadata": meta, "num_splits": splits}


@pytest.mark.parametrize("name", ["k_cache", "block_table", "cache_seqlens", "q.scale", "q.content"])
def test_decode_names_a_sparse_argument(problem: DecodeProblem, name: str) -> None:
    """A sparse tensor has no storage: torch's RuntimeError at its first data pointer becomes a
    line naming the argument (checked only after that error, so valid calls pay nothing)."""
    args = _decode_args(problem)
    if name.startswith("q."):
        q = args["q"]
        assert isinstance(q, QuantizedRows)
        part = name.removeprefix("q.")
        sparse = getattr(q, part).view(torch.uint8).to_sparse() if part == "content" else getattr(q, part).to_sparse()
        args["q"] = replace(q, **{part: sparse})
    else:
        value = args[name]
        assert isinstance(value, torch.Tensor)
        args[name] = value.to_sparse()
    with pytest.raises(SnapmlaError, match=re.escape(f"{name}: expected a regular (strided) tensor, got layout sparse")):
        decode_fp8(**args)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_decode_names_a_nested_query(problem: DecodeProblem) -> None:
    args = _decode_args(problem)
    nested = torch.nested.nested_tensor([torch.randn(3, 576), torch.randn(2, 576)]).to(torch.bfloat16)
    args["q"] = nested
    args["k_cache"] = problem.bf16_cache()
    with pytest.raises(SnapmlaError, match=re.escape("q: expected a regular (strided) tensor, got a nested tensor")):
        decode_bf16(**args)  # type: ignore[arg-type]


def test_the_checks_switch_names_a_misshapen_q_before_the_table(problem: DecodeProblem) -> None:
    """With the switch on, the table check reads q's batch: it must come after q's own shape
    check, or a 3-d q is reported as a wrong block table (and a 0-d scale as an IndexError)."""
    args = _decode_args(problem)
    q = args["q"]
    assert isinstance(q, QuantizedRows)
    was = GPU_CHECKS.on
    set_gpu_checks(True)
    try:
        with pytest.raises(SnapmlaError, match=re.escape("q.scale: expected [b, s_q, h_q], got []")):
            decode_fp8(**{**args, "q": replace(q, scale=q.scale[0, 0, 0])})  # type: ignore[arg-type]
        with pytest.raises(SnapmlaError, match=re.escape("q: expected [b, s_q, h_q, 576], got [2, 3, 576]")):
            decode_bf16(**{**args, "q": problem.q[0], "k_cache": problem.bf16_cache()})  # type: ignore[arg-type]
    finally:
        set_gpu_checks(was)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: get_mla_metadata(torch.tensor([5, 9]), 64, 1), "cache_seqlens: expected int32 [b], got int64 (2,)"),
    (lambda: quantize_q(torch.zeros(1, 1, 2, 576, dtype=torch.float64)),
     "q: expected dtype bfloat16 or float16 or float32, got float64"),
    (lambda: decode_reference(torch.randn(1, 1, 2, 576), torch.zeros(1, 64, 576, dtype=torch.int16),
                              torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 0.1, True),
     "kv_cache: expected dtype bfloat16 or float16 or float32 or float64, got int16"),
])
def test_tensor_dtypes_are_named_alike_in_every_message(call: object, message: str) -> None:
    """A tensor's dtype reads `int32`, never `torch.int32`, wherever it is expected or found
    (the decode arguments said "expected torch.int32, got torch.int64", the prep "int64")."""
    assert callable(call)
    with pytest.raises(SnapmlaError) as raised:
        call()
    assert str(raised.value) == message and "torch." not in str(raised.value)
