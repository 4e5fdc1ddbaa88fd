"""Bad KV dumps, bad FP8 cache files and bad ``quantize_layer_cache`` inputs: each is refused
with one line naming the file, the tensor or field and what was expected (SPEC section 8)."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from snapmla_cli.cache.dump_file import DUMP_FORMAT, FP8_CACHE_FORMAT, MAX_ABS_VALUE, read_dump
from snapmla_cli.cache.fp8_file import quantize_layer_cache, read_fp8_cache
from snapmla_cli.cache.layout import dequantize_cache
from snapmla_cli.errors import NoGpuError, SnapmlaError, dtype_name
from snapmla_cli.numerics.formats import D_QK, PAD_OFFSET, ROPE_OFFSET, SCALE_OFFSET

DUMP_META = {"format": DUMP_FORMAT, "version": "1", "kv_lora_rank": "512", "rope_dim": "64",
             "model": "t"}
CACHE_META = {**DUMP_META, "format": FP8_CACHE_FORMAT}
TOKENS = 8


def _kv(tokens: int = TOKENS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, D_QK, generator=torch.Generator().manual_seed(1)).to(dtype)


def _write(tmp_path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    path = tmp_path / "input.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def _refused(read, path: Path, *needles: str) -> str:
    """``read(path)`` raises a one-line SnapmlaError naming the file and every needle."""
    with pytest.raises(SnapmlaError) as info:
        read(path)
    message = str(info.value)
    assert "\n" not in message
    for needle in (str(path), *needles):
        assert needle in message, message
    return message


def _bad_dump(tmp_path: Path, extra: dict[str, torch.Tensor], *needles: str,
              meta: dict[str, str] = DUMP_META) -> str:
    """A one-layer dump of ``_kv()`` plus ``extra`` tensors is refused naming ``needles``."""
    return _refused(read_dump, _write(tmp_path, {"layers.0.kv": _kv(), **extra}, meta), *needles)


# --- KV dumps -------------------------------------------------------------------------------


def test_queries_without_heads_or_rows(tmp_path: Path) -> None:
    no_heads = {"layers.0.queries": torch.zeros(4, 0, D_QK)}
    _bad_dump(tmp_path, no_heads, "layer 0", "queries has shape (4, 0, 576)", "expected h_q >= 1")
    no_rows = {"layers.0.queries": torch.zeros(0, 3, D_QK)}
    _bad_dump(tmp_path, no_rows, "queries has shape (0, 3, 576)", "expected n >= 1")


def test_two_spellings_of_one_layer(tmp_path: Path) -> None:
    _bad_dump(tmp_path, {"layers.00.kv": _kv()}, "'layers.0.kv'", "'layers.00.kv'", "layer 0")


def test_leading_zero_layer_number(tmp_path: Path) -> None:
    path = _write(tmp_path, {"layers.07.kv": _kv()}, DUMP_META)
    _refused(read_dump, path, "'layers.07.kv'", "non-canonical", "'layers.7.kv'")


@pytest.mark.parametrize("dtype, value", [(torch.float32, 3.4e38), (torch.bfloat16, 1e32),
                                          (torch.float32, 2 * MAX_ABS_VALUE)])
def test_values_too_large_for_the_fp8_pipeline(tmp_path: Path, dtype: torch.dtype,
                                               value: float) -> None:
    kv = _kv(dtype=dtype)
    kv[3, D_QK - 1] = value  # in the RoPE part, which is stored as r / s
    path = _write(tmp_path, {"layers.0.kv": kv}, DUMP_META)
    _refused(read_dump, path, "layer 0", "kv", "token 3", f"{MAX_ABS_VALUE:.3g}")


def test_values_at_the_bound_are_accepted(tmp_path: Path) -> None:
    kv = _kv()
    kv[0, 0], kv[1, D_QK - 1] = MAX_ABS_VALUE, -MAX_ABS_VALUE
    assert torch.equal(read_dump(_write(tmp_path, {"layers.0.kv": kv}, DUMP_META)).layers[0].kv, kv)
    cache = quantize_layer_cache(kv)
    assert torch.isfinite(dequantize_cache(cache.view(-1, 656)[:TOKENS])).all()


def test_queries_values(tmp_path: Path) -> None:
    q = torch.zeros(2, 3, D_QK)
    q[1, 2, 5] = float("nan")
    _bad_dump(tmp_path, {"layers.0.queries": q}, "queries", "NaN/inf", "query 1")
    q[1, 2, 5] = 1e30
    _bad_dump(tmp_path, {"layers.0.queries": q}, "queries", "1e+30", "query 1")


def test_integer_queries(tmp_path: Path) -> None:
    queries = {"layers.0.queries": torch.ones(2, 3, D_QK, dtype=torch.int32)}
    _bad_dump(tmp_path, queries, "queries dtype int32", "bfloat16, float16 or float32")


def test_float64_kv(tmp_path: Path) -> None:
    path = _write(tmp_path, {"layers.0.kv": _kv(dtype=torch.float64)}, DUMP_META)
    _refused(read_dump, path, "kv dtype float64", "bfloat16, float16 or float32")


def test_float_positions(tmp_path: Path) -> None:
    positions = {"layers.0.positions": torch.full((TOKENS,), float("nan"))}
    _bad_dump(tmp_path, positions, "positions dtype float32", "integer")


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_wide_unsigned_positions_are_refused_naming_the_accepted_dtypes(tmp_path: Path,
                                                                        dtype: torch.dtype) -> None:
    """They are integers: the message lists the dtypes read, not "expected an integer dtype"."""
    positions = {"layers.0.positions": torch.arange(TOKENS).to(dtype)}
    _bad_dump(tmp_path, positions, f"positions dtype {dtype_name(dtype)}",
              "expected one of the integer dtypes int64, int32, int16, int8, uint8")


@pytest.mark.parametrize("key", ["layers.0.positions\n", "layers.0.kv\n"])
def test_a_key_with_a_trailing_newline_is_a_foreign_tensor(tmp_path: Path, key: str) -> None:
    """``$`` matched before a final newline, so the key read as a misspelt layer number."""
    message = _bad_dump(tmp_path, {key: torch.arange(TOKENS)}, f"unexpected tensor {key!r} in a KV dump")
    assert "non-canonical" not in message


def test_a_cache_key_with_a_trailing_newline_is_a_foreign_tensor(tmp_path: Path) -> None:
    path = _write(tmp_path, {"layers.0.cache": quantize_layer_cache(_kv()), "layers.0.seqlen": torch.tensor(TOKENS),
                             "layers.0.seqlen\n": torch.tensor(TOKENS)}, CACHE_META)
    _refused(read_fp8_cache, path, "unexpected tensor 'layers.0.seqlen\\n' in an FP8 cache file")


@pytest.mark.parametrize("digits", [20, 5000])
def test_a_layer_number_of_too_many_digits_is_refused(tmp_path: Path, digits: int) -> None:
    """int() of a layer number past Python's 4,300-digit limit raised a ValueError (the CLI's
    exit code 3, an "internal error"); a number that long names no layer."""
    key = f"layers.{'1' * digits}.kv"
    _bad_dump(tmp_path, {key: _kv()}, f"layer number of {digits} digits", "expected at most 19")
    path = _write(tmp_path, {f"layers.{'1' * digits}.cache": quantize_layer_cache(_kv()),
                             f"layers.{'1' * digits}.seqlen": torch.tensor(TOKENS)}, CACHE_META)
    _refused(read_fp8_cache, path, f"layer number of {digits} digits")


def test_a_layer_number_of_19_digits_is_read(tmp_path: Path) -> None:
    index = 10**18
    layers = read_dump(_write(tmp_path, {f"layers.{index}.kv": _kv()}, DUMP_META)).layers
    assert [layer.index for layer in layers] == [index]


@pytest.mark.parametrize("bad", [-3, -1])
def test_negative_positions(tmp_path: Path, bad: int) -> None:
    positions = torch.arange(TOKENS)
    positions[5] = bad
    _bad_dump(tmp_path, {"layers.0.positions": positions}, "positions", str(bad), "token 5", ">= 0")


def test_positions_restarting_per_prompt_are_fine(tmp_path: Path) -> None:
    positions = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2], dtype=torch.int32)
    path = _write(tmp_path, {"layers.0.kv": _kv(), "layers.0.positions": positions}, DUMP_META)
    assert torch.equal(read_dump(path).layers[0].positions, positions)


@pytest.mark.parametrize("version", ["2", "", None])
def test_unknown_version(tmp_path: Path, version: str | None) -> None:
    meta = {k: v for k, v in DUMP_META.items() if k != "version"}
    if version is not None:
        meta["version"] = version
    _bad_dump(tmp_path, {}, f"version={version!r}", "expected '1'", meta=meta)


@pytest.mark.parametrize("key", ["kv_lora_rank", "rope_dim"])
def test_other_mla_widths_are_refused(tmp_path: Path, key: str) -> None:
    """SPEC section 8's metadata names the widths; a dump of another model's latent (say a
    256-wide kv_lora_rank padded to 576) must not be read as SnapMLA's 512 + 64."""
    _bad_dump(tmp_path, {}, f"{key}=256", "snapmla supports", meta={**DUMP_META, key: "256"})


def test_a_dump_without_tensors_is_refused(tmp_path: Path) -> None:
    _refused(read_dump, _write(tmp_path, {}, DUMP_META), "holds no layers")


def test_positions_must_have_one_per_token(tmp_path: Path) -> None:
    short = {"layers.0.positions": torch.arange(TOKENS - 1)}
    _bad_dump(tmp_path, short, "layer 0", f"positions has shape ({TOKENS - 1},)", f"expected [{TOKENS}]")


def test_queries_of_another_width_are_refused(tmp_path: Path) -> None:
    narrow = {"layers.0.queries": torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(2))}
    _bad_dump(tmp_path, narrow, "layer 0", "queries has shape (2, 3, 512)", "expected [n, h_q, 576]")


def test_layers_come_back_in_numeric_order(tmp_path: Path) -> None:
    """Layer 10's key sorts before layer 2's as text; the layers are read as numbers."""
    kv = {f"layers.{i}.kv": _kv() * (i + 1) for i in (10, 2, 0)}
    layers = read_dump(_write(tmp_path, kv, DUMP_META)).layers
    assert [layer.index for layer in layers] == [0, 2, 10]
    assert torch.equal(layers[1].kv, _kv() * 3)


def test_layers_asked_for_are_the_only_ones_read_and_checked(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """verify --dump uses one layer of a model's dump: only that layer is read, checked and paid
    for in host memory (every layer was, the whole file for a sixtieth of it); the others' keys
    are still checked, and a layer the file lacks is named with the ones it has."""
    from snapmla_cli import host_memory
    from snapmla_cli.cache.dump_file import dump_layer_indices

    poisoned = _kv(400)
    poisoned[3, 7] = math.nan
    path = _write(tmp_path, {"layers.0.kv": poisoned, "layers.2.kv": _kv(), "layers.2.positions": torch.arange(TOKENS),
                             "layers.5.kv": _kv() * 2}, DUMP_META)
    assert dump_layer_indices(path) == [0, 2, 5]
    dump = read_dump(path, layers=[5])
    assert [layer.index for layer in dump.layers] == [5] and torch.equal(dump.layers[0].kv, _kv() * 2)
    two = read_dump(path, layers=[2]).layers[0]
    assert two.positions is not None and torch.equal(two.positions, torch.arange(TOKENS))
    _refused(lambda p: read_dump(p, layers=[0]), path, "layer 0", "NaN/inf")
    _refused(read_dump, path, "layer 0", "NaN/inf")
    _refused(lambda p: read_dump(p, layers=[3]), path, "no layer 3; the dump has layers 0, 2, 5")
    # memory for layer 5's 8 tokens (18 KiB), not for the file's 400 + 16 (about 950 KiB)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 400_000)
    assert len(read_dump(path, layers=[5]).layers) == 1
    _refused(lambda p: read_dump(p, layers=[0]), path, "needs about")


def test_layers_given_as_a_generator_or_as_nothing(tmp_path: Path) -> None:
    """A generator of layers was used up by the check that they exist, so the read found none
    and returned an empty dump; an empty selection is refused rather than read as no layer."""
    path = _write(tmp_path, {"layers.0.kv": _kv(), "layers.1.kv": _kv() * 3}, DUMP_META)
    dump = read_dump(path, layers=(i for i in [1]))
    assert [layer.index for layer in dump.layers] == [1] and torch.equal(dump.layers[0].kv, _kv() * 3)
    with pytest.raises(SnapmlaError, match=r"^layers: expected at least one layer index, or None for all$"):
        read_dump(path, layers=[])


@pytest.mark.parametrize(("dtype", "shape", "expected"), [
    ("BF16", [1000, 576], 1_152_000), ("F8_E4M3", [3, 656], 1968), ("I64", [7], 56), ("BOOL", [5], 5),
    ("F4", [4096, 576], 1_179_648), ("F6_E2M3", [3], 3),  # sub-byte types: 0 bytes were counted
])
def test_the_bytes_a_tensor_takes_come_from_its_header(dtype: str, shape: list[int], expected: int) -> None:
    from snapmla_cli.cache.dump_file import _stored_bytes

    class Header:
        def get_slice(self, key: str):
            return type("Slice", (), {"get_dtype": lambda _: dtype, "get_shape": lambda _: shape})()

    assert _stored_bytes(Header(), "layers.0.kv") == expected


def test_a_layer_without_its_kv_is_refused_whichever_layers_are_read(tmp_path: Path) -> None:
    from snapmla_cli.cache.dump_file import dump_layer_indices

    path = _write(tmp_path, {"layers.0.kv": _kv(), "layers.1.positions": torch.arange(TOKENS)}, DUMP_META)
    for read in (dump_layer_indices, read_dump, lambda p: read_dump(p, layers=[0])):
        _refused(read, path, "layer 1 has no 'layers.1.kv' tensor")


# --- FP8 cache files ------------------------------------------------------------------------


def _cache_file(tmp_path: Path, cache: torch.Tensor | None = None,
                seqlen: torch.Tensor | None = None, meta: dict[str, str] = CACHE_META) -> Path:
    cache = quantize_layer_cache(_kv()) if cache is None else cache
    seqlen = torch.tensor(TOKENS) if seqlen is None else seqlen
    return _write(tmp_path, {"layers.0.cache": cache, "layers.0.seqlen": seqlen}, meta)


def test_good_cache_file(tmp_path: Path) -> None:
    layer = read_fp8_cache(_cache_file(tmp_path)).layers[0]
    assert layer.seqlen == TOKENS and torch.equal(layer.cache, quantize_layer_cache(_kv()))


@pytest.mark.parametrize("seqlen, needle", [
    (torch.zeros(0, dtype=torch.int64), "shape (0,)"),
    (torch.tensor(7.7), "dtype float32"),
    (torch.tensor([TOKENS, 5000]), "shape (2,)"),
    (torch.tensor(True), "dtype bool"),
])
def test_bad_seqlen(tmp_path: Path, seqlen: torch.Tensor, needle: str) -> None:
    path = _cache_file(tmp_path, seqlen=seqlen)
    _refused(read_fp8_cache, path, "layers.0.seqlen", needle, "one integer" if "shape" in needle
             else "integer")


@pytest.mark.parametrize("seqlen", [0, -1, 65, 10**12])
def test_seqlen_out_of_range(tmp_path: Path, seqlen: int) -> None:
    _refused(read_fp8_cache, _cache_file(tmp_path, seqlen=torch.tensor(seqlen)), "layer 0",
             f"seqlen {seqlen}", "does not fit 1 pages")


@pytest.mark.parametrize("seqlen", [2**63, 2**64 - 1])
def test_a_uint64_seqlen_beyond_int64_is_out_of_range_not_a_crash(tmp_path: Path, seqlen: int) -> None:
    """torch's int() of such a uint64 raises its int64-overflow RuntimeError (an internal error
    in the CLI); the value is out of range like any other too large seqlen."""
    path = _cache_file(tmp_path, seqlen=torch.tensor(seqlen, dtype=torch.uint64))
    _refused(read_fp8_cache, path, "layer 0", f"seqlen {seqlen}", "does not fit 1 pages")


def test_an_empty_cache_of_no_tokens_is_refused(tmp_path: Path) -> None:
    empty = torch.zeros(0, 64, 656, dtype=torch.uint8)
    _refused(read_fp8_cache, _cache_file(tmp_path, empty, torch.tensor(0)), "layer 0",
             "seqlen 0 does not fit 0 pages")


@pytest.mark.parametrize("reshape, needle", [
    (lambda c: c.reshape(1, 32, 2 * 656), "cache is uint8 (1, 32, 1312)"),  # same bytes, other rows
    (lambda c: c.view(torch.int8), "cache is int8 (1, 64, 656)"),
])
def test_a_cache_of_another_layout_or_dtype_is_refused(tmp_path: Path, reshape, needle: str) -> None:
    cache = reshape(quantize_layer_cache(_kv(64)))
    _refused(read_fp8_cache, _cache_file(tmp_path, cache, torch.tensor(64)), "layer 0", needle,
             "expected uint8 [num_blocks, 64, 656]")


def test_a_cache_layer_without_its_seqlen_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, {"layers.0.cache": quantize_layer_cache(_kv())}, CACHE_META)
    _refused(read_fp8_cache, path, "layer 0 needs both 'cache' and 'seqlen' tensors")


def test_cache_layers_come_back_in_numeric_order(tmp_path: Path) -> None:
    tensors = {}
    for i, tokens in ((10, 3), (2, 5)):
        tensors[f"layers.{i}.cache"] = quantize_layer_cache(_kv(tokens))
        tensors[f"layers.{i}.seqlen"] = torch.tensor(tokens)
    layers = read_fp8_cache(_write(tmp_path, tensors, CACHE_META)).layers
    assert [(layer.index, layer.seqlen) for layer in layers] == [(2, 5), (10, 3)]


def test_cache_version(tmp_path: Path) -> None:
    path = _cache_file(tmp_path, meta={**CACHE_META, "version": "2"})
    _refused(read_fp8_cache, path, "version='2'", "expected '1'")


@pytest.mark.parametrize("start, stop, what", [
    (10, 11, "E4M3 NaN"),
    (SCALE_OFFSET, SCALE_OFFSET + 4, "scale"),
    (ROPE_OFFSET + 8, ROPE_OFFSET + 10, "RoPE holds NaN/inf"),
])
def test_poisoned_token(tmp_path: Path, start: int, stop: int, what: str) -> None:
    cache = quantize_layer_cache(_kv())
    cache[0, 5, start:stop] = 0xFF  # all-ones: NaN as E4M3, float32 and bf16 alike
    _refused(read_fp8_cache, _cache_file(tmp_path, cache), "layer 0", "token 5", what)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), 2.0**-33])
def test_impossible_scale(tmp_path: Path, scale: float) -> None:
    cache = quantize_layer_cache(_kv())
    cache[0, 2, SCALE_OFFSET:SCALE_OFFSET + 4] = torch.tensor([scale]).view(torch.uint8)
    _refused(read_fp8_cache, _cache_file(tmp_path, cache), "layer 0", "token 2", "scale")


def _set_scale(cache: torch.Tensor, token: int, scale: float) -> None:
    cache[0, token, SCALE_OFFSET:SCALE_OFFSET + 4] = torch.tensor([scale]).view(torch.uint8)


def test_a_scale_that_makes_the_content_infinite_is_refused(tmp_path: Path) -> None:
    """A finite scale (3e38) times the token's largest E4M3 content (448) is inf in float32:
    the token does not decode to finite values (SPEC section 3: c = s * c_q)."""
    cache = quantize_layer_cache(_kv())
    _set_scale(cache, 2, 3e38)
    _refused(read_fp8_cache, _cache_file(tmp_path, cache), "layer 0", "token 2 of seqlen",
             "content * scale is not finite")


def test_a_scale_that_makes_the_rope_infinite_is_refused(tmp_path: Path) -> None:
    """RoPE is stored pre-scaled (r' = r / s) and dequantizes as s * r' too: zero content keeps
    s * c finite, a RoPE value of 1000 times 1e36 is not."""
    cache = quantize_layer_cache(_kv())
    cache[0, 3, :SCALE_OFFSET] = 0
    _set_scale(cache, 3, 1e36)
    cache[0, 3, ROPE_OFFSET:] = torch.full((64,), 1000.0, dtype=torch.bfloat16).view(torch.uint8)
    _refused(read_fp8_cache, _cache_file(tmp_path, cache), "layer 0", "token 3 of seqlen",
             "RoPE * scale is not finite")


def test_a_large_scale_with_a_finite_product_is_accepted(tmp_path: Path) -> None:
    """The bound is the float32 range of the dequantized values, not the scale alone."""
    cache = quantize_layer_cache(_kv())
    cache[0, 1, :SCALE_OFFSET] = 0
    cache[0, 1, 0] = 0x7E  # E4M3 448, the largest content
    cache[0, 1, ROPE_OFFSET:] = 0
    _set_scale(cache, 1, 3e38 / 448)
    layer = read_fp8_cache(_cache_file(tmp_path, cache)).layers[0]
    assert torch.isfinite(dequantize_cache(layer.cache.view(-1, 656)[:TOKENS])).all()


def test_a_positive_e4m3_nan_byte_is_refused(tmp_path: Path) -> None:
    """float8_e4m3fn has two NaN encodings, 0x7F and 0xFF: the positive one poisons a decode too."""
    cache = quantize_layer_cache(_kv())
    cache[0, 4, 300] = 0x7F
    _refused(read_fp8_cache, _cache_file(tmp_path, cache), "layer 0", "token 4", "E4M3 NaN")


def test_a_page_beyond_the_last_token_is_refused(tmp_path: Path) -> None:
    """SPEC section 8: the cache holds ceil(seqlen / 64) pages; an extra all-zero page means the
    file's seqlen is not where its writer stopped."""
    cache = torch.cat([quantize_layer_cache(_kv()), torch.zeros(1, 64, 656, dtype=torch.uint8)])
    _refused(read_fp8_cache, _cache_file(tmp_path, cache), "layer 0", f"seqlen {TOKENS}",
             "does not fit 2 pages")


def test_poison_in_the_unused_tail(tmp_path: Path) -> None:
    cache = quantize_layer_cache(_kv())
    cache[0, TOKENS + 1, 10] = 0xFF
    _refused(read_fp8_cache, _cache_file(tmp_path, cache), "layer 0", f"token {TOKENS + 1}",
             "tail of the last page must be zero")


@pytest.mark.parametrize("offset", [PAD_OFFSET, ROPE_OFFSET - 1])
def test_non_zero_pad_bytes(tmp_path: Path, offset: int) -> None:
    """SPEC section 3: bytes 516..527 of a token row are zero; the first bad token is named."""
    cache = quantize_layer_cache(_kv())
    for token in (3, 6):
        cache[0, token, offset] = 1
    message = _refused(read_fp8_cache, _cache_file(tmp_path, cache), "layer 0", "token 3 of seqlen",
                       "pad bytes 516..527 are not zero")
    assert "token 6" not in message


def test_pad_bytes_are_checked_on_every_page(tmp_path: Path) -> None:
    """The check covers all used tokens, not only the first page (token 64 + 5 of three pages)."""
    cache = quantize_layer_cache(_kv(150))
    cache[1, 5, PAD_OFFSET + 4] = 0x80
    _refused(read_fp8_cache, _cache_file(tmp_path, cache, torch.tensor(150)), "token 69", "pad bytes")


@pytest.mark.parametrize("read, what", [(read_dump, "dump"), (read_fp8_cache, "FP8 cache")])
def test_an_unreadable_input_is_named_as_such(tmp_path: Path, denied_paths: set[Path], read,
                                              what: str) -> None:
    """The safetensors library reports a file it may not read as "No such file or directory": the
    message said "not a safetensors file (No such file or directory ...)" of a file that is there.
    (Root reads any file, so the permission is taken away by the test's os.access.)"""
    path = _cache_file(tmp_path)
    denied_paths.add(path)
    message = _refused(read, path, f"{what} ", "cannot read it (permission denied)")
    assert "No such file" not in message


@pytest.mark.parametrize("read, what", [(read_dump, "dump"), (read_fp8_cache, "FP8 cache")])
def test_inputs_that_are_not_regular_files(tmp_path: Path, read, what: str) -> None:
    """Each names what is there instead of "no such file"; a fifo is never opened (it would
    wait for a writer)."""
    fifo = tmp_path / "fifo.st"
    os.mkfifo(fifo)
    _refused(read, fifo, f"{what} ", "is a fifo, expected a", "file (.safetensors)")
    loop_a, loop_b = tmp_path / "a.st", tmp_path / "b.st"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    _refused(read, loop_a, "is a symlink loop")
    dangling = tmp_path / "dangling.st"
    dangling.symlink_to(tmp_path / "gone.st")
    _refused(read, dangling, "is a dangling symlink", "gone.st")
    _refused(read, tmp_path / "missing.st", "no such file")
    _refused(read, tmp_path, "is a folder")


# --- quantize_layer_cache -------------------------------------------------------------------


def _quantize_refused(kv: torch.Tensor, *needles: str, device: str = "cpu") -> None:
    with pytest.raises(SnapmlaError) as info:
        quantize_layer_cache(kv, device)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_quantize_on_cuda_without_gpu() -> None:
    with pytest.raises(NoGpuError, match="cuda"):
        quantize_layer_cache(_kv(dtype=torch.bfloat16), "cuda")


def test_quantize_refuses_bad_kv() -> None:
    kv = _kv()
    kv[4, 9] = float("nan")
    _quantize_refused(kv, "kv", "NaN/inf", "token 4")
    kv[4, 9] = 1e35
    _quantize_refused(kv, "kv", "token 4", f"{MAX_ABS_VALUE:.3g}")
    _quantize_refused(torch.ones(3, D_QK, dtype=torch.int32), "kv dtype int32")
    _quantize_refused(_kv(dtype=torch.float64), "kv dtype float64")
    _quantize_refused(torch.zeros(0, D_QK), "tokens >= 1")
    _quantize_refused(_kv(), "device", device="gpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_accepts_the_dump_dtypes(dtype: torch.dtype) -> None:
    assert quantize_layer_cache(_kv(dtype=dtype)).shape == (1, 64, 656)


def _dump_file(path: Path) -> Path:
    from snapmla_cli.cache.dump_file import KVDump, LayerDump, write_dump

    write_dump(KVDump([LayerDump(0, torch.randn(70, D_QK).bfloat16())], model="m"), path)
    return path


def test_a_dump_larger_than_the_free_memory_is_named_before_it_is_read(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid 30 GB dump was reported as "not a safetensors file" and a 10 GB one under a memory
    limit as an internal error (MemoryError, exit 3)."""
    from snapmla_cli import host_memory

    path = _dump_file(tmp_path / "d.st")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1000)
    with pytest.raises(SnapmlaError, match=rf"^dump {path}: loading a KV dump: needs about .* GiB of host memory, "
                                           r"0\.0 GiB available$"):
        read_dump(path)


def test_running_out_of_memory_while_loading_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from snapmla_cli.cache import dump_file

    path = _dump_file(tmp_path / "d.st")

    real_open = dump_file.safe_open

    @contextlib.contextmanager
    def exhausted_on_read(name: str, framework: str):
        with real_open(name, framework=framework) as handle:
            class Exhausted:  # the header reads as ever; a tensor's bytes find no memory
                keys = handle.keys
                metadata = handle.metadata
                get_slice = handle.get_slice

                def get_tensor(self, key: str) -> None:
                    raise MemoryError("Cannot allocate memory (os error 12)")

            yield Exhausted()

    monkeypatch.setattr(dump_file, "safe_open", exhausted_on_read)
    with pytest.raises(SnapmlaError, match=rf"^dump {path}: loading a KV dump of 0\.0 GiB ran out of host memory"):
        read_dump(path)
    # the bytes read are named, not the file's size (one layer of a large dump is not all of it)
    monkeypatch.setattr(dump_file, "_gib", lambda _: "the file's")
    with pytest.raises(SnapmlaError, match=rf"^dump {path}: loading a KV dump of 0\.0 GiB ran out of host memory"):
        read_dump(path, layers=[0])


def test_a_file_name_that_is_not_utf8_is_read_and_written_back(tmp_path: Path) -> None:
    """snapmla wrote such a name (synth -o) and then refused to read it: the safetensors library
    takes UTF-8 paths. The quantized cache records the source with the odd byte escaped."""
    from snapmla_cli.cache.fp8_file import FP8CacheFile, FP8CacheLayer, write_fp8_cache

    odd = tmp_path / os.fsdecode(b"caf\xe9.st")
    _dump_file(odd)
    dump = read_dump(odd)
    assert dump.layers[0].kv.shape == (70, D_QK)
    cache = quantize_layer_cache(dump.layers[0].kv)
    out = tmp_path / os.fsdecode(b"q\xff.st")
    write_fp8_cache(FP8CacheFile([FP8CacheLayer(0, cache, 70)], model="m", extra_metadata={"source": str(odd)}), out)
    back = read_fp8_cache(out)
    assert torch.equal(back.layers[0].cache, cache)
    assert back.extra_metadata["source"] == str(tmp_path) + "/caf\\xe9.st"
