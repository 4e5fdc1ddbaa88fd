"""Run-time lookup in the tuning database: exact GPU, then the nearest bucket, else None (the
caller falls back to the built-in heuristic).

Hot path: :func:`lookup_decode_config` is called by ``choose_config`` on every decode call that
gets no explicit config, so it never does I/O after the first call per device: the matching
entries are parsed once per device (``$SNAPMLA_TUNING_DIR`` is read then; :func:`clear_cache`
re-reads) and kept in memory, and each
``(rows, fp8, batch, context)`` answer is memoised. It never raises: an unreadable or corrupt
file gives one ``warnings.warn`` naming it (once per process) and is ignored.

Distance between a query ``(rows, batch, context)`` and an entry (all in log2 units):

1. rows (``h_q * s_q``): 0 when equal, else ``|log2(rows_entry / rows)|``; entries more than a
   factor of 2 away are never used (a tile plan for 16 rows says little about 128);
2. batch + context: 0 inside the entry's range, else the log2 distance to the nearest end of the
   range; an unknown value (``None``) counts 0.

The smallest (rows distance, shape distance) wins; on a tie an entry of the query's own
``s_q`` beats one of another ``s_q`` with the same rows (h_q 32 s_q 1 against h_q 16 s_q 2; only
when the caller knows ``s_q``: FlashMLA's ``get_mla_metadata`` passes just the rows), then the
user's database beats the shipped one, then a section with the same CUDA driver major beats
another, then the configuration shared by most tied entries wins (e.g. a context-agnostic query over four
context buckets takes the config most of them chose), then the first bucket in sort order.
A config whose row groups exceed what the query's rows need is narrowed to fit. Batch and
context are rounded to 1/16 of an octave (~4%) first, so that the answer is memoised even while
the context grows by one token per decode step; the rounding never moves a value across the end
of an entry's range (a context of 16,385 stays outside a range ending at 16,384).
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import SnapmlaError
from ..ops.decode_config import WG_ALT_PAGES, WG_ROWS_M_MODES, DecodeConfig, pads_row_tile
from ..sizes import counted
from .db import (
    TUNING_DIR_ENV,
    DbError,
    Entry,
    GpuKey,
    db_filename,
    entries_for,
    folder_problem,
    load_file,
    search_dirs,
)
from .space import Bucket, config_id, config_problem, max_row_groups

MAX_ROWS_LOG2 = 1.0  # use entries tuned for at most 2x more or fewer rows
_MEMO_LIMIT = 4096
_MISS = object()


@dataclass(frozen=True)
class Located:
    """An entry and where it came from."""

    entry: Entry
    path: Path
    origin: str  # "user" or "shipped"
    gpu: GpuKey  # the section's key

    @property
    def origin_rank(self) -> int:
        return 0 if self.origin == "user" else 1


@dataclass
class _DeviceState:
    gpu: GpuKey | None
    located: list[Located]
    memo: dict[tuple[Any, ...], DecodeConfig | None]
    # where a batch / context enters or leaves some entry's range (a range [lo, hi] gives lo and
    # hi + 1), sorted: a rounded query stays on its side of each of them (_QueryValue)
    batch_edges: list[int] = field(default_factory=list)
    context_edges: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, edges in (("batch", self.batch_edges), ("context", self.context_edges)):
            ranges = [getattr(loc.entry.bucket, name) for loc in self.located]
            edges[:] = sorted({lo for lo, _ in ranges} | {hi + 1 for _, hi in ranges})


_STATE: dict[int, _DeviceState] = {}  # by CUDA device index
_FAST: dict[Any, _DeviceState] = {}  # by the caller's torch.device (explicit index only)
_WARNED: set[str] = set()
# Bumped by clear_cache: a state read from the files before a clear is not cached after it. A
# first lookup parses for about 0.1 s; a `clear_cache()` after `snapmla tune` wrote the file
# landing in that time was undone by the lookup's late store, and the old answer stayed.
_GENERATION = [0]
_STORE_LOCK = threading.Lock()


_CLEAR_HOOKS: list[Callable[[], None]] = []


def on_cache_cleared(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever :func:`clear_cache` runs: a cache holding an answer of the
    database (the decode calls' launch plans) drops it too."""
    _CLEAR_HOOKS.append(hook)


def clear_cache(reset_warnings: bool = False) -> None:
    """Forget parsed databases: after ``snapmla tune`` wrote one, or after changing
    ``$SNAPMLA_TUNING_DIR`` inside a running process (the folders are read once per device).
    The decode calls' launch plans go too: a plan keeps the configuration the database gave
    when it was made (a work list snapmla did not build, e.g. an engine's static buffer)."""
    with _STORE_LOCK:
        _GENERATION[0] += 1
        _STATE.clear()
        _FAST.clear()
    if reset_warnings:
        _WARNED.clear()
    for hook in _CLEAR_HOOKS:
        hook()


def _warn_once(key: str, message: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# loading


def load_located(gpu: GpuKey | None = None, name: str | None = None) -> list[Located]:
    """Entries of the sections matching ``gpu`` (same model) or, given only ``name``, any
    section of that GPU name; user folder first, then (given ``gpu``) the sections of its CUDA
    driver major before the others. Bad files warn once and are skipped."""
    gpu_name = gpu.name if gpu is not None else name
    if gpu_name is None:
        return []
    out: list[Located] = []
    for origin, folder in search_dirs():
        note = folder_problem(folder)
        if note:
            if origin != "user" or os.environ.get(TUNING_DIR_ENV):
                _warn_once(str(folder), f"snapmla tuning database folder {folder} ({origin}) ignored: {note}")
            continue
        path = folder / db_filename(gpu_name)
        try:  # (a fifo or a folder of the file's name is there: load_file refuses it, with a warning)
            path.lstat()  # lstat: a symlink loop is there too (exists() said no, and nothing warned)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:  # a folder that may not be entered: ignored, but not in silence
            _warn_once(str(path), f"snapmla tuning database ignored: {path}: {type(exc).__name__}: {exc}")
            continue
        try:
            loaded = load_file(path)
        except DbError as exc:
            _warn_once(str(path), f"snapmla tuning database ignored: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - never let a bad file break a decode call
            _warn_once(str(path), f"snapmla tuning database ignored: {path}: "
                                  f"{type(exc).__name__}: {exc}")
            continue
        if loaded.problems:
            _warn_once(str(path), f"snapmla tuning database {path}: skipped "
                                  f"{counted(len(loaded.problems), 'bad entry', 'bad entries')} "
                                  f"({loaded.problems[0]})")
        for section in loaded.sections:
            match = (section.gpu.same_gpu(gpu) if gpu is not None
                     else section.gpu.name.strip() == gpu_name.strip())
            if match:
                out += [Located(e, path, origin, section.gpu) for e in section.entries]
    if gpu is not None:  # the lookup's order: within a folder, this CUDA driver's sections first
        out.sort(key=lambda loc: (loc.origin_rank, _driver_rank(loc, gpu)))  # (stable: file order next)
    return out


def _driver_rank(loc: Located, gpu: GpuKey | None) -> int:
    """0 for an entry of a section with ``gpu``'s CUDA driver major (or no ``gpu``), else 1: the
    lookup's tie-break after the folder. The lists of entries (``stored_entries``, ``snapmla info``,
    ``--stale``) come in that order too, so that the first entry of a bucket is the one the lookup
    takes: a file gets the section of a new driver appended after the old one, whose stale entries
    ``--stale`` then re-timed on every run while the lookup answered from the new section."""
    return 0 if gpu is None or loc.gpu.cuda_driver_major == gpu.cuda_driver_major else 1


def _as_device(device: Any) -> Any:
    """``device`` as a torch.device (a string or an int parsed once)."""
    import torch

    return device if isinstance(device, torch.device) else torch.device(device)


def _device_index(device: Any) -> int | None:
    import torch

    device = _as_device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def device_gpu_key(index: int) -> GpuKey:
    """The database key of CUDA device ``index``: NVML's name and driver (matched by UUID),
    torch's SM count and compute capability."""
    import torch

    props = torch.cuda.get_device_properties(index)
    name, driver = str(props.name), None
    from ..runtime.gpu_facts import list_gpus, nvml_uuid

    uuid = nvml_uuid(props)
    try:
        listing = list_gpus().gpus
    except Exception:  # noqa: BLE001 - NVML trouble only loses the driver preference
        listing = []
    for facts in listing:
        if uuid is not None and facts.uuid == uuid:
            name, driver = facts.name, facts.cuda_driver_major
            break
    if driver is None:
        try:
            driver = int(torch._C._cuda_getDriverVersion()) // 1000  # type: ignore[attr-defined]  # no public call
        except Exception:  # noqa: BLE001
            driver = None
    return GpuKey(name, int(props.multi_processor_count), (int(props.major), int(props.minor)),
                  driver)


def _state_for(device: Any) -> _DeviceState | None:
    state = _FAST.get(device)  # hot path: one dict lookup
    if state is not None:
        return state
    parsed = _as_device(device)
    index = _device_index(parsed)
    if index is None:
        return None
    state = _STATE.get(index)
    if state is None:
        generation = _GENERATION[0]
        gpu = _device_key_hook(index)
        state = _DeviceState(gpu, load_located(gpu) if gpu is not None else [], {})
        with _STORE_LOCK:
            if generation != _GENERATION[0]:  # cleared while reading: answer, but keep nothing
                return state
            state = _STATE.setdefault(index, state)
    if _names_fixed_gpu(parsed):
        with _STORE_LOCK:
            if _STATE.get(index) is state:
                _FAST[device] = state
    return state


def _names_fixed_gpu(device: Any) -> bool:
    """Whether ``device`` names one GPU whatever the current device is (``cuda:1``,
    ``torch.device("cuda", 1)``, an int), so that its state may be cached under it: a bare
    "cuda" follows ``torch.cuda.current_device()`` (a string's ``index`` attribute is str.index,
    which once cached "cuda" as device 0 for good)."""
    return _as_device(device).index is not None


# Tests replace this to pretend to be a given GPU.
_device_key_hook = device_gpu_key


# ---------------------------------------------------------------------------------------------
# selection


def _range_distance(r: tuple[int, int], x: float | None) -> float:
    if x is None:
        return 0.0
    x = max(float(x), 1.0)
    if r[0] <= x <= r[1]:
        return 0.0
    return math.log2(r[0] / x) if x < r[0] else math.log2(x / r[1])


def bucket_distance(entry: Entry, rows: int, batch: float | None, context: float | None
                    ) -> tuple[float, float] | None:
    """(rows distance, batch + context distance), or None when the rows are too far apart."""
    d_rows = 0.0 if entry.bucket.rows == rows else abs(math.log2(entry.bucket.rows / rows))
    if d_rows > MAX_ROWS_LOG2 + 1e-12:
        return None
    return (d_rows, _range_distance(entry.bucket.batch, batch)
            + _range_distance(entry.bucket.context, context))


def select_entry(located: list[Located], rows: int, fmt: str, batch: float | None = None,
                 context: float | None = None, gpu: GpuKey | None = None,
                 s_q: int | None = None) -> Located | None:
    """The nearest entry for the query (module docstring), or None."""
    scored = []
    for loc in located:
        if loc.entry.bucket.format != fmt:
            continue
        dist = bucket_distance(loc.entry, rows, batch, context)
        if dist is None:
            continue
        driver_rank = _driver_rank(loc, gpu)
        other_s_q = 0 if s_q is None or loc.entry.bucket.s_q == s_q else 1
        scored.append((round(dist[0], 9), round(dist[1], 9), other_s_q, loc.origin_rank, driver_rank, loc))
    if not scored:
        return None
    best = min(s[:5] for s in scored)
    tied = [s[5] for s in scored if s[:5] == best]
    if len(tied) == 1:
        return tied[0]
    tied.sort(key=lambda loc: loc.entry.bucket.id)
    votes = Counter(loc.entry.config for loc in tied)
    top = max(votes.values())
    return next(loc for loc in tied if votes[loc.entry.config] == top)


def adapt_config(cfg: DecodeConfig, rows: int, fmt: str) -> DecodeConfig | None:
    """Narrow the row groups to what ``rows`` needs; None if the result is not launchable.
    Rows = M needs 64-row tiles: narrowed, it becomes plain alternate pages. A kernel that pads
    to its fixed tile (the BF16 wgmma one) is never narrowed."""
    if pads_row_tile(cfg, fmt == "fp8"):  # launchable at any row count as stored
        return None if config_problem(cfg, fmt) else cfg
    limit = max_row_groups(rows)
    if cfg.row_groups > limit:
        mode = WG_ALT_PAGES if cfg.wg_mode in WG_ROWS_M_MODES else cfg.wg_mode
        cfg = replace(cfg, row_groups=limit, wg_mode=mode)
    return None if config_problem(cfg, fmt, rows) else cfg


def _memo_value(x: float | None, edges: list[int]) -> tuple[int, int] | None:
    """A batch or context as its memo key: (1/16-octave step, which of the ``edges`` it lies
    between). The step lets the answer be memoised while the context grows by a token a decode
    step; the edge index keeps a value just inside a range from being rounded out of it."""
    if x is None:
        return None
    x = max(float(x), 1.0)
    return round(math.log2(x) * 16), bisect.bisect_right(edges, x)


def _from_memo(key: tuple[int, int] | None, edges: list[int]) -> float | None:
    """What is looked up for a memo key: its step's value, kept between its two edges."""
    if key is None:
        return None
    step, cell = key
    value = 2.0 ** (step / 16)
    if cell > 0:
        value = max(value, float(edges[cell - 1]))
    if cell < len(edges):
        value = min(value, float(edges[cell] - 1))
    return value


def lookup_decode_config(rows: int, fp8: bool, device: Any, batch: int | None = None,
                         context: float | None = None, s_q: int | None = None) -> DecodeConfig | None:
    """The tuned configuration for ``rows = s_q * h_q`` on ``device`` (nearest bucket of this
    exact GPU model), or None: no entry, a CPU device, or any problem (warned once). ``batch``
    (requests), ``context`` (e.g. mean cached tokens per request) and ``s_q`` refine the choice
    when given. The split policy's SM count is left for the caller to fill in."""
    try:
        state = _state_for(device)
        if state is None or not state.located:
            return None
        kb, kc = _memo_value(batch, state.batch_edges), _memo_value(context, state.context_edges)
        key = (rows, bool(fp8), kb, kc, s_q)
        hit = state.memo.get(key, _MISS)
        if hit is not _MISS:
            return hit  # type: ignore[return-value]
        fmt = "fp8" if fp8 else "bf16"
        loc = select_entry(state.located, rows, fmt, _from_memo(kb, state.batch_edges),
                           _from_memo(kc, state.context_edges), state.gpu, s_q)
        cfg = None if loc is None else adapt_config(loc.entry.config, rows, fmt)
        if len(state.memo) >= _MEMO_LIMIT:
            state.memo.clear()
        state.memo[key] = cfg
        return cfg
    except Exception as exc:  # noqa: BLE001 - the heuristic is always a valid answer
        # keyed by the failure's type: one key for all once hid a different failure for good (the
        # message would key a new warning per bad value on the hot path)
        _warn_once(f"lookup: {type(exc).__name__}", f"snapmla tuning lookup failed ({type(exc).__name__}: {exc}); "
                             "using the built-in heuristic")
        return None


# ---------------------------------------------------------------------------------------------
# `snapmla info`


def matching_entries(gpu: Any) -> list[Located]:
    """Entries that apply to ``gpu``: a :class:`GpuFacts` (or anything with ``name``,
    ``sm_count``, ``compute_capability``), a :class:`GpuKey`, or a plain NVML name (then every
    section of that name). User folder first. Never raises."""
    try:
        if isinstance(gpu, str):
            return load_located(name=gpu)
        key = gpu if isinstance(gpu, GpuKey) else GpuKey.from_facts(gpu)
        if key.sm_count is None:  # torch could not count SMs: match name + capability only
            return [loc for loc in load_located(name=key.name)
                    if tuple(loc.gpu.compute_capability) == tuple(key.compute_capability)]
        return load_located(key)
    except Exception as exc:  # noqa: BLE001
        _warn_once(f"matching: {type(exc).__name__}", f"snapmla tuning database: {type(exc).__name__}: {exc}")
        return []


def entry_line(loc: Located, stale: str | None = None) -> str:
    e = loc.entry
    return (f"{e.bucket.label()}: {config_id(e.config, e.bucket.format)} {e.time_us:.1f} us, "
            f"{e.speedup:.2f}x vs default ({e.date or 'undated'}, {loc.origin})"
            + (f" [stale: timed with {stale}]" if stale else ""))


def kernel_stamp() -> str | None:
    """The kernel sources' stamp that entries are compared with (None: no kernel sources here,
    or one that cannot be read)."""
    from ..runtime.nvrtc import kernel_sources_stamp

    return kernel_sources_stamp()[0]


def stale_reasons(found: list[Located], sm_count: int | None, kernels: str | None) -> list[str | None]:
    """Per entry, why a resumed ``snapmla tune`` would re-time it (None: current): after an
    upgrade changes the kernels or the built-in heuristic, ``snapmla info`` shows which stored
    times no longer describe what the default would run. Without an SM count only the kernel
    sources are compared (the default depends on the SMs); without kernel sources (``kernels``
    None, :func:`kernel_stamp`) nothing is marked."""
    if kernels is None:  # nothing to compare with (info still lists the entries)
        return [None] * len(found)
    return [loc.entry.stale_reason(kernels, _today_default(loc.entry.bucket, sm_count)) for loc in found]


def _today_default(bucket: Bucket, sm_count: int | None) -> DecodeConfig | None:
    """The built-in heuristic's configuration for ``bucket`` (None: no SM count, or a bucket the
    heuristic cannot place; then only the kernel sources are compared)."""
    from .space import default_config

    try:
        return None if sm_count is None else default_config(bucket, sm_count)
    except SnapmlaError:
        return None


def stale_buckets(gpu: GpuKey, formats: list[str], folder: Path | None = None) -> list[tuple[Bucket, str]]:
    """(bucket, why) of the entries for ``gpu`` that are stale, in ``formats``: per bucket the
    entry the lookup would take (the user's before the shipped one), as ``snapmla tune --stale``
    re-times them; given ``folder`` (``--db-dir``, where the new entries land), that folder's
    entries alone, so that what is re-timed is what gets replaced. Order: entries timed against another default first (their configuration may
    now be slower than what the heuristic runs), then FP8 before BF16 (the product before its
    baseline), then the file's order; a re-timing cut short by time does the urgent ones."""
    kernels = kernel_stamp()
    if kernels is None:  # nothing to compare with, as in stale_reasons
        return []
    out: list[tuple[tuple[bool, bool], Bucket, str]] = []
    for bucket, entry in stored_entries(gpu, folder).items():
        if bucket.format not in formats:
            continue
        today = _today_default(bucket, gpu.sm_count)
        why = entry.stale_reason(kernels, today)
        if why is not None:
            out.append(((not entry.default_moved(today), not bucket.fp8), bucket, why))
    return [(bucket, why) for _, bucket, why in sorted(out, key=lambda item: item[0])]


def stored_entries(gpu: GpuKey, folder: Path | None = None) -> dict[Bucket, Entry]:
    """Per bucket, the entry of exactly that bucket that the lookup takes for ``gpu`` (the user's
    folder before the shipped one): ``snapmla tune`` measures its configuration right after the
    default, so a user's first run starts from what the shipped database found. Given
    ``folder``, that folder's entries for exactly ``gpu`` (:func:`~.db.entries_for`, as the run's
    resume check reads them, so that a re-timed entry replaces the stale one)."""
    if folder is not None:
        return entries_for(folder, gpu)
    found: dict[Bucket, Entry] = {}
    for loc in matching_entries(gpu):
        found.setdefault(loc.entry.bucket, loc.entry)
    return found


def file_problem(path: Path) -> str | None:
    """Why a database file is skipped, whole or in part (None: it reads cleanly), without the
    path that the loader's messages start with: the caller names the file once."""
    try:
        loaded = load_file(path)
    except Exception as exc:  # noqa: BLE001 - reported, as the decode path would skip it
        return " ".join(str(exc).removeprefix(f"{path}: ").split()) or type(exc).__name__
    if loaded.problems:
        return f"{counted(len(loaded.problems), 'bad entry', 'bad entries')} skipped ({loaded.problems[0]})"
    if loaded.unknown:  # read past by the lookup, but `snapmla tune` would refuse to rewrite it
        return (f"{counted(len(loaded.unknown), 'field')} this snapmla does not know ({loaded.unknown[0]}): "
                "read past; `snapmla tune` will not rewrite the file without --force")
    return None


def _shadowed(found: list[Located]) -> set[int]:
    """The indices of ``found`` (lookup order) whose bucket an earlier entry already holds: the
    lookup never takes them, nor does a plain ``snapmla tune --stale``."""
    seen: set[Bucket] = set()
    hidden: set[int] = set()
    for i, loc in enumerate(found):
        if loc.entry.bucket in seen:
            hidden.add(i)
        seen.add(loc.entry.bucket)
    return hidden


@dataclass(frozen=True)
class GpuEntries:
    """The entries that apply to one GPU (lookup order) and, per entry, why it is stale."""

    gpu: Any  # a GpuFacts
    found: list[Located]
    stale: list[str | None]


@dataclass(frozen=True)
class DatabaseSurvey:
    """What ``snapmla info`` reports of the database, as text or as JSON: the folders searched
    with why one cannot be used, the files skipped whole or in part, and per GPU its entries."""

    folders: list[tuple[str, Path, str | None]]  # origin, folder, problem (None: usable or absent)
    skipped_files: list[tuple[Path, str]]
    gpus: list[GpuEntries]
    files: list[str]  # the database files' names in the usable folders

    def as_dict(self) -> dict[str, Any]:
        return {
            "folders": [{"origin": o, "path": str(p), "problem": why} for o, p, why in self.folders],
            "skipped_files": [{"path": str(p), "problem": why} for p, why in self.skipped_files],
            "files": self.files,
            "gpus": [{"index": g.gpu.index, "name": g.gpu.name, "entries": [
                {"file": str(loc.path), "origin": loc.origin, "stale": why, **loc.entry.as_dict()}
                for loc, why in zip(g.found, g.stale)]} for g in self.gpus],
        }


def survey_database(gpus: list[Any], kernels: str | None) -> DatabaseSurvey:
    """The folders, the files that are skipped, and per GPU the entries that apply, marked stale
    against the kernel sources' stamp ``kernels`` (:func:`kernel_stamp`; None: nothing is
    marked), which the caller reads once for its other uses too."""
    dirs = search_dirs()
    folders = [(o, p, folder_problem(p) or ("missing" if not p.exists() and o == "user"
                                           and os.environ.get(TUNING_DIR_ENV) else None)) for o, p in dirs]
    usable = [p for _, p, why in folders if not why and p.is_dir()]
    skipped: list[tuple[Path, str]] = []
    names: set[str] = set()
    for folder in usable:  # (a folder with a problem is named above; stat()ing it again may raise)
        for path in sorted(folder.glob("*.yaml")):
            names.add(path.name)
            if problem := file_problem(path):
                skipped.append((path, problem))
    per_gpu = []
    for g in gpus:
        with warnings.catch_warnings():  # the skipped files are lines of the survey already: a
            warnings.simplefilter("ignore", RuntimeWarning)  # raw warning beside them said it twice
            found = matching_entries(g)
        per_gpu.append(GpuEntries(g, found, stale_reasons(found, g.sm_count, kernels)))
    return DatabaseSurvey(folders, skipped, per_gpu, sorted(names))


def describe_database(gpus: list[Any]) -> list[str]:
    """Lines for ``snapmla info``: the folders searched (and why one cannot be read), the files
    that are skipped, and, per GPU, the entries that apply."""
    return describe_survey(survey_database(gpus, kernel_stamp() if gpus else None))


def describe_survey(survey: DatabaseSurvey) -> list[str]:
    """The lines of :func:`describe_database` for a survey already made (``snapmla info`` makes
    one for its lines and its ``--json`` alike)."""
    lines = ["tuning database folders: " + ", ".join(
        f"{o} {p}" + (f" ({why}: ignored)" if why else "") for o, p, why in survey.folders)]
    lines += [f"tuning file {path}: {problem}" for path, problem in survey.skipped_files]
    for g in survey.gpus:
        if not g.found:
            lines.append(f"tuning entries for {g.gpu.name}: none (the built-in heuristic is used)")
            continue
        files = sorted({str(loc.path) for loc in g.found})
        lines.append(f"tuning entries for {g.gpu.name}: {len(g.found)} ({', '.join(files)})")
        lines += ["  " + entry_line(loc, why) for loc, why in zip(g.found, g.stale)]
        if stale := sum(why is not None for why in g.stale):
            lines.append(f"  {stale} of {len(g.found)} entries are stale (timed with other kernel sources or against "
                         "another default): they still apply; `snapmla tune --stale` re-times them")
            shadowed = _shadowed(g.found)
            hidden = [i for i, why in enumerate(g.stale) if why is not None and i in shadowed]
            if hidden:
                driver = GpuKey.from_facts(g.gpu).cuda_driver_major
                other = sum(g.found[i].gpu.cuda_driver_major != driver for i in hidden)
                line = (f"  {len(hidden)} of the stale entries are shadowed by an earlier entry of the same bucket: "
                        "`snapmla tune --stale --db-dir FOLDER` re-times a folder's own")
                if other:  # (--stale, --db-dir or not, re-times this driver's section only)
                    line += (f"; {counted(other, 'is', 'are')} in a section of another CUDA driver, which only a "
                             "run on that driver re-times")
                lines.append(line)
    if not survey.gpus:
        lines.append("tuning files: " + (", ".join(survey.files) if survey.files else "none"))
    return lines
