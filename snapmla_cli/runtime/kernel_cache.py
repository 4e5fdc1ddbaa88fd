"""On-disk cache of compiled kernels: ``<key>.cubin`` + ``<key>.json`` (log, lowered names).

Why our own cache and not CuPy's: CuPy's does not hash headers pulled in with ``-I``, and it
needs a GPU to pick the arch. The key (computed by :mod:`snapmla_cli.runtime.nvrtc`) covers
every file under ``kernels/``, the options, the arch and the NVRTC version, so a warm start
compiles nothing and any edit recompiles. Both files are written atomically (temp + rename),
the cubin first: a reader that finds the json also finds a complete cubin. The json holds the
cubin's SHA-256, so a damaged entry (a disk error, a hand edit) is a miss, not a module load that
fails inside the driver. A cache folder that cannot be written only costs the next start a
recompile; it is never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..cache.atomic import write_atomic
from ..errors import SnapmlaError

CACHE_DIR_ENV = "SNAPMLA_CACHE_DIR"
_FORMAT = 2  # 2: the json holds the cubin's SHA-256 (entries of format 1 are recompiled once)


def cache_dir() -> Path:
    """``$SNAPMLA_CACHE_DIR`` or ``~/.cache/snapmla/kernels``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "snapmla" / "kernels"


@dataclass(frozen=True)
class CachedKernel:
    cubin: bytes
    log: str
    lowered_names: dict[str, str]


def load(key: str) -> CachedKernel | None:
    """The cached entry for ``key``, or None on a miss (or an unreadable/corrupt entry)."""
    folder = cache_dir()
    meta_path, cubin_path = folder / f"{key}.json", folder / f"{key}.cubin"
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError, RecursionError):  # (JSON nested past the parser's recursion: damage too)
        return None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("cubin_sha256") != _digest(cubin):
        return None
    names = meta.get("lowered_names", {})
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in (*names, *names.values())):
        return None
    return CachedKernel(cubin=cubin, log=str(meta.get("log", "")), lowered_names=names)


def _digest(cubin: bytes) -> str:
    return hashlib.sha256(cubin).hexdigest()


def store(key: str, entry: CachedKernel, description: dict[str, object]) -> bool:
    """Write ``entry`` under ``key``; False (and no exception) if the folder is not writable."""
    folder = cache_dir()
    meta = {
        "format": _FORMAT,
        "cubin_bytes": len(entry.cubin),
        "cubin_sha256": _digest(entry.cubin),
        "log": entry.log,
        "lowered_names": entry.lowered_names,
        "description": description,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _sweep_stale_temp_files(folder)
        write_atomic(folder / f"{key}.cubin", lambda tmp: tmp.write_bytes(entry.cubin))
        write_atomic(folder / f"{key}.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    except (OSError, SnapmlaError):  # (OutputWriteError, a path it could not even look at, or a
        return False  # folder at an entry's name: refused as an output, and no reason to fail a compile)
    return True


STALE_TEMP_SECONDS = 3600  # a temp file this old belongs to no running write (one takes milliseconds)
_SWEPT: set[Path] = set()


def _sweep_stale_temp_files(folder: Path) -> None:
    """Remove the temp files of writers killed mid-write (SIGKILL, the OOM killer, a preempted
    job: no clean-up runs), once per folder and process: 200 kills left 152 files, 31.5 MB, which
    nothing else ever removed."""
    if folder in _SWEPT:
        return
    _SWEPT.add(folder)
    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.lstat().st_mtime > STALE_TEMP_SECONDS:
                tmp.unlink()

