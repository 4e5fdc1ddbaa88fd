"""The decode calls on a machine without a GPU: a bad argument is named before the missing GPU
is, and a work list planned for other query rows than the call's is refused by name.

Why: every decode call on host tensors ends with "q: expected a CUDA tensor"; that check used to
come first, so a caller with a wrong shape, dtype, NaN or work list heard only about the GPU
(and fixed the device, to meet the real error on the GPU machine). FlashMLA requires its
metadata to match q, and snapmla's work list carries the rows it was planned for: a mismatch is
a caller's slip that used to run silently with a re-chosen configuration. Host tensors only;
the launches are never reached."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from snapmla_cli.errors import NoGpuError, SnapmlaError
from snapmla_cli.numerics.formats import D_QK, FP8_TOKEN_BYTES, PAGE_SIZE
from snapmla_cli.numerics.quant import QuantizedRows
from snapmla_cli.ops.decode import decode_bf16, decode_fp8, flash_mla_with_kvcache, get_mla_metadata
from snapmla_cli.ops.finite import GPU_CHECKS, set_gpu_checks
from snapmla_cli.ops.graph_work_list import GraphWorkList

B, S_Q, H_Q, PAGES = 2, 1, 16, 2
LENS = [100, 10]


def _lens() -> torch.Tensor:
    return torch.tensor(LENS, dtype=torch.int32)


def _q(s_q: int = S_Q, h_q: int = H_Q) -> torch.Tensor:
    return torch.randn(B, s_q, h_q, D_QK, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _q8(s_q: int = S_Q, h_q: int = H_Q) -> QuantizedRows:
    return QuantizedRows(torch.zeros(B, s_q, h_q, 512, dtype=torch.uint8), torch.ones(B, s_q, h_q),
                         torch.zeros(B, s_q, h_q, 64, dtype=torch.bfloat16))


def _args(fp8: bool) -> dict[str, object]:
    """A valid call's arguments but q, on the host, by keyword, for the FP8 or the BF16 cache."""
    meta, splits = get_mla_metadata(_lens(), S_Q * H_Q, 1, fp8=fp8)
    cache = (torch.zeros(B * PAGES, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8) if fp8
             else torch.zeros(B * PAGES, PAGE_SIZE, 1, D_QK, dtype=torch.bfloat16))
    return {"k_cache": cache, "block_table": torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES),
            "cache_seqlens": _lens(), "tile_scheduler_metadata": meta, "num_splits": splits}


def _call(api: str, change: Callable[[dict[str, object]], dict[str, object]]) -> None:
    """``api``'s call with valid host arguments, then ``change`` applied to them."""
    fp8 = api not in ("decode_bf16", "flash-bf16")
    args = {"q": _q8() if api == "decode_fp8" else _q(), **_args(fp8)}
    args = change(args)
    if api == "decode_fp8":
        decode_fp8(**args)  # type: ignore[arg-type]
    elif api == "decode_bf16":
        decode_bf16(**args)  # type: ignore[arg-type]
    else:
        flash_mla_with_kvcache(head_dim_v=512, **args)  # type: ignore[arg-type]


def _with(**changes: Callable[[object], object]) -> Callable[[dict[str, object]], dict[str, object]]:
    """A change of the named arguments, each the function's value of the valid one."""
    return lambda args: {**args, **{name: f(args[name]) for name, f in changes.items()}}


def _t(x: object) -> torch.Tensor:
    assert isinstance(x, torch.Tensor)
    return x


def _q8_with(**parts: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[object], QuantizedRows]:
    """A change of a QuantizedRows q: each named part the function's value of the valid one."""
    def change(q: object) -> QuantizedRows:
        assert isinstance(q, QuantizedRows)
        return replace(q, **{name: f(getattr(q, name)) for name, f in parts.items()})
    return change


def _nan(q: object) -> torch.Tensor:
    return torch.full_like(_t(q), float("nan"))


COMMON = [  # (change, the message's start): every call names these on the host
    (_with(block_table=lambda t: _t(t).float()), r"block_table: expected int32 \[2, max_blocks\], got float32"),
    (_with(block_table=lambda t: _t(t)[0]), r"block_table: expected int32 \[2, max_blocks\]"),
    (_with(cache_seqlens=lambda t: _t(t)[:1]), r"cache_seqlens: expected shape \[2\], got \[1\]"),
    (_with(cache_seqlens=lambda t: _t(t).long()), "cache_seqlens: expected int32, got int64"),
    (_with(tile_scheduler_metadata=lambda t: _t(t)[0]), r"tile_scheduler_metadata: expected shape \[\*, \*, 4\]"),
    (_with(num_splits=lambda t: _t(t)[:2]), r"num_splits: expected shape \[3\], got \[2\]"),
    # the scalars too (the launch plan, after the device check, was the first to read them)
    (lambda args: {**args, "softmax_scale": float("nan")}, "softmax_scale: expected a finite number, got nan"),
    (lambda args: {**args, "softmax_scale": 2.36e38}, r"softmax_scale: expected at most 2.358657e\+38"),
    (lambda args: {**args, "causal": "false"}, "causal: expected True or False, got 'false'"),
]
CASES = [
    *[(api, change, msg) for api in ("decode_fp8", "decode_bf16", "flash-fp8", "flash-bf16") for change, msg in COMMON],
    ("decode_fp8", _with(q=_q8_with(content=lambda t: t[..., :256])),
     r"q.content: expected shape \[2, 1, 16, 512\], got \[2, 1, 16, 256\]"),
    ("decode_fp8", _with(q=_q8_with(rope=lambda t: t.float())),
     "q.rope: expected bfloat16, got float32"),
    ("decode_fp8", _with(k_cache=lambda t: _t(t)[:, :, :600]), "k_cache: expected FP8 cache"),
    ("decode_bf16", _with(q=lambda t: _t(t)[..., :500]), r"q: expected shape \[2, 1, 16, 576\]"),
    ("decode_bf16", _with(q=_nan), "q: 18432 of 18432 values are NaN or inf"),
    ("decode_bf16", _with(k_cache=lambda t: _t(t)[:, :32]),
     r"k_cache: expected shape \[blocks, 64, 576\] or \[blocks, 64, 1, 576\], got \[\d+, 32, 1, 576\]"),
    # the 3-d form is named as passed (it was named as its 4-d view: [n, 64, 1, 512])
    ("decode_bf16", _with(k_cache=lambda t: _t(t)[:, :, 0, :512].contiguous()),
     r"k_cache: expected shape \[blocks, 64, 576\] or \[blocks, 64, 1, 576\], got \[\d+, 64, 512\]$"),
    ("flash-fp8", _with(q=lambda t: _t(t).float()), r"q: expected bfloat16 \[b, s_q, h_q, 576\], got float32"),
    ("flash-fp8", _with(k_cache=lambda t: _t(t)[:, :32]), "k_cache: expected FP8 cache"),
    # the fused path checks q's layout itself (its quantize_q, which did, runs after the devices)
    ("flash-fp8", _with(q=lambda t: torch.cat([_t(t), _t(t)], -1)[..., :D_QK]), "q: must be contiguous$"),
    *[("flash-fp8", _with(**{name: lambda t: _t(t).to_sparse()}),
       f"{name}: expected a regular \\(strided\\) tensor, got layout sparse_coo$")
      for name in ("q", "k_cache", "block_table", "cache_seqlens", "tile_scheduler_metadata")],
    ("decode_fp8", lambda args: {**args, "config": "fast"}, "config: expected a DecodeConfig or None, got str"),
    ("decode_bf16", lambda args: {**args, "config": "fast"}, "config: expected a DecodeConfig or None, got str"),
    ("flash-bf16", _with(q=_nan), "q: 18432 of 18432 values are NaN or inf"),
    # an empty head or token dimension is named as q's (the work-list check sent the caller to
    # get_mla_metadata(cache_seqlens, 0, 1), which is refused itself)
    *[(api, _with(q=lambda t: _t(t)[:, :, :0]),
       r"q: expected at least one query token and one head per request, got s_q 1 and h_q 0$")
      for api in ("flash-fp8", "flash-bf16")],
    ("decode_bf16", _with(q=lambda t: _t(t)[:, :0]), "q: expected at least one query token and one head"),
    ("decode_fp8", _with(q=_q8_with(content=lambda t: t[:, :, :0], scale=lambda t: t[:, :, :0],
                                    rope=lambda t: t[:, :, :0])),
     r"q.content: expected at least one query token and one head per request, got s_q 1 and h_q 0$"),
    ("flash-bf16", _with(k_cache=lambda t: _t(t)[..., :500]),
     r"k_cache: expected shape \[blocks, 64, 576\] or \[blocks, 64, 1, 576\], got \[\d+, 64, 1, 500\]"),
]


@pytest.mark.parametrize(("api", "change", "message"), CASES)
def test_a_bad_argument_is_named_before_the_missing_gpu(
        api: str, change: Callable[[dict[str, object]], dict[str, object]], message: str) -> None:
    with pytest.raises(SnapmlaError, match="^" + message) as caught:
        _call(api, change)
    assert not isinstance(caught.value, NoGpuError)


@pytest.mark.parametrize("api", ["decode_fp8", "decode_bf16"])  # (flash_mla_with_kvcache takes no outputs)
@pytest.mark.parametrize(("out", "lse", "message"), [
    (torch.zeros(B, S_Q, H_Q, 512), None, "out: expected bfloat16"),
    (None, torch.zeros(B, S_Q, H_Q), r"lse: expected shape \[2, 16, 1\]"),
])
def test_bad_outputs_are_named_before_the_missing_gpu(api: str, out: torch.Tensor | None, lse: torch.Tensor | None,
                                                      message: str) -> None:
    with pytest.raises(SnapmlaError, match="^" + message) as caught:
        _call(api, lambda args: {**args, "out": out, "lse": lse})
    assert not isinstance(caught.value, NoGpuError)


@pytest.mark.parametrize("api", ["decode_fp8", "decode_bf16", "flash-fp8", "flash-bf16"])
def test_valid_host_arguments_still_end_at_the_missing_gpu(api: str) -> None:
    """The device check still comes, last: q (the first of its parts) is the tensor named."""
    name = "q.content" if api == "decode_fp8" else "q"
    with pytest.raises(NoGpuError, match=f"^{name}: expected a CUDA tensor, got device cpu"):
        _call(api, lambda args: args)


@pytest.fixture
def checks_on() -> Iterator[None]:
    was = GPU_CHECKS.on
    set_gpu_checks(True)
    yield
    set_gpu_checks(was)


@pytest.mark.usefixtures("checks_on")
@pytest.mark.parametrize("api", ["decode_fp8", "decode_bf16", "flash-fp8", "flash-bf16"])
def test_the_checks_switch_reads_the_table_before_the_missing_gpu(api: str) -> None:
    """With the switch on, a length past its table row is named on the host too."""
    short = _with(block_table=lambda t: _t(t)[:, :1], cache_seqlens=lambda t: torch.tensor([100, 10], dtype=torch.int32))
    with pytest.raises(SnapmlaError, match=r"^cache_seqlens\[0\]") as caught:
        _call(api, short)
    assert not isinstance(caught.value, NoGpuError)


def _on_meta(q: object) -> object:
    """``q`` (a tensor or QuantizedRows) on the 'meta' device: shapes and dtypes, no values."""
    if isinstance(q, QuantizedRows):
        return QuantizedRows(q.content.to("meta"), q.scale.to("meta"), q.rope.to("meta"))
    return _t(q).to("meta")


@pytest.mark.parametrize("checks", [False, True], ids=["checks-off", "checks-on"])
@pytest.mark.parametrize("api", ["decode_fp8", "decode_bf16", "flash-bf16"])
def test_a_query_without_data_is_named_by_its_device(api: str, checks: bool) -> None:
    """A q on 'meta' has no values for the NaN check to read (a host q's is checked always, a
    quantized q's under the switch): the call ended in torch's NotImplementedError ("Cannot copy
    out of meta tensor; no data!") instead of the one line naming q's device."""
    name = "q.content" if api == "decode_fp8" else "q"
    was = GPU_CHECKS.on
    set_gpu_checks(checks)
    try:
        with pytest.raises(NoGpuError, match=f"^{name}: expected a CUDA tensor, got device meta$"):
            _call(api, _with(q=_on_meta))
    finally:
        set_gpu_checks(was)


@pytest.mark.parametrize("checks", [False, True], ids=["checks-off", "checks-on"])
def test_flash_mla_on_an_fp8_cache_names_a_bad_query_before_the_missing_gpu(checks: bool) -> None:
    """flash_mla_with_kvcache on an FP8 cache ended at the missing GPU before its Q-quant, which
    checks Q's values: a NaN q (or a RoPE its scale overflows) on the host was named on the bf16
    cache's path but not on this one. A meta q, which has no values to check, is still named by
    its device."""
    was = GPU_CHECKS.on
    set_gpu_checks(checks)
    try:
        with pytest.raises(SnapmlaError, match="^q: 18432 of 18432 values are NaN or inf") as caught:
            _call("flash-fp8", _with(q=_nan))
        assert not isinstance(caught.value, NoGpuError)
        huge_rope = _q().clone()
        huge_rope[0, 0, 3, :512] = 0
        huge_rope[0, 0, 3, 512:] = 1e30
        with pytest.raises(SnapmlaError, match=r"^q\[0, 0, 3\]: its RoPE part"):
            _call("flash-fp8", _with(q=lambda _: huge_rope))
        with pytest.raises(NoGpuError, match="^q: expected a CUDA tensor, got device meta$"):
            _call("flash-fp8", _with(q=_on_meta))
    finally:
        set_gpu_checks(was)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU this machine has")
def test_graph_work_list_names_a_bad_argument_before_the_missing_gpu() -> None:
    with pytest.raises(SnapmlaError, match="^fp8: expected True or False"):
        GraphWorkList(B, 16, "cuda", fp8="no")  # type: ignore[arg-type]
    with pytest.raises(SnapmlaError, match="^config: expected a DecodeConfig or None"):
        GraphWorkList(B, 16, "cuda", config=5)  # type: ignore[arg-type]
    with pytest.raises(NoGpuError, match="^device: cuda requested"):
        GraphWorkList(B, 16, "cuda")


# ---------------------------------------------------------------- the work list's planned rows


def _planned_for(rows: int) -> str:
    return f"^tile_scheduler_metadata: planned for {rows} query rows"


@pytest.mark.parametrize("api", ["decode_fp8", "decode_bf16", "flash-fp8", "flash-bf16"])
@pytest.mark.parametrize(("s_q", "h_q"), [(1, 32), (2, 16), (1, 8)])
def test_a_work_list_planned_for_other_rows_is_refused(api: str, s_q: int, h_q: int) -> None:
    """Planned for 16 rows (s_q 1 x h_q 16), called with other heads, or the MTP slip (rows h_q
    where s_q 2 makes them 32): one line naming the work list, both counts and the remedy."""
    q8, q = _q8(s_q, h_q), _q(s_q, h_q)
    message = (_planned_for(16) + r" \(num_heads_per_head_k = s_q \* h_q\), the call has "
               f"{s_q * h_q} \\(s_q {s_q} x h_q {h_q}\\); plan it with get_mla_metadata\\(cache_seqlens, {s_q * h_q}, 1\\)$")
    with pytest.raises(SnapmlaError, match=message) as caught:
        _call(api, _with(q=lambda _: q8 if api == "decode_fp8" else q))
    assert not isinstance(caught.value, NoGpuError)


@pytest.mark.parametrize("api", ["decode_fp8", "decode_bf16", "flash-fp8"])
def test_the_planned_rows_in_another_split_or_a_copy_are_taken(api: str) -> None:
    """The rows are what the work list was planned for (s_q 2 x h_q 8 is 16 rows, as planned);
    a copy's rows are not known (not refused, as a copy's batch is not)."""
    q8, q = _q8(2, 8), _q(2, 8)
    with pytest.raises(NoGpuError):
        _call(api, _with(q=lambda _: q8 if api == "decode_fp8" else q))
    q8, q = _q8(1, 32), _q(1, 32)
    with pytest.raises(NoGpuError):
        _call(api, _with(q=lambda _: q8 if api == "decode_fp8" else q,
                         tile_scheduler_metadata=lambda t: _t(t).clone()))


def test_a_graph_work_list_planned_for_other_rows_is_refused() -> None:
    work = GraphWorkList(B, 32, "cpu")
    work.update(_lens())
    with pytest.raises(SnapmlaError, match=_planned_for(32) + r".*the call has 16 \(s_q 1 x h_q 16\)"):
        _call("decode_fp8", _with(tile_scheduler_metadata=lambda _: work.metadata,
                                  num_splits=lambda _: work.num_splits))


def test_the_decode_calls_say_what_they_return() -> None:
    """An engine reads the results' shapes off the docstrings (FlashMLA's ``lse`` is ``[b, h_q,
    s_q]``, not ``out``'s order); they once said only what the calls do."""
    for api in (decode_fp8, decode_bf16, flash_mla_with_kvcache):
        assert "``(out, lse)``" in (inspect.getdoc(api) or ""), api.__name__
    for api in (decode_fp8, flash_mla_with_kvcache):
        doc = " ".join((inspect.getdoc(api) or "").split())
        assert "bf16 ``[b, s_q, h_q, 512]``" in doc and "float32 ``[b, h_q, s_q]``" in doc, api.__name__
    doc = " ".join((inspect.getdoc(get_mla_metadata) or "").split())
    assert "``(tile_scheduler_metadata, num_splits)``, int32 ``[ctas, items, 4]`` and int32 ``[b + 1]``" in doc


def test_get_mla_metadata_without_arguments_names_cache_seqlens() -> None:
    """FlashMLA's newest ``get_mla_metadata()`` takes no argument; here it was Python's TypeError."""
    with pytest.raises(SnapmlaError, match=r"^cache_seqlens: expected the requests' lengths, an int32 \[batch\] "
                                           r"tensor: snapmla plans .* FlashMLASchedMeta are not supported$"):
        get_mla_metadata()


def test_the_rows_are_named_by_the_keyword_they_came_under() -> None:
    """FlashMLA's later keyword was reported under the older name, one the caller never wrote."""
    with pytest.raises(SnapmlaError, match=r"^num_q_tokens_per_head_k: expected 1 <= s_q \* h_q"):
        get_mla_metadata(_lens(), num_q_tokens_per_head_k=0)
    with pytest.raises(SnapmlaError, match=r"^num_heads_per_head_k: expected 1 <= s_q \* h_q"):
        get_mla_metadata(_lens(), 0)
