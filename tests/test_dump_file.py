"""KV dump files and FP8 cache files (SPEC section 8): round trips and one-line errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from snapmla_cli.cache.dump_file import DUMP_FORMAT, KVDump, LayerDump, read_dump, write_dump
from snapmla_cli.cache.fp8_file import (
    FP8CacheFile,
    FP8CacheLayer,
    quantize_layer_cache,
    read_fp8_cache,
    write_fp8_cache,
)
from snapmla_cli.cache.layout import quantize_tokens
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.formats import D_QK

META = {"format": DUMP_FORMAT, "version": "1", "kv_lora_rank": "512", "rope_dim": "64", "model": "t"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    layers = [
        LayerDump(0, torch.randn(100, D_QK, generator=gen).to(dtype), torch.arange(100),
                  torch.randn(2, 3, D_QK, generator=gen).to(dtype)),
        LayerDump(3, torch.randn(7, D_QK, generator=gen).to(dtype)),
    ]
    path = tmp_path / "d.safetensors"
    write_dump(KVDump(layers, model="m", extra_metadata={"note": "x"}), path)
    back = read_dump(path)
    assert back.model == "m" and back.extra_metadata == {"note": "x"}
    assert [layer.index for layer in back.layers] == [0, 3]
    assert torch.equal(back.layers[0].kv, layers[0].kv) and back.layers[0].kv.dtype == dtype
    assert torch.equal(back.layers[0].positions, layers[0].positions)
    assert torch.equal(back.layers[0].queries, layers[0].queries)
    assert back.layers[1].queries is None and back.layers[1].positions is None


def _raw(tmp_path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = META) -> Path:
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def _one_line_error(path: Path, *needles: str) -> None:
    with pytest.raises(SnapmlaError) as info:
        read_dump(path)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_not_a_dump(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"this is not safetensors at all")
    _one_line_error(junk, "not a safetensors file")
    _one_line_error(_raw(tmp_path, {"x": torch.zeros(2)}, {"format": "other"}), "not a snapmla-kv-dump")
    _one_line_error(tmp_path / "missing.safetensors", "no such file")
    folder = tmp_path / "a_folder.safetensors"
    folder.mkdir()
    _one_line_error(folder, "is a folder")


def test_wrong_width(tmp_path: Path) -> None:
    _one_line_error(_raw(tmp_path, {"layers.2.kv": torch.zeros(4, 575)}), "layer 2", "575", "576")


def test_nan_and_inf(tmp_path: Path) -> None:
    kv = torch.zeros(8, D_QK)
    kv[5, 7] = float("nan")
    _one_line_error(_raw(tmp_path, {"layers.1.kv": kv}), "layer 1", "NaN/inf", "token 5")
    kv[5, 7] = float("inf")
    _one_line_error(_raw(tmp_path, {"layers.1.kv": kv}), "layer 1", "NaN/inf")


def test_empty_layer(tmp_path: Path) -> None:
    _one_line_error(_raw(tmp_path, {"layers.4.kv": torch.zeros(0, D_QK)}), "layer 4", "empty")


def test_write_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    dump = KVDump([LayerDump(0, torch.zeros(3, D_QK))])
    write_dump(dump, path)
    with pytest.raises(SnapmlaError, match="--force"):
        write_dump(dump, path)
    write_dump(dump, path, force=True)


def test_dump_write_refuses_to_overwrite_before_writing(tmp_path: Path) -> None:
    """As for the FP8 cache: an existing dump is refused up front as existing, and kept."""
    path = tmp_path / "d.safetensors"
    path.write_bytes(b"keep me")
    dump = KVDump([LayerDump(0, torch.randn(3, D_QK, generator=torch.Generator().manual_seed(3)))])
    with pytest.raises(SnapmlaError, match="exists; pass --force"):
        write_dump(dump, path)
    assert path.read_bytes() == b"keep me"


def test_positions_are_written_as_int64(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    kv = torch.randn(5, D_QK, generator=torch.Generator().manual_seed(4))
    write_dump(KVDump([LayerDump(0, kv, torch.arange(5, dtype=torch.int32))]), path)
    positions = read_dump(path).layers[0].positions
    assert positions.dtype == torch.int64 and positions.tolist() == [0, 1, 2, 3, 4]


def test_fp8_cache_write_refuses_to_overwrite_before_writing(tmp_path: Path) -> None:
    """An existing file is refused up front as existing (not only by the no-clobber move, whose
    error says it appeared while snapmla was working), and kept."""
    path = tmp_path / "c.safetensors"
    path.write_bytes(b"keep me")
    cache_file = FP8CacheFile([FP8CacheLayer(0, quantize_layer_cache(torch.randn(3, D_QK)), 3)])
    with pytest.raises(SnapmlaError, match="exists; pass --force"):
        write_fp8_cache(cache_file, path)
    assert path.read_bytes() == b"keep me"
    write_fp8_cache(cache_file, path, force=True)
    assert read_fp8_cache(path).layers[0].seqlen == 3


def test_fp8_cache_file_keeps_extra_metadata_and_an_int64_seqlen(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    kv = torch.randn(9, D_QK, generator=torch.Generator().manual_seed(5))
    path = tmp_path / "c.safetensors"
    write_fp8_cache(FP8CacheFile([FP8CacheLayer(1, quantize_layer_cache(kv), 9)], model="m",
                                 extra_metadata={"source": "d.st"}), path)
    back = read_fp8_cache(path)
    assert back.model == "m" and back.extra_metadata == {"source": "d.st"}
    seqlen = load_file(str(path))["layers.1.seqlen"]
    assert seqlen.dtype == torch.int64 and seqlen.shape == () and int(seqlen) == 9


@pytest.mark.parametrize("tokens", [1, 64, 100])
def test_layer_cache_is_the_quantizer_bytes_in_pages(tokens: int) -> None:
    kv = torch.randn(tokens, D_QK).to(torch.bfloat16)
    cache = quantize_layer_cache(kv)
    assert cache.dtype == torch.uint8 and cache.shape == ((tokens + 63) // 64, 64, 656)
    flat = cache.view(-1, 656)
    assert torch.equal(flat[:tokens], quantize_tokens(kv))
    assert flat[tokens:].eq(0).all()


def test_fp8_cache_file_round_trip_and_errors(tmp_path: Path) -> None:
    kv = torch.randn(70, D_QK).to(torch.bfloat16)
    layer = FP8CacheLayer(5, quantize_layer_cache(kv), 70)
    path = tmp_path / "c.safetensors"
    write_fp8_cache(FP8CacheFile([layer], model="m"), path)
    back = read_fp8_cache(path)
    assert back.model == "m" and back.layers[0].index == 5 and back.layers[0].seqlen == 70
    assert torch.equal(back.layers[0].cache, layer.cache)
    with pytest.raises(SnapmlaError, match="not a snapmla-fp8-cache"):
        read_fp8_cache(_raw(tmp_path, {"layers.0.kv": torch.zeros(1, D_QK)}))
    with pytest.raises(SnapmlaError, match="does not fit"):
        write_fp8_cache(FP8CacheFile([FP8CacheLayer(0, layer.cache, 200)]), tmp_path / "x.safetensors")


@pytest.mark.parametrize("key", ["kv_lora_rank", "rope_dim", "model"])
def test_metadata_without_a_spec_key_is_refused(tmp_path: Path, key: str) -> None:
    """SPEC section 8 gives a dump and an FP8 cache file the metadata format, version,
    kv_lora_rank, rope_dim and model: a file lacking one is not written to the spec (without the
    widths it does not even say how its 576 columns split)."""
    meta = {k: v for k, v in META.items() if k != key}
    needle = f"metadata has no {key!r}, expected the keys format, version, kv_lora_rank, rope_dim, model"
    _one_line_error(_raw(tmp_path, {"layers.0.kv": torch.zeros(2, D_QK)}, meta), needle)
    cache = {"layers.0.cache": quantize_layer_cache(torch.zeros(2, D_QK)), "layers.0.seqlen": torch.tensor(2)}
    with pytest.raises(SnapmlaError, match=f"metadata has no {key!r}"):
        read_fp8_cache(_raw(tmp_path, cache, {**meta, "format": "snapmla-fp8-cache"}))


def test_what_snapmla_writes_carries_the_spec_metadata(tmp_path: Path) -> None:
    """synth (and dump, through the same KVDump.metadata) and quantize write every required key."""
    from safetensors import safe_open

    from snapmla_cli.cache.dump_file import REQUIRED_METADATA
    from snapmla_cli.cache.synth import SynthSpec, synth_dump

    dump_path, cache_path = tmp_path / "d.safetensors", tmp_path / "c.safetensors"
    write_dump(synth_dump(SynthSpec(layers=1, tokens=8, queries=1, seed=0)), dump_path)
    write_fp8_cache(FP8CacheFile([FP8CacheLayer(0, quantize_layer_cache(torch.zeros(2, D_QK)), 2)]), cache_path)
    for path in (dump_path, cache_path):
        with safe_open(str(path), framework="pt") as handle:
            assert set(REQUIRED_METADATA) <= set(handle.metadata())
    assert read_dump(dump_path).model == "snapmla-synthetic"


@pytest.mark.parametrize("indices, needle", [
    ((), "holds no layers"),
    ((1, 1), "layer 1 given twice"),
    ((-1,), "layer index -1: expected an integer >= 0"),
])
def test_the_writers_refuse_layer_lists_their_readers_would_not_take_back(tmp_path, indices, needle):
    """A repeated index overwrote the earlier layer (the file held one layer of two, without a
    word); an empty list or a negative index wrote a file the reader refuses. Nothing is written."""
    from snapmla_cli.cache.fp8_file import (
        FP8CacheFile,
        FP8CacheLayer,
        quantize_layer_cache,
        write_fp8_cache,
    )

    gen = torch.Generator().manual_seed(3)
    kvs = [torch.randn(3 + i, 576, generator=gen) for i in range(len(indices))]
    dump_path, cache_path = tmp_path / "d.safetensors", tmp_path / "c.safetensors"
    with pytest.raises(SnapmlaError, match=needle):
        write_dump(KVDump([LayerDump(i, kv) for i, kv in zip(indices, kvs)]), dump_path)
    with pytest.raises(SnapmlaError, match=needle):
        write_fp8_cache(FP8CacheFile([FP8CacheLayer(i, quantize_layer_cache(kv), kv.shape[0])
                                      for i, kv in zip(indices, kvs)]), cache_path)
    assert not dump_path.exists() and not cache_path.exists()


def _layer(index, tokens=8):
    return LayerDump(index, torch.randn(tokens, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))


def test_an_error_about_the_files_contents_names_the_argument(tmp_path):
    """An FP8 cache file given as DUMP: the error about its contents starts with the argument
    that named it, as the errors about the file itself do."""
    kv = _layer(0).kv
    fp8 = tmp_path / "cache.safetensors"
    write_fp8_cache(FP8CacheFile([FP8CacheLayer(0, quantize_layer_cache(kv), kv.shape[0])]), fp8)
    with pytest.raises(SnapmlaError) as info:
        read_dump(fp8, "DUMP")
    assert str(info.value).startswith(f"DUMP {fp8}: not a snapmla-kv-dump file"), str(info.value)


@pytest.mark.parametrize("index", [True, False])
def test_a_bool_layer_index_is_refused_by_the_writer(tmp_path, index):
    """True is an int to isinstance, but ``layers.True.kv`` is a key no reader takes back."""
    with pytest.raises(SnapmlaError, match="expected an integer >= 0"):
        write_dump(KVDump([_layer(index)], model="m"), tmp_path / "d.safetensors")
    assert not (tmp_path / "d.safetensors").exists()


@pytest.mark.parametrize("chunk", [1, 576, 577 * 3, 1 << 23])
def test_first_bad_row_names_the_row_across_check_chunks(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The values are checked a few rows at a time (a whole layer's float32 |x| took 4x its size):
    the row named is the first bad one of the tensor, whichever chunk it falls in."""
    from snapmla_cli.cache import dump_file

    monkeypatch.setattr(dump_file, "CHECK_CHUNK_ELEMENTS", chunk)
    kv = (torch.randn(50, 576) * 3).to(torch.bfloat16)
    assert dump_file.first_bad_row(kv) is None
    kv[37, 5] = 2 * dump_file.MAX_ABS_VALUE
    kv[44, 0] = math.nan
    row, value = dump_file.first_bad_row(kv)
    assert row == 37 and value == pytest.approx(2 * dump_file.MAX_ABS_VALUE, rel=1e-2)
    kv[9, 575] = -math.inf
    row, value = dump_file.first_bad_row(kv)
    assert row == 9 and math.isnan(value)
