"""KV dump files (SPEC section 8): read with validation, write atomically.

A dump holds, per layer, the cached latent ``kv`` ``[tokens, 576]`` (content first, RoPE last),
optional ``positions`` and optional absorbed decode ``queries`` ``[n, h_q, 576]``. Reading checks
everything a later stage relies on, so that a bad file fails here with one line naming the
layer and the problem rather than deep inside a decode.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file

from ..errors import SnapmlaError, dtype_name, show
from ..host_memory import require_host_memory
from ..numerics.formats import D_CONTENT, D_QK, D_ROPE
from ..sizes import MAX_DIGITS, shorten
from .atomic import check_writable, file_kind, write_atomic

DUMP_FORMAT = "snapmla-kv-dump"
FP8_CACHE_FORMAT = "snapmla-fp8-cache"
FORMAT_VERSION = "1"
REQUIRED_METADATA = ("format", "version", "kv_lora_rank", "rope_dim", "model")
"""The metadata keys SPEC section 8 gives a KV dump and an FP8 cache file; every other key is
free (kept as ``extra_metadata``)."""
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The float dtypes SPEC section 8 allows for ``kv`` and ``queries``; anything else (an integer
tensor, float64) would be cast silently by later stages, so it is refused instead."""
_POSITION_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
"""Read losslessly as int64 (SPEC section 8 writes int64); the wider unsigned ones are refused:
uint64 may not fit int64, and torch supports few operations on uint16 / uint32 / uint64."""
_POSITION_DTYPE_NAMES = ", ".join(dtype_name(dtype) for dtype in _POSITION_DTYPES)
_KEY = re.compile(r"layers\.(\d+)\.(kv|positions|queries)")  # matched whole: see layer_keys
_T = TypeVar("_T")

# Largest |value| accepted in ``kv`` and ``queries``. Both go through the per-token quantizer
# (SPEC section 3): s = max(amax(content) / 448, 2^-32) and the RoPE part is stored pre-scaled,
# r' = bf16(r / s). With content near zero, s sits at the 2^-32 floor and r' = r * 2^32; the
# kernel then sums 64 products q_r' * k_r' into a float32 accumulator (max ~2^128), so
# 64 * (|q_r| 2^32) * (|k_r| 2^32) < 2^128 needs |x| < 2^29. 2^24 (~1.7e7) keeps a factor 2^10 of
# headroom on that sum for the content tiles, the softmax scale and exp2's log2(e), and is far
# above any real latent or absorbed query (O(1e3)). Checked on the values widened to float32: a
# value within it stays finite and within it after the bf16 rounding that verify applies.
MAX_ABS_VALUE = 2.0**24


@dataclass
class LayerDump:
    """One layer of a dump. ``kv`` keeps the file's dtype; ``queries`` may be None."""

    index: int
    kv: torch.Tensor
    positions: torch.Tensor | None = None
    queries: torch.Tensor | None = None


@dataclass
class KVDump:
    layers: list[LayerDump]
    model: str = "unknown"
    extra_metadata: dict[str, str] = field(default_factory=dict)

    def metadata(self) -> dict[str, str]:
        return file_metadata(DUMP_FORMAT, self.model, self.extra_metadata)


def file_metadata(file_format: str, model: str, extra: dict[str, str]) -> dict[str, str]:
    """SPEC section 8's metadata of a dump or FP8 cache file after the writer's ``extra`` keys,
    every value valid UTF-8, which the safetensors header must be: a source path that is not
    (``quantize $'caf\\xe9.st'``) is kept with its odd bytes escaped (``caf\\xe9.st``); it failed
    the write, after all the work."""
    meta = {**extra, "format": file_format, "version": FORMAT_VERSION, "kv_lora_rank": str(D_CONTENT),
            "rope_dim": str(D_ROPE), "model": model}
    return {key: _utf8_text(value) for key, value in meta.items()}


def _utf8_text(text: str) -> str:
    """``text`` with the bytes a non-UTF-8 file name left in it (surrogate escapes) as ``\\xNN``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text


def check_input_file(path: Path, what: str, expected: str = "a regular file") -> None:
    """Refuse, with one line naming ``what`` and ``path``, an input that is not a readable
    regular file, saying what it is instead: a missing path, a dangling symlink, a symlink loop,
    a folder, a fifo or device, a file without read permission. ``Path.is_file`` would call all
    but the folder "no such file", opening a fifo would wait forever for a writer, and the
    safetensors library reports a file it may not read as "No such file or directory"."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(path):
            raise SnapmlaError(f"{what} {path}: is a dangling symlink (to {os.readlink(path)}), "
                               f"expected {expected}") from None
        raise SnapmlaError(f"{what} {path}: no such file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SnapmlaError(f"{what} {path}: is a symlink loop, expected {expected}") from None
        raise SnapmlaError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise SnapmlaError(f"{what} {path}: is a folder, expected {expected}")
    if not stat.S_ISREG(mode):
        raise SnapmlaError(f"{what} {path}: is a {file_kind(mode)}, expected {expected}")
    if not os.access(path, os.R_OK):
        raise SnapmlaError(f"{what} {path}: cannot read it (permission denied)")


def _read_metadata(path: Path, what: str = "dump", expected: str = "a KV dump file (.safetensors)") -> dict[str, str]:
    """The safetensors metadata of the input file ``path`` (``what``: how errors name it)."""
    check_input_file(path, what, expected)
    try:
        with _utf8_path(path, what) as readable, safe_open(readable, framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        if _out_of_memory(exc):  # (safetensors maps the whole file: a valid 30 GB one is not "not safetensors")
            raise SnapmlaError(f"{what} {path}: cannot map its {_gib(path)} GiB into memory "
                               f"({_first_line(exc)})") from None
        raise SnapmlaError(f"{what} {path}: not a safetensors file ({_first_line(exc)})") from None


@contextmanager
def _utf8_path(path: Path, what: str) -> Iterator[str]:
    """``path`` as the UTF-8 text the safetensors library takes. A name that is not valid UTF-8
    (which snapmla writes: ``synth -o $'caf\\xe9.st'``) is read through ``/proc/self/fd/N`` of an
    open descriptor; without ``/proc`` it is refused, naming ``what``."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        yield str(path)
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        through = f"/proc/self/fd/{fd}"
        if not os.path.exists(through):
            raise SnapmlaError(f"{what} {path}: the path is not valid UTF-8, which the safetensors library "
                               "cannot open; expected a UTF-8 file name (rename the file)")
        yield through
    finally:
        os.close(fd)


def _out_of_memory(exc: BaseException) -> bool:
    """Whether a reader's error is the host's memory running out (errno 12, as the OS error or
    in the safetensors library's message)."""
    return isinstance(exc, MemoryError) or getattr(exc, "errno", None) == errno.ENOMEM or "(os error 12)" in str(exc)


def _gib(path: Path) -> str:
    return f"{path.stat().st_size / 2**30:,.1f}"


@contextmanager
def named_input(what: str, path: Path) -> Iterator[None]:
    """Prefix the errors about the file's contents (``{path}: ...``) with the argument that gave
    it, as the errors about the file itself already are (``DUMP {path}: no such file``): the
    likeliest mistake, an FP8 cache or another safetensors file given as a dump, must name the
    argument too, not only the path."""
    try:
        yield
    except SnapmlaError as exc:
        message = str(exc)
        if message.startswith(f"{path}:"):
            exc.args = (f"{what} {message}",)
        raise


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _check_format(path: Path, meta: dict[str, str], expected: str) -> None:
    """The metadata names ``expected`` as format and a version this code reads (a future version
    may lay the same tensor names out differently, so reading it anyway could be silently wrong),
    and holds every other key SPEC section 8 lists (:data:`REQUIRED_METADATA`) with the widths
    snapmla supports: a file without ``kv_lora_rank`` / ``rope_dim`` does not say how its 576
    columns split into content and RoPE, and one without ``model`` is not a writer's of SPEC's."""
    if meta.get("format") != expected:
        raise SnapmlaError(
            f"{path}: not a {expected} file (metadata format={show(meta.get('format'))})"
        )
    if meta.get("version") != FORMAT_VERSION:
        raise SnapmlaError(
            f"{path}: metadata version={show(meta.get('version'))}, expected {FORMAT_VERSION!r} "
            f"(the only {expected} version this snapmla reads)"
        )
    for key in REQUIRED_METADATA:
        if key not in meta:
            raise SnapmlaError(
                f"{path}: metadata has no {key!r}, expected the keys {', '.join(REQUIRED_METADATA)} "
                f"of a {expected} file (SPEC section 8)"
            )
    for key, want in (("kv_lora_rank", str(D_CONTENT)), ("rope_dim", str(D_ROPE))):
        if meta[key] != want:
            raise SnapmlaError(f"{path}: {key}={shorten(meta[key], 40)} but snapmla supports {want}")


def _with_tensors(path: Path, what: str, read: Callable[[Any], _T]) -> _T:
    """``read(handle)`` on ``path`` opened by safetensors' ``safe_open`` (the header parsed, no
    tensor read until ``read`` asks); the library's failures become one line naming ``what`` the
    file should be, running out of host memory its own line, and snapmla's errors pass as they are."""
    try:
        with _utf8_path(path, what) as readable, safe_open(readable, framework="pt") as handle:
            return read(handle)
    except SnapmlaError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError, MemoryError) as exc:
        if _out_of_memory(exc):
            raise SnapmlaError(f"{path}: loading {what} of {_gib(path)} GiB ran out of host memory "
                               f"({_first_line(exc)})") from None
        raise SnapmlaError(f"{path}: unreadable {what} ({_first_line(exc)})") from None


def layer_keys(path: Path, key_pattern: re.Pattern[str], what: str) -> dict[tuple[int, str], str]:
    """The file's tensor names by (layer index, part), ``layers.{i}.{part}``, from its header
    alone; an unexpected key, a non-canonical or repeated layer number, or a file without layers
    is a one-line error naming ``what`` it should be. Keys are matched whole (``fullmatch``):
    ``re.match`` with ``$`` would accept a key ending in a newline, which then reads as a
    misspelt layer number rather than a foreign tensor."""
    names: list[str] = _with_tensors(path, what, lambda handle: list(handle.keys()))
    keys: dict[tuple[int, str], str] = {}
    for key in names:
        match = key_pattern.fullmatch(key)
        if match is None:
            raise SnapmlaError(f"{path}: unexpected tensor {show(key)} in {what}")
        if len(match.group(1)) > MAX_DIGITS:  # int() of more than 4,300 digits raises
            raise SnapmlaError(f"{path}: tensor {shorten(key)!r} has a layer number of {len(match.group(1))} "
                               f"digits, expected at most {MAX_DIGITS}")
        slot = (int(match.group(1)), match.group(2))
        if slot in keys:
            raise SnapmlaError(
                f"{path}: tensors {show(keys[slot])} and {show(key)} both name layer {slot[0]}'s {slot[1]}"
            )
        keys[slot] = key
    for (index, part), key in keys.items():  # (after the duplicates: layers.0.kv beside layers.00.kv is one)
        _check_canonical(path, key, index, part)
    if not keys:
        raise SnapmlaError(f"{path}: {what} holds no layers")
    return keys


def _stored_bytes(handle: Any, key: str) -> int:
    """Bytes of tensor ``key`` as the header describes it (``BF16`` [n, 576]: 1152 n), without
    reading it: what loading it takes in host memory."""
    tensor = handle.get_slice(key)
    bits = re.search(r"\d+", tensor.get_dtype())  # BF16, F8_E4M3, I64, F4; BOOL has none (a byte)
    return math.ceil(math.prod(tensor.get_shape()) * (int(bits.group()) if bits else 8) / 8)


def load_layers(path: Path, key_pattern: re.Pattern[str], what: str) -> dict[int, dict[str, torch.Tensor]]:
    """Every tensor of the file, grouped by layer index, ``{i: {part: t}}``, its keys checked
    (:func:`layer_keys`)."""
    return read_layers(path, layer_keys(path, key_pattern, what), what)


def read_layers(path: Path, keys: dict[tuple[int, str], str], what: str,
                layers: Collection[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """The tensors of ``layers`` (default: all of ``keys``, the file's checked :func:`layer_keys`),
    grouped by layer index, ``{i: {part: t}}``. Only the layers asked for are read: ``verify
    --dump`` uses one layer of a 61-layer dump, whose other layers used to be read and checked
    too (the whole file in host memory for a sixtieth of it). A layer asked for that the file
    lacks is simply absent from the result."""
    wanted = {slot: key for slot, key in keys.items() if layers is None or slot[0] in layers}

    def read(handle: Any) -> dict[tuple[int, str], torch.Tensor]:
        needed = sum(_stored_bytes(handle, key) for key in wanted.values())
        require_host_memory(f"{path}: loading {what}", needed)
        try:
            return {slot: handle.get_tensor(key) for slot, key in wanted.items()}
        except (SafetensorError, OSError, RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            # (the bytes asked for: one layer of a large file is not the file's size)
            raise SnapmlaError(f"{path}: loading {what} of {needed / 2**30:,.1f} GiB ran out of host memory "
                               f"({_first_line(exc)})") from None

    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for (index, part), tensor in _with_tensors(path, what, read).items():
        by_layer.setdefault(index, {})[part] = tensor
    return by_layer


def check_layer_indices(path: Path, what: str, indices: list[object]) -> None:
    """What a writer is given must be what its reader takes back (SPEC section 8's
    ``layers.<i>.*``, ``load_layers``): at least one layer, each index an int >= 0, none twice.
    A repeated index overwrote the earlier layer's tensors; an empty list or a negative index
    wrote a file the reader refuses."""
    if not indices:
        raise SnapmlaError(f"{path}: {what} holds no layers")
    seen: set[int] = set()
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise SnapmlaError(f"{path}: layer index {index!r}: expected an integer >= 0")
        if index in seen:
            raise SnapmlaError(f"{path}: layer {index} given twice")
        seen.add(index)


def _check_canonical(path: Path, key: str, index: int, part: str) -> None:
    """Layer numbers are written without leading zeros: ``layers.00.kv`` is refused, not read as
    layer 0, so that one layer can never have two spellings of which one would be dropped."""
    canonical = f"layers.{index}.{part}"
    if key != canonical:
        raise SnapmlaError(
            f"{path}: tensor {show(key)} has a non-canonical layer number, expected {canonical!r}"
        )


# what a value too large is refused for (check_values, and the capture's check of what a model
# produced)
VALUE_LIMIT = f"expected |x| <= {MAX_ABS_VALUE:.3g} so that the FP8 pipeline cannot overflow"


# rows of a tensor first_bad_row checks at once, in elements: its float32 copy and that copy's
# |x| are 32 MiB each, where the whole layer's (two float32 copies of a bf16 layer: 4x the layer,
# 1.35 GB at 256k tokens) had made reading a dump take several times the file size it checks
# host memory for
CHECK_CHUNK_ELEMENTS = 1 << 23


def first_bad_row(x: torch.Tensor) -> tuple[int, float] | None:
    """The first row (index along dim 0) of ``x`` holding NaN/inf or a |value| above
    :data:`MAX_ABS_VALUE`, with its largest |value| (inf or NaN where it holds one); None when
    every value is fine. Shared by :func:`check_values` and the capture, which names the model
    and prompt rather than a file."""
    if x.numel() == 0:
        return None
    rows = x.detach().reshape(x.shape[0], -1)
    step = max(1, CHECK_CHUNK_ELEMENTS // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        magnitude = rows[start:start + step].float().abs()
        ok = (magnitude <= MAX_ABS_VALUE).all(dim=1)  # False for NaN as well
        if bool(ok.all()):
            continue
        offset = int((~ok).nonzero()[0])
        values = magnitude[offset]
        finite = bool(torch.isfinite(values).all())
        return start + offset, float(values.max()) if finite else math.nan
    return None


def check_values(where: str, name: str, x: torch.Tensor, row: str = "token") -> None:
    """Refuse NaN/inf and any |value| above :data:`MAX_ABS_VALUE` in ``x``, naming ``name`` and
    the first bad ``row`` (index along dim 0): such values quantize to inf/NaN scales or RoPE and
    poison every later decode instead of failing here."""
    bad = first_bad_row(x)
    if bad is None:
        return
    first, value = bad
    if not math.isfinite(value):
        raise SnapmlaError(f"{where}: {name} holds NaN/inf (first at {row} {first})")
    raise SnapmlaError(
        f"{where}: {name} holds |x| = {value:.3g} at {row} {first}, {VALUE_LIMIT}"
    )


def check_float_dtype(where: str, name: str, x: torch.Tensor) -> None:
    """``x`` must have one of :data:`KV_DTYPES`; other dtypes would be cast silently downstream."""
    if x.dtype not in KV_DTYPES:
        raise SnapmlaError(f"{where}: {name} dtype {dtype_name(x.dtype)}, expected bfloat16, float16 or float32")


def _validate_layer(path: Path, layer: LayerDump) -> None:
    where = f"{path}: layer {layer.index}"
    kv = layer.kv
    if kv.dim() != 2 or kv.shape[1] != D_QK:
        raise SnapmlaError(f"{where}: kv has shape {tuple(kv.shape)}, expected [tokens, {D_QK}]")
    check_float_dtype(where, "kv", kv)
    if kv.shape[0] == 0:
        raise SnapmlaError(f"{where}: kv is empty (0 tokens)")
    check_values(where, "kv", kv)
    if layer.positions is not None:
        _validate_positions(where, layer.positions, kv.shape[0])
    if layer.queries is not None:
        _validate_queries(where, layer.queries)


def _validate_positions(where: str, positions: torch.Tensor, tokens: int) -> None:
    """Integer, one per token, >= 0. SPEC section 8 asks for nothing more: positions restart at 0
    per prompt in a capture and a dump may start mid-sequence, so neither order nor an upper bound
    is required."""
    if positions.dtype not in _POSITION_DTYPES:
        raise SnapmlaError(
            f"{where}: positions dtype {dtype_name(positions.dtype)}, expected one of the integer dtypes "
            f"{_POSITION_DTYPE_NAMES} (int64 as written)"
        )
    if tuple(positions.shape) != (tokens,):
        raise SnapmlaError(
            f"{where}: positions has shape {tuple(positions.shape)}, expected [{tokens}]"
        )
    negative = (positions < 0).nonzero()
    if negative.numel():
        first = int(negative[0])
        raise SnapmlaError(
            f"{where}: positions holds {int(positions[first])} at token {first}, expected >= 0"
        )


def _validate_queries(where: str, q: torch.Tensor) -> None:
    """``[n, h_q, 576]`` with n, h_q >= 1 (an absent tensor means no queries; an empty one would
    give empty means, i.e. division by zero, in the metrics) and the kv dtypes and value range,
    as the queries go through the same quantizer."""
    shape = tuple(q.shape)
    if q.dim() != 3 or q.shape[2] != D_QK:
        raise SnapmlaError(f"{where}: queries has shape {shape}, expected [n, h_q, {D_QK}]")
    for axis, name in ((0, "n"), (1, "h_q")):
        if q.shape[axis] < 1:
            raise SnapmlaError(f"{where}: queries has shape {shape}, expected {name} >= 1")
    check_float_dtype(where, "queries", q)
    check_values(where, "queries", q, row="query")


def dump_layer_indices(path: Path, what: str = "dump") -> list[int]:
    """The layer indices of the KV dump at ``path``, ascending, from its metadata and header
    alone (format, keys, a ``kv`` tensor per layer checked; no tensor read), so that a caller
    that needs one layer can name the ones there are before reading it."""
    path = Path(path)
    _check_format_at(path, what)
    with named_input(what, path):
        return _indices_with_kv(path, layer_keys(path, _KEY, "a KV dump"))


def _check_format_at(path: Path, what: str) -> dict[str, str]:
    """The metadata of the dump at ``path``, checked to be a KV dump's of this version."""
    meta = _read_metadata(path, what)
    with named_input(what, path):
        _check_format(path, meta, DUMP_FORMAT)
    return meta


def _indices_with_kv(path: Path, keys: Collection[tuple[int, str]]) -> list[int]:
    """The layer indices among ``keys``; every layer must have its ``kv`` (positions and queries
    are optional)."""
    indices = sorted({index for index, _ in keys})
    for index in indices:
        if (index, "kv") not in keys:
            raise SnapmlaError(f"{path}: layer {index} has no 'layers.{index}.kv' tensor")
    return indices


def read_dump(path: Path, what: str = "dump", layers: Collection[int] | None = None) -> KVDump:
    """Load and validate a KV dump; every problem is a one-line :class:`SnapmlaError`. ``what``
    names the input in every error about the file or its contents: the CLI passes the argument
    that gave the path (``DUMP``, ``--dump``). ``layers`` reads and validates those layers only
    (each must be in the file; the others' keys are still checked): what ``verify --dump`` needs
    of a whole model's dump."""
    path = Path(path)
    wanted = None if layers is None else set(layers)  # (once: a generator would be used up)
    if wanted is not None and not wanted:
        raise SnapmlaError("layers: expected at least one layer index, or None for all")
    meta = _check_format_at(path, what)
    with named_input(what, path):
        keys = layer_keys(path, _KEY, "a KV dump")
        indices = _indices_with_kv(path, keys)
        missing = sorted(wanted - set(indices)) if wanted is not None else []
        if missing:
            raise SnapmlaError(f"{path}: no layer {missing[0]}; the dump has layers {_index_list(indices)}")
        by_layer = read_layers(path, keys, "a KV dump", wanted)
        loaded = []
        for index in sorted(by_layer):
            parts = by_layer[index]
            layer = LayerDump(index, parts["kv"], parts.get("positions"), parts.get("queries"))
            _validate_layer(path, layer)
            loaded.append(layer)
    extra = {k: v for k, v in meta.items() if k not in REQUIRED_METADATA}
    return KVDump(layers=loaded, model=meta["model"], extra_metadata=extra)


def _index_list(indices: list[int], most: int = 12) -> str:
    """``0, 1, 2`` or, for a long list, its first and last few: ``0, 1, ..., 60`` (61 layers)."""
    if len(indices) <= most:
        return ", ".join(map(str, indices))
    half = most // 2
    return f"{', '.join(map(str, indices[:half]))}, ..., {', '.join(map(str, indices[-half:]))} ({len(indices)} layers)"


def write_dump(dump: KVDump, path: Path, force: bool = False) -> None:
    """Write ``dump`` atomically as SPEC section 8 describes; refuses to overwrite ``path``
    without ``force``, also when the file appeared while the dump was being made."""
    path = Path(path)
    check_writable(path, force)
    check_layer_indices(path, "a KV dump", [layer.index for layer in dump.layers])
    tensors: dict[str, torch.Tensor] = {}
    for layer in dump.layers:
        _validate_layer(path, layer)
        tensors[f"layers.{layer.index}.kv"] = layer.kv.contiguous()
        if layer.positions is not None:
            tensors[f"layers.{layer.index}.positions"] = layer.positions.to(torch.int64).contiguous()
        if layer.queries is not None:
            tensors[f"layers.{layer.index}.queries"] = layer.queries.contiguous()
    meta = dump.metadata()
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), replace=force)
