"""Linux ``renameat2(2)`` through libc: a rename that refuses to clobber, and an atomic swap.

Why: the outputs' no-clobber move is a hard link (``os.link`` fails if anything is at the
name), and the backups of a group of outputs are hard links too. Filesystems without hard links
(FAT / exFAT, SMB without Unix extensions, some FUSE) would otherwise leave a check-then-rename
window and a replaced file that cannot be brought back. Most of them still implement the
``RENAME_NOREPLACE`` and ``RENAME_EXCHANGE`` flags, which do both atomically in the kernel.
Python has no wrapper for ``renameat2``, so it is called through ctypes; every caller has a
fallback for systems without it (other kernels, old libcs, filesystems that reject a flag).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

RENAME_NOREPLACE = 1 << 0  # <linux/fs.h>: fail with EEXIST if the new name exists
RENAME_EXCHANGE = 1 << 1  # swap the two names atomically; both must exist
_AT_FDCWD = -100  # paths relative to the current directory, as os.rename resolves them

# errno values meaning "this system or filesystem does not do that flag": the caller falls back
_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


@cache
def _libc_renameat2() -> Any:
    """libc's ``renameat2`` (glibc 2.28+, musl 1.2.2+), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """True when the kernel did the rename with ``flags``; False when it cannot do that flag
    here (nothing changed). Any other failure raises the OSError, named as ``os.rename`` would."""
    function = _libc_renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def rename_noreplace(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst`` unless anything (a dangling symlink included) is at ``dst``:
    FileExistsError then. False: not available here, nothing was done."""
    return _renameat2(src, dst, RENAME_NOREPLACE)


def exchange(a: Path, b: Path) -> bool:
    """Swap the files at ``a`` and ``b`` in one step (each name always holds one of them).
    False: not available here, nothing was done."""
    return _renameat2(a, b, RENAME_EXCHANGE)
