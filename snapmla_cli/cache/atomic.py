"""Atomic file writes: temp file in the target's folder, fsync, rename; never clobber without force."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import SnapmlaError


def check_writable(path: Path, force: bool, what: str = "output") -> None:
    """Refuse to overwrite an existing file unless ``force``; the folder must exist."""
    if path.exists() and not force:
        raise SnapmlaError(f"{what} {path} exists; pass --force to overwrite it")
    if path.exists() and path.is_dir():
        raise SnapmlaError(f"{what} {path} is a directory, expected a file path")
    if not path.parent.exists():
        raise SnapmlaError(f"{what} {path}: folder {path.parent} does not exist")


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` and rename the result onto ``path`` only when it succeeded."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))
