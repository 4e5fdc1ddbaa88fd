"""One exception type for every user-facing error.

The CLI turns a :class:`SnapmlaError` into one line on stderr and exit code 2; the library
raises it (a ``ValueError`` subclass, so engines can catch it generically) whenever an argument
is wrong, so that no user ever sees a traceback for a bad input.
"""

from __future__ import annotations


class SnapmlaError(ValueError):
    """A bad argument or input file. The message names the argument and what was expected."""


class NoGpuError(SnapmlaError):
    """A GPU-only feature was asked for on a machine without a usable CUDA GPU."""


def dtype_name(dtype: object) -> str:
    """A dtype as messages spell it, without torch's module prefix (``int32``, ``bfloat16``), so
    "expected int32, got int64" reads alike wherever a dtype is named."""
    return str(dtype).removeprefix("torch.")
