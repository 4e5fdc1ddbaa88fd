"""The tuning database (SPEC section 9): YAML files, one per GPU model, vLLM-style.

File ``<normalised GPU name>.yaml`` (``NVIDIA H200`` -> ``NVIDIA_H200.yaml``)::

    format: snapmla-tuning
    version: 1
    devices:
    - gpu: {name: NVIDIA H200, sm_count: 132, compute_capability: [9, 0], cuda_driver_major: 13}
      entries:
      - bucket: {h_q: 64, s_q: 2, batch: [64, 64], context: [16384, 16384], format: fp8}
        config: {row_groups: 4, kv_split: 1, stages: 2, block_n: 64, min_ctas_per_sm: 1,
                 split: {ctas_per_sm: 1, waves: 1, min_blocks_per_split: 4,
                         max_splits_per_request: 256}}
        time_us: ...          # measured, tuned config
        default_time_us: ...  # measured in the same run, the heuristic default
        ...

Folders searched: the user's (``$SNAPMLA_TUNING_DIR``, else ``~/.config/snapmla/tuning``) first,
then the shipped ``tuning_db/`` of the repository. Writes go through a temp file and a rename
(:func:`snapmla_cli.cache.atomic.write_text_atomic`) and merge with what the file holds: per
bucket the faster entry is kept (``force`` keeps the new one), every other entry is kept.

:class:`DbError` is defined in :mod:`.fields` (whose readers, shared with :mod:`.space`, raise
it for every malformed value) and imported here, where callers take it from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

try:  # POSIX advisory locks; elsewhere merges are not serialized (one tune at a time)
    import fcntl
except ImportError:  # pragma: no cover - not Linux
    fcntl = None  # type: ignore[assignment]

from ..bundled import TUNING_DB, bundled_dir
from ..cache.atomic import final_target, hidden_sibling, write_text_atomic
from ..errors import SnapmlaError
from ..ops.decode_config import FP8_MMA_SYNC, ROPE_RING_CHOICES, WG_MODES, DecodeConfig
from ..ops.schedule import SplitPolicy
from ..sizes import counted, shorten
from .fields import MAX_FIELD_INT, DbError, is_int, read_int, read_positive_number, show
from .space import Bucket, config_problem

FORMAT_TAG = "snapmla-tuning"
VERSION = 1
TUNING_DIR_ENV = "SNAPMLA_TUNING_DIR"
HEADER = ("# snapmla tuning database (SPEC section 9), written by `snapmla tune`.\n"
          "# Format: tuning_db/README.md. Entries are measurements: do not edit the times.\n")


# ---------------------------------------------------------------------------------------------
# GPU key and file names


@dataclass(frozen=True)
class GpuKey:
    """What a database section is keyed on: the GPU name as NVML reports it, the SM count, the
    compute capability and the CUDA driver major version."""

    name: str
    sm_count: int | None
    compute_capability: tuple[int, int]
    cuda_driver_major: int | None

    def same_gpu(self, other: GpuKey) -> bool:
        """Same model: name, SM count and compute capability (the driver only ranks matches)."""
        return (self.name.strip() == other.name.strip() and self.sm_count == other.sm_count
                and tuple(self.compute_capability) == tuple(other.compute_capability))

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sm_count": self.sm_count,
                "compute_capability": list(self.compute_capability),
                "cuda_driver_major": self.cuda_driver_major}

    @classmethod
    def from_dict(cls, data: object) -> GpuKey:
        """A section's key; :class:`DbError` for any malformed field (the section is skipped)."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise DbError("gpu: expected a mapping with a name")
        cc = data.get("compute_capability")
        if not isinstance(cc, (list, tuple)) or len(cc) != 2:
            raise DbError(f"gpu: compute_capability must be [major, minor], got {show(cc)}")
        major = read_int(cc[0], "gpu.compute_capability[0]", lo=0)
        minor = read_int(cc[1], "gpu.compute_capability[1]", lo=0)
        sms, drv = data.get("sm_count"), data.get("cuda_driver_major")
        return cls(data["name"], None if sms is None else read_int(sms, "gpu.sm_count"),
                   (major, minor),
                   None if drv is None else read_int(drv, "gpu.cuda_driver_major", lo=0))

    @classmethod
    def from_facts(cls, facts: Any) -> GpuKey:
        """From :class:`snapmla_cli.runtime.gpu_facts.GpuFacts` (or anything with its fields)."""
        try:
            driver = int(str(facts.cuda_driver_version).split(".")[0])
        except (AttributeError, ValueError):
            driver = None
        return cls(str(facts.name), facts.sm_count, tuple(facts.compute_capability), driver)

    def label(self) -> str:
        cc = f"{self.compute_capability[0]}.{self.compute_capability[1]}"
        sms = "?" if self.sm_count is None else self.sm_count
        drv = "?" if self.cuda_driver_major is None else self.cuda_driver_major
        return f"{self.name} ({sms} SMs, cc {cc}, CUDA driver {drv})"


_SPACES = re.compile(r"\s+")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def normalise_gpu_name(name: str) -> str:
    """File stem for a GPU name: strip, runs of spaces -> ``_``, drop anything outside
    ``[A-Za-z0-9_-]`` (``"NVIDIA H100 80GB HBM3"`` -> ``NVIDIA_H100_80GB_HBM3``)."""
    stem = _UNSAFE.sub("", _SPACES.sub("_", name.strip()))
    return stem or "unknown_gpu"


def db_filename(name: str) -> str:
    return normalise_gpu_name(name) + ".yaml"


def user_dir() -> Path:
    """``$SNAPMLA_TUNING_DIR``, else ``~/.config/snapmla/tuning``."""
    env = os.environ.get(TUNING_DIR_ENV)
    return expand_folder(Path(env) if env else Path("~") / ".config" / "snapmla" / "tuning")


def user_dir_origin() -> str:
    """What chose :func:`user_dir`, for a message about it: the environment variable when it is
    set (the user never typed ``--db-dir``), else the built-in default."""
    return f"${TUNING_DIR_ENV}" if os.environ.get(TUNING_DIR_ENV) else "the default database folder"


def expand_folder(folder: Path) -> Path:
    """``folder`` with a leading ``~`` expanded, or as given when that fails (``~nosuchuser``,
    or no home folder at all: ``Path`` raises ``RuntimeError``); :func:`folder_problem` then
    says why it cannot be used."""
    try:
        return folder.expanduser()
    except RuntimeError:
        return folder


def shipped_dir() -> Path:
    """The shipped ``tuning_db/``: the checkout's, or the installed package's (:mod:`snapmla_cli.bundled`)."""
    return bundled_dir(TUNING_DB)


def search_dirs() -> list[tuple[str, Path]]:
    """``[("user", ...), ("shipped", ...)]`` in search order (one entry if they coincide)."""
    dirs = [("user", user_dir()), ("shipped", shipped_dir())]
    try:
        if dirs[0][1].resolve() == dirs[1][1].resolve():
            return [("shipped", dirs[1][1])]
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        pass  # then they are not the same folder; folder_problem names the trouble
    return dirs


def folder_problem(folder: Path) -> str | None:
    """Why a database folder cannot be used (None: it can, or it is simply absent, which a
    machine that never ran ``snapmla tune`` is). ``Path.exists`` / ``is_dir`` answer False for
    a symlink loop, so ``stat`` is asked directly."""
    if folder.parts and folder.parts[0].startswith("~"):
        return f"no home folder for {folder.parts[0]!r}"
    try:
        mode = folder.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink loop"
        if exc.errno == errno.ENOTDIR:
            return "a parent is not a folder"
        return exc.strerror or type(exc).__name__
    if not stat.S_ISDIR(mode):
        return "not a folder"
    # a folder that cannot be listed looked usable and silently held no entries
    return None if os.access(folder, os.R_OK | os.X_OK) else "Permission denied"


# ---------------------------------------------------------------------------------------------
# entries


_CONFIG_FIELDS = [f.name for f in dataclasses.fields(DecodeConfig) if f.name != "split"]
# fields that may be 0, with their allowed values; every other field is >= 1
_CHOICE_FIELDS = {"qk_promote": (0, 1), "pv_promote": (0, 1), "wg_mode": WG_MODES, "rope_ring": ROPE_RING_CHOICES}
# fields added after entries were stored, written only where they differ from the value that
# reproduces the older kernels (so that the stored entries keep their text)
_OMITTED_AT_DEFAULT = {"rope_ring": 0}
_SPLIT_FIELDS = [f.name for f in dataclasses.fields(SplitPolicy) if f.name != "num_sms"]
# the split policy's booleans (true / false in the file, never 0 / 1)
_FLAG_FIELDS = {f.name for f in dataclasses.fields(SplitPolicy) if f.type in (bool, "bool")}


def config_to_dict(cfg: DecodeConfig) -> dict[str, Any]:
    """Every kernel parameter plus the split policy; ``num_sms`` is left out (filled in from the
    GPU at run time)."""
    out: dict[str, Any] = {name: getattr(cfg, name) for name in _CONFIG_FIELDS
                           if name not in _OMITTED_AT_DEFAULT or getattr(cfg, name) != _OMITTED_AT_DEFAULT[name]}
    out["split"] = {name: getattr(cfg.split, name) for name in _SPLIT_FIELDS}
    return out


def config_from_dict(data: object, name: str = "config") -> DecodeConfig:
    """Inverse of :func:`config_to_dict`; missing fields take their defaults, unknown ones are
    an error (a parameter this version of the kernels does not have). Every malformed value
    raises :class:`DbError` naming ``name`` (``config`` or ``default_config``)."""
    if not isinstance(data, dict):
        raise DbError(f"{name}: expected a mapping, got {show(data)}")
    split_data = data.get("split", {})
    if not isinstance(split_data, dict):
        raise DbError(f"{name}.split: expected a mapping, got {show(split_data)}")
    unknown = sorted(map(str, set(data) - set(_CONFIG_FIELDS) - {"split"}))
    unknown += sorted(f"split.{k}" for k in set(split_data) - set(_SPLIT_FIELDS))
    if unknown:
        raise DbError(f"{name}: unknown parameter(s) {shorten(', '.join(unknown), 60)}")
    for key, value in [*data.items(), *split_data.items()]:
        if key != "split":
            _check_config_value(name, key, value)
    kwargs = {k: v for k, v in data.items() if k != "split"}
    # entries written before the wgmma kernel existed were tuned on the mma.sync kernel
    kwargs.setdefault("kernel_version", FP8_MMA_SYNC)
    try:
        return DecodeConfig(**kwargs, split=SplitPolicy(**split_data))
    except SnapmlaError as exc:  # the dataclasses' own range checks (max_splits_per_request)
        raise DbError(f"{name}: {exc}") from None


def _check_config_value(name: str, key: str, value: object) -> None:
    """One kernel or split parameter: a flag is true / false, a choice one of its integers (not
    ``1.0``, which compares equal), anything else an integer in 1 .. MAX_FIELD_INT."""
    if key in _FLAG_FIELDS:
        if not isinstance(value, bool):
            raise DbError(f"{name}: {key} must be true or false, got {show(value)}")
    elif key in _CHOICE_FIELDS:
        if not is_int(value) or value not in _CHOICE_FIELDS[key]:
            raise DbError(f"{name}: {key} must be one of {_CHOICE_FIELDS[key]}, got {show(value)}")
    elif not is_int(value) or not 1 <= value <= MAX_FIELD_INT:  # type: ignore[operator]
        raise DbError(f"{name}: {key} must be an integer in 1..{MAX_FIELD_INT}, got {show(value)}")


@dataclass(frozen=True)
class Entry:
    """One bucket's tuned configuration and how it was measured."""

    bucket: Bucket
    config: DecodeConfig
    time_us: float
    default_time_us: float
    date: str
    snapmla_version: str
    command: str
    default_config: DecodeConfig | None = None
    kernels: str = ""  # hash of the kernels/ source tree the times were measured with
    timed_at: dict[str, int] = field(default_factory=dict)  # batch, context actually timed
    candidates: int = 0  # candidates measured

    @property
    def speedup(self) -> float:
        return self.default_time_us / self.time_us if self.time_us > 0 else math.nan

    def is_current(self, kernels: str, default: DecodeConfig) -> bool:
        """Whether this entry was measured with these kernel sources against this default (the
        built-in heuristic of today): only then may a resumed ``snapmla tune`` skip its bucket.
        An entry timed against an older heuristic can lose to the new one (a b 8 entry of the
        H200 was 7% slower after the 16-row heuristic changed, docs/PERF.md)."""
        return self.stale_reason(kernels, default) is None

    def stale_reason(self, kernels: str, default: DecodeConfig | None) -> str | None:
        """Why a resumed ``snapmla tune`` would re-time this entry (None: it is current), for
        ``snapmla info``; ``default`` None: the default is not known (no SM count), only the
        kernel sources are compared. A stale entry still applies at run time."""
        if self.kernels != kernels:
            return "other kernel sources"
        if self.default_moved(default):
            return "another default"
        return None

    def default_moved(self, default: DecodeConfig | None) -> bool:
        """Whether this entry was timed against another default than ``default`` (today's
        heuristic; None: not known, so not moved): its configuration may now lose to it."""
        return default is not None and self.default_config != strip_sms(default)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bucket": self.bucket.as_dict(),
            "config": config_to_dict(self.config),
            "time_us": round(float(self.time_us), 3),
            "default_time_us": round(float(self.default_time_us), 3),
            "speedup": round(self.speedup, 4),
            "default_config": None if self.default_config is None else config_to_dict(
                self.default_config),
            "timed_at": dict(self.timed_at),
            "candidates": self.candidates,
            "date": self.date,
            "snapmla_version": self.snapmla_version,
            "kernels": self.kernels,
            "command": self.command,
        }
        return out

    @classmethod
    def from_dict(cls, data: object) -> Entry:
        """An entry as stored; :class:`DbError` for any malformed field, so that the loader
        skips this entry alone and names it."""
        if not isinstance(data, dict):
            raise DbError(f"entry: expected a mapping, got {show(data)}")
        bucket = Bucket.from_dict(data.get("bucket"))
        config = config_from_dict(data.get("config"))
        why = config_problem(config, bucket.format)
        if why:
            raise DbError(f"config invalid for the {bucket.format} kernel: {why}")
        default = data.get("default_config")
        candidates = data.get("candidates")
        return cls(
            bucket=bucket, config=config,
            time_us=read_positive_number(data.get("time_us"), "time_us"),
            default_time_us=read_positive_number(data.get("default_time_us"), "default_time_us"),
            date=_text(data.get("date"), "date"), snapmla_version=_text(data.get("snapmla_version"), "snapmla_version"),
            command=_text(data.get("command"), "command"),
            default_config=None if default is None else config_from_dict(default, "default_config"),
            kernels=_text(data.get("kernels"), "kernels"),
            timed_at=_timed_at(data.get("timed_at")),
            candidates=0 if candidates is None else read_int(candidates, "candidates", lo=0),
        )


def _text(value: object, name: str) -> str:
    """A descriptive field (date, version, command, kernel hash): a YAML scalar as text, missing
    as empty. A list or mapping is refused rather than turned into text: ``str`` of a structure
    thousands deep, or of an alias repeated a billion times, would recurse or fill the memory."""
    if value is None:
        return ""
    if isinstance(value, (str, datetime.date)):  # (an unquoted date is a date to YAML)
        return str(value)
    if isinstance(value, (int, float)):  # (cut short: str() of an int past Python's digit limit raises)
        return show(value)
    raise DbError(f"{name}: expected text, got a {type(value).__name__}")


def _timed_at(value: object) -> dict[str, int]:
    """The ``timed_at`` mapping (batch, context actually timed): missing is empty, every value
    an integer >= 1."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DbError(f"timed_at: expected a mapping, got {show(value)}")
    return {str(k): read_int(v, f"timed_at.{shorten(str(k), 20)}") for k, v in value.items()}


@dataclass
class DeviceSection:
    gpu: GpuKey
    entries: list[Entry]


@dataclass
class LoadedFile:
    """A parsed file; ``problems`` lists the entries skipped as malformed, ``unknown`` the fields
    that were read past (``devices[0].entries[3].note``: a hand edit, or a newer snapmla's field),
    which a lookup may ignore but a rewrite of the file would drop."""

    path: Path
    sections: list[DeviceSection]
    problems: list[str]
    unknown: list[str] = field(default_factory=list)


# the fields each level of a file has (what dump_text and the as_dict methods write: the
# dataclasses' fields, and an entry's derived speedup); others are reported, not read
FILE_KEYS = ("format", "version", "devices")
SECTION_KEYS = tuple(f.name for f in dataclasses.fields(DeviceSection))
GPU_KEYS = tuple(f.name for f in dataclasses.fields(GpuKey))
ENTRY_KEYS = (*(f.name for f in dataclasses.fields(Entry)), "speedup")


def _unknown_keys(where: str, data: object, known: tuple[str, ...]) -> list[str]:
    """``where.key`` for each key of the mapping ``data`` outside ``known``."""
    if not isinstance(data, dict):
        return []
    return [f"{where}{shorten(str(key), 40)}" for key in data if key not in known]


# PyYAML's libyaml loader (CSafeLoader) parses the H200's file of 208 entries in 0.08 s where the
# Python loader takes 0.6 s, which `snapmla tune` paid several times a bucket (docs/DESIGN.md,
# "Tuning"). It has no depth guard: 50,000 nested brackets crashed the process (a segfault, not
# an exception) where 16,000 parsed and the Python loader raises RecursionError. So it reads only
# text whose nesting cannot come near that: the depth is at most the flow brackets ([ and {) plus
# the block levels, which the widest line bounds (each level takes a column of indentation or a
# "- " of a compact sequence).
C_LOADER_MAX_NESTING = 10_000


class EmptyDbFile(DbError):
    """A database file that holds nothing (0 bytes, blank or comments only): no database, so
    the readers skip it with one warning, as a corrupt one; but a merge may replace it without
    ``force``, since no entry would be dropped."""


def yaml_loader(text: str) -> Any:
    """The PyYAML loader class for ``text``: libyaml's where it is built in and the text is
    shallow enough for it (C_LOADER_MAX_NESTING), else the Python SafeLoader."""
    import yaml

    fast = getattr(yaml, "CSafeLoader", None)
    if fast is None:
        return yaml.SafeLoader
    flow = text.count("[") + text.count("{")
    widest = max(map(len, text.splitlines()), default=0)
    return fast if flow + 2 * widest <= C_LOADER_MAX_NESTING else yaml.SafeLoader


def parse_text(text: str, path: Path) -> LoadedFile:
    """Parse a database file's text. A file that is not a database at all raises
    :class:`DbError`; malformed entries inside a good file are skipped and listed."""
    import yaml

    try:
        data = yaml.load(text, Loader=yaml_loader(text))  # a safe loader either way
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise DbError(f"{path}: not valid YAML{where}") from None
    except RecursionError:  # PyYAML composes nodes recursively: [[[[...]]]] a few 1000 deep
        raise DbError(f"{path}: nested too deeply to be a tuning database") from None
    except ValueError as exc:  # past Python's digit limit for int(str); a date like 2026-13-01
        reason = " ".join(str(exc).split(";")[0].split())
        raise DbError(f"{path}: not valid YAML ({reason})") from None
    if data is None:  # listed silently as a database before: a truncated copy looked fine
        raise EmptyDbFile(f"{path}: empty, expected a snapmla tuning database ('format: {FORMAT_TAG}')")
    if not isinstance(data, dict) or data.get("format") != FORMAT_TAG:
        raise DbError(f"{path}: not a snapmla tuning database (expected 'format: {FORMAT_TAG}')")
    version = data.get("version")
    if type(version) is not int or version != VERSION:  # (True and 1.0 compare equal to 1)
        raise DbError(f"{path}: database version {show(version)}, this snapmla reads "
                      f"version {VERSION}")
    devices = data.get("devices") or []
    if not isinstance(devices, list):
        raise DbError(f"{path}: 'devices' must be a list")
    sections: list[DeviceSection] = []
    problems: list[str] = []
    unknown = _unknown_keys("", data, FILE_KEYS)
    # YAML aliases repeat an object, not its text: 12 KB whose aliases listed one entry 1,000
    # times in 300 sections took 15 s and 670 MB to read (`snapmla info`, a process's first
    # decode call). A repeated section, entry list or entry (by identity: PyYAML builds an alias
    # as the same object) is skipped as a duplicate after one look; dump_text writes no alias.
    first_seen: dict[int, str] = {}

    def repeat_of(node: object, where: str) -> str | None:
        """Where ``node`` (a section, an entry list, an entry) was met first, None the first time."""
        if not isinstance(node, (dict, list)):
            return None
        earlier = first_seen.get(id(node))
        if earlier is None:
            first_seen[id(node)] = where
        return earlier

    for i, dev in enumerate(devices):
        earlier = repeat_of(dev, f"devices[{i}]") or repeat_of(dev.get("entries") if isinstance(dev, dict) else None,
                                                              f"devices[{i}].entries")
        if earlier is not None:
            problems.append(f"devices[{i}]: the same YAML object as {earlier} (an alias), skipped")
            continue
        unknown += _unknown_keys(f"devices[{i}].", dev, SECTION_KEYS)
        unknown += _unknown_keys(f"devices[{i}].gpu.", dev.get("gpu") if isinstance(dev, dict) else None, GPU_KEYS)
        try:
            gpu = GpuKey.from_dict(dev.get("gpu") if isinstance(dev, dict) else None)
        except DbError as exc:
            problems.append(f"devices[{i}]: {exc}")
            continue
        entries: list[Entry] = []
        raw_entries = dev.get("entries") or []
        if not isinstance(raw_entries, list):
            problems.append(f"devices[{i}].entries: expected a list")
            raw_entries = []
        for j, raw in enumerate(raw_entries):
            earlier = repeat_of(raw, f"devices[{i}].entries[{j}]")
            if earlier is not None:
                problems.append(f"devices[{i}].entries[{j}]: the same YAML object as {earlier} (an alias), skipped")
                continue
            unknown += _unknown_keys(f"devices[{i}].entries[{j}].", raw, ENTRY_KEYS)
            try:
                entries.append(Entry.from_dict(raw))
            except DbError as exc:
                problems.append(f"devices[{i}].entries[{j}]: {exc}")
        sections.append(DeviceSection(gpu, entries))
    return LoadedFile(path, sections, problems, unknown)


def load_file(path: Path) -> LoadedFile:
    """Read and parse ``path``; :class:`DbError` if it cannot be read or is not a database. Only
    a regular file is read: a fifo would block the read forever and ``/dev/zero`` never end."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise DbError(f"{path}: not a regular file")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DbError(f"{path}: cannot read ({type(exc).__name__}: {exc})") from None
    return parse_text(text, path)


def dump_text(sections: list[DeviceSection]) -> str:
    import yaml

    data = {
        "format": FORMAT_TAG,
        "version": VERSION,
        "devices": [{"gpu": s.gpu.as_dict(), "entries": [e.as_dict() for e in _sorted(s.entries)]}
                    for s in sections],
    }
    # libyaml's dumper writes the same text as the Python one (the shipped files are checked),
    # four times faster; a merge dumps the whole file once a bucket
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

    class PlainDumper(dumper):  # type: ignore[valid-type,misc]  # (a class from getattr)
        """Never an anchor and alias, even for an object listed twice: the reader refuses them."""

        def ignore_aliases(self, data: object) -> bool:
            return True

    return HEADER + yaml.dump(data, Dumper=PlainDumper, sort_keys=False, default_flow_style=None, width=100)


def _sorted(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (e.bucket.format, e.bucket.h_q, e.bucket.s_q,
                                          e.bucket.batch, e.bucket.context))


# ---------------------------------------------------------------------------------------------
# merge and save


@dataclass(frozen=True)
class MergeOutcome:
    """What happened to a new entry: ``added``, ``replaced`` (faster or forced) or ``kept_old``
    (the stored entry was faster)."""

    action: str
    previous: Entry | None = None


def merge_entry(entries: list[Entry], new: Entry, force: bool = False
                ) -> tuple[list[Entry], MergeOutcome]:
    """``entries`` with ``new`` merged in: per bucket the faster entry stays (``force``: the new
    one); entries of other buckets are kept untouched. A stored entry timed against another
    default than ``new`` (the heuristic has changed since), or with other kernel sources, gives
    way whatever its time: only ``new`` shows what today's kernels do against today's default
    (and a kept stale entry would be re-timed by every resumed or ``--stale`` run)."""
    out = [e for e in entries if e.bucket != new.bucket]
    same = [e for e in entries if e.bucket == new.bucket]
    previous = min(same, key=lambda e: e.time_us) if same else None
    if previous is None:
        return out + [new], MergeOutcome("added")
    if (force or new.time_us < previous.time_us or previous.default_config != new.default_config
            or previous.kernels != new.kernels):
        return out + [new], MergeOutcome("replaced", previous)
    return out + [previous], MergeOutcome("kept_old", previous)


def save_entries(folder: Path, gpu: GpuKey, new_entries: list[Entry], force: bool = False
                 ) -> tuple[Path, list[MergeOutcome]]:
    """Merge ``new_entries`` into ``folder/<GPU>.yaml`` (created if missing) and write it
    atomically. A file that exists but cannot be parsed, or holds malformed entries, is not
    overwritten (SnapmlaError) unless ``force`` (:func:`sections_to_merge`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / db_filename(gpu.name)
    with merge_lock(path):
        sections = sections_to_merge(path, force)
        section = next((s for s in sections if s.gpu == gpu), None)
        if section is None:
            section = DeviceSection(gpu, [])
            sections.append(section)
        outcomes = []
        for entry in new_entries:
            section.entries, outcome = merge_entry(section.entries, entry, force)
            outcomes.append(outcome)
        write_text_atomic(path, dump_text(sections))
    return path, outcomes


@contextlib.contextmanager
def merge_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path``'s merges. One ``snapmla tune`` per GPU of a
    node (CUDA_VISIBLE_DEVICES) writes the same ``<GPU>.yaml``; each merge reads the file, adds
    its entries and replaces it, so two merges at once would drop one's entries.

    The lock is a hidden file next to the file the write lands in (a symlinked database is
    replaced at its target, so two folders that link one file share its lock), opened read-only
    (``flock`` needs no write access: members of a shared group folder can all take it) and
    created with the umask's bits. It is a protection, not a precondition: where it cannot be
    taken (a read-only folder that holds a link, a filesystem without locks) the merge goes on
    unlocked, as it did before, and the write reports its own problems."""
    if fcntl is None:
        yield
        return
    target = final_target(path)
    try:  # (non-blocking open: a fifo put at the lock's name must not hang the save)
        fd = os.open(hidden_sibling(target, ".lock"), os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # e.g. ENOLCK on NFS without a lock daemon: unlocked, as before
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def sections_to_merge(path: Path, force: bool = False) -> list[DeviceSection]:
    """The sections stored in ``path`` that a merge keeps (none: no file). Rewriting a file that
    cannot be parsed, or one with malformed entries, would drop what this version cannot read
    (hand edits, or entries of a newer snapmla), so that is a :class:`SnapmlaError` unless
    ``force``; ``snapmla tune`` asks before it measures anything."""
    if not path.exists():
        return []
    if not path.is_file():  # a folder or a fifo of the file's name: --force cannot write over it
        raise SnapmlaError(f"{path}: not a regular file; move it away (--force does not replace it)")
    try:
        loaded = load_file(path)
    except EmptyDbFile:
        return []  # nothing in it to drop
    except DbError as exc:
        if not force:
            raise SnapmlaError(f"{exc}; not overwriting it (move it away or pass --force)"
                               ) from None
        return []
    if loaded.problems and not force:
        n = len(loaded.problems)
        raise SnapmlaError(f"{path}: {counted(n, 'malformed entry', 'malformed entries')} "
                           f"({loaded.problems[0]}); not overwriting it, which would drop "
                           f"{'it' if n == 1 else 'them'} (fix the file or pass --force)")
    if loaded.unknown and not force:
        n = len(loaded.unknown)
        raise SnapmlaError(f"{path}: {counted(n, 'field')} this snapmla does not know ({loaded.unknown[0]}: "
                           f"a newer snapmla's, or a hand edit); not overwriting it, which would drop "
                           f"{'it' if n == 1 else 'them'} (fix the file or pass --force)")
    return loaded.sections


def entries_for(folder: Path, gpu: GpuKey) -> dict[Bucket, Entry]:
    """The stored entries for exactly ``gpu`` in ``folder`` by bucket, the file's first of each
    (empty: none, or the file is unreadable). One read for a whole ``snapmla tune`` run: the
    H200's file of 208 entries takes about 0.6 s to parse with PyYAML's Python loader."""
    path = folder / db_filename(gpu.name)
    if not path.exists():
        return {}
    try:
        loaded = load_file(path)
    except DbError:
        return {}
    found: dict[Bucket, Entry] = {}
    for section in loaded.sections:
        if section.gpu == gpu:
            for entry in section.entries:
                found.setdefault(entry.bucket, entry)
    return found


def find_entry(folder: Path, gpu: GpuKey, bucket: Bucket) -> Entry | None:
    """The stored entry of ``bucket`` for exactly ``gpu`` in ``folder`` (None: none, or the file
    is unreadable)."""
    return entries_for(folder, gpu).get(bucket)


def strip_sms(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with the split policy's SM count back at its default (as stored)."""
    return replace(cfg, split=replace(cfg.split, num_sms=SplitPolicy().num_sms))
