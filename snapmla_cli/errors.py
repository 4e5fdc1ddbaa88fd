"""One exception type for every user-facing error.

The CLI turns a :class:`SnapmlaError` into one line on stderr and exit code 2; the library
raises it (a ``ValueError`` subclass, so engines can catch it generically) whenever an argument
is wrong, so that no user ever sees a traceback for a bad input.
"""

from __future__ import annotations

import reprlib

# The longest message a SnapmlaError keeps: its head (the argument and what was expected) and its
# tail (usually the value received), with the middle cut. A caller's value put into a message
# (a million-character string, a 2,000-page work list, a tensor's repr) made errors of
# megabytes and many lines.
MAX_MESSAGE_CHARS = 1_000
_HEAD_CHARS = 700

_SHORT = reprlib.Repr()
_SHORT.maxstring = 40
_SHORT.maxother = 40


class SnapmlaError(ValueError):
    """A bad argument or input file. The message names the argument and what was expected; it
    is kept to one line of at most :data:`MAX_MESSAGE_CHARS` characters (:func:`bounded`)."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (bounded(args[0]),)
        super().__init__(*args)


def bounded(message: str) -> str:
    """``message`` on one line (whitespace runs with a line break become one space) and at most
    :data:`MAX_MESSAGE_CHARS` long, its middle cut."""
    if "\n" in message or "\r" in message:
        message = " ".join(message.split())
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    cut = len(message) - MAX_MESSAGE_CHARS + 20
    tail = MAX_MESSAGE_CHARS - _HEAD_CHARS - 20
    return f"{message[:_HEAD_CHARS]} [{cut:,} chars cut] {message[-tail:]}"


def show(value: object) -> str:
    """``repr(value)`` cut short, for a caller's value in a message: a long string or list, a
    tensor, an int past Python's digit limit for ``str()`` (which raised ``ValueError`` while the
    message was being built) all stay a few dozen characters."""
    try:
        return _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int past Python's digit limit for str()
        if isinstance(value, int):
            return f"an integer of {value.bit_length():,} bits"
        name = type(value).__name__
        return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


class NoGpuError(SnapmlaError):
    """A GPU-only feature was asked for on a machine without a usable CUDA GPU."""


def dtype_name(dtype: object) -> str:
    """A dtype as messages spell it, without torch's module prefix (``int32``, ``bfloat16``), so
    "expected int32, got int64" reads alike wherever a dtype is named."""
    return str(dtype).removeprefix("torch.")
