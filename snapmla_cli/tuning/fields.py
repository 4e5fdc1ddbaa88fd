"""Strict readers for the scalar fields of a tuning-database file, and the error they raise.

A file is YAML that anyone may have edited, so a field can hold anything YAML can say:
``.inf``, ``.nan``, ``true`` where a count belongs, a 10**30 bucket bound. Python's ``int()``
would turn some of these into a different number (``int(True)``, ``int(1.5)``) and raise
``OverflowError`` on others, which is neither the ``ValueError`` nor the ``TypeError`` the entry
loop skips, so one bad field made the whole file unreadable. Every reader here checks the
type and range itself and raises :class:`DbError` only, so that the loader skips exactly the
entry that holds the bad value and names it (:func:`snapmla_cli.tuning.db.parse_text`).

Kept apart from :mod:`.db` so that :mod:`.space` (which :mod:`.db` imports) parses its
buckets with the same readers.
"""

from __future__ import annotations

import math

from ..errors import SnapmlaError, show
from ..sizes import MAX_SIZE

# The largest integer any field may hold: batch sizes and contexts are int32 in the kernels,
# and no kernel parameter or count comes near it. Bounding them keeps later arithmetic (log2
# distances, float conversions) from overflowing on a value nobody could have measured.
MAX_FIELD_INT = MAX_SIZE


class DbError(SnapmlaError):
    """A database file that cannot be read or parsed, or a malformed value inside one."""


def is_int(value: object) -> bool:
    """A YAML integer: ``true`` / ``false`` are bools, which Python counts as ints."""
    return isinstance(value, int) and not isinstance(value, bool)


def read_int(value: object, name: str, lo: int = 1, hi: int = MAX_FIELD_INT) -> int:
    """``value`` as an integer in ``lo .. hi``; :class:`DbError` naming ``name`` otherwise
    (floats, infinities, bools and out-of-range integers included)."""
    if not is_int(value) or not lo <= value <= hi:  # type: ignore[operator]
        raise DbError(f"{name}: expected an integer in {lo}..{hi}, got {show(value)}")
    return value  # type: ignore[return-value]


def read_pair(value: object, name: str) -> tuple[int, int]:
    """An inclusive range ``[lo, hi]`` with ``1 <= lo <= hi <= MAX_FIELD_INT`` (a single
    integer ``n`` means ``[n, n]``)."""
    if is_int(value):
        value = [value, value]
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(is_int(v) for v in value)
            or not 1 <= value[0] <= value[1] <= MAX_FIELD_INT):
        raise DbError(f"{name}: expected [lo, hi] with 1 <= lo <= hi <= {MAX_FIELD_INT}, "
                      f"got {show(value)}")
    return (value[0], value[1])


def finite_number(value: object) -> float | None:
    """``value`` as a finite float, or None for anything else: a bool, a non-number, NaN, an
    infinity, an integer too large for a float (where ``float()`` itself raises ``OverflowError``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def read_positive_number(value: object, name: str) -> float:
    """A finite number > 0 (a time)."""
    number = finite_number(value)
    if number is None or number <= 0:
        raise DbError(f"{name}: expected a positive number, got {show(value)}")
    return number
