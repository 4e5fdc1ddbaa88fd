"""Parsing of the sizes and lists users type on the command line: ``32k``, ``32768``, ``1m``,
``16,64,128``. One place, so every subcommand (verify, quantize, synth, bench, tune) reads a
context length the same way."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from .errors import SnapmlaError

T = TypeVar("T", bound=Hashable)

_SUFFIX = {"": 1, "k": 1024, "m": 1024 * 1024}
# Token counts and lengths are int32 in the decode API and the file formats (SPEC sections 4, 8):
# no size may exceed it (a larger one would overflow there, or in a Python-to-C conversion first).
MAX_SIZE = 2**31 - 1
# Query heads and query tokens per request the commands accept: 8x the largest MLA model's heads
# (DeepSeek-V3's 128) and 4x the deepest MTP in use; a larger count is a typo, not a shape.
MAX_QUERY_HEADS = 1024
MAX_QUERY_TOKENS = 16
_SIZE = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")
# digits a size or count may have before it is refused as too large without being converted
# (int() of a string past Python's 4300-digit limit raises, and no real size has 20 digits)
MAX_DIGITS = 19
# The most requests a command decodes in one step (verify's and bench's --batch, tune's batch
# buckets): no engine decodes more on one GPU in one step, and the host work is per request
# (verify builds each request's cache and queries in Python, 0.05-0.2 s and up to 1 MB each on
# a CPU, which its memory estimate of the tokens does not count), so a few zeros too many would
# run for days or fill the memory instead of failing at once.
MAX_BATCH = 4096
BATCH_LIMIT_TEXT = f"{MAX_BATCH} requests"  # how every --batch error names the limit


def refuse_long_number(number: str, what: str, text: object, expected: str = "") -> None:
    """A one-line "too large" error for a decimal ``number`` (the digits a pattern matched in
    ``text``, a fraction allowed) of more than :data:`MAX_DIGITS` integer digits, raised before
    anything converts it; ``expected`` is appended (e.g. " (expected at most 1024)"), and without
    one the error names the digit limit, so that it always says what would be taken."""
    if len(number.split(".")[0].lstrip("0")) > MAX_DIGITS:
        limit = expected or f" (expected at most {MAX_DIGITS} digits)"
        raise SnapmlaError(f"{what}: {shorten(str(text))!r} is too large{limit}")


def parse_size(text: str | int, what: str = "size", most: int = MAX_SIZE, most_text: str | None = None) -> int:
    """``"32k"`` -> 32768, ``"1m"`` -> 1048576, ``"4096"`` -> 4096 (k = 1024, m = 1024*1024),
    between 1 and ``most``; an error beyond it names ``most_text`` (default ``most`` as a size:
    "4k"; a batch says "4096 requests", as every command's --batch does)."""
    limit = most_text or format_size(most)
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if match is None:
            raise SnapmlaError(f"{what}: {text!r} is not a size (expected e.g. 2048, 32k or 1m)")
        refuse_long_number(match.group(1), what, text, f" (expected at most {limit})")
        value = int(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if value < 1:
        raise SnapmlaError(f"{what}: {text!r} must be at least 1")
    if value > most:
        raise SnapmlaError(f"{what}: {text!r} is too large (expected at most {limit})")
    return value


def require_batch(what: str, batch: int | None) -> None:
    """A one-line error naming ``what`` for a batch beyond :data:`MAX_BATCH` (None: not given)."""
    if batch is not None and batch > MAX_BATCH:
        raise SnapmlaError(f"{what}: {batch} is too large (expected at most {BATCH_LIMIT_TEXT})")


def unique_values(what: str, items: Iterable[tuple[T, str]], show: Callable[[T], str] = str) -> list[T]:
    """The values of ``items`` (pairs of a value and the text it was typed as), in order; a value
    given twice, in any spelling (``16k,16384``), is a one-line error naming ``what`` and the
    value (``--ctx: 16384 given twice ('16k' and '16384')``). Not dropped quietly: a repeat is
    most often a typo for another value (``--heads 16,64,64`` for 128), and running fewer cases
    than were typed would hide it."""
    seen: dict[T, str] = {}
    for value, typed in items:
        if value in seen:
            first = seen[value].strip()
            spelled = f" ({shorten(first)!r} and {shorten(typed.strip())!r})" if first != typed.strip() else ""
            raise SnapmlaError(f"{what}: {show(value)} given twice{spelled}")
        seen[value] = typed
    return list(seen)


def split_list(text: str, what: str, example: str) -> list[str]:
    """The items of the comma list ``text`` (an option's value, ``"16, 64,128"``) as typed, the
    whitespace around each kept for the messages that quote an item; every list option parses
    through here, so all of them refuse the same lists. A blank ``text`` and an empty item (an
    empty or all-blank text between commas: ``16,,64``, ``1,``, ``,2``, ``8, ,16``) are one-line
    errors naming ``what`` and showing ``example``. An empty item is not skipped: a doubled or
    trailing comma is most often a value left out (``16,,64`` for ``16,32,64``), and running
    fewer cases than were typed would hide it."""
    text = str(text)
    if not text.strip():
        raise SnapmlaError(f"{what}: {text!r} is empty (expected e.g. {example})")
    items = text.split(",")
    for position, item in enumerate(items, start=1):
        if not item.strip():
            raise SnapmlaError(f"{what}: {shorten(text)!r} has an empty item (item {position} of {len(items)};"
                               f" expected e.g. {example})")
    return items


def parse_size_list(text: str, what: str = "list", example: str = "16k,64k") -> list[int]:
    """``"16k,64k"`` -> ``[16384, 65536]``; each item may carry a k/m suffix; a size given twice
    is an error (:func:`unique_values`), as are a blank list and an empty item (:func:`split_list`)."""
    return unique_values(what, ((parse_size(part, what), part) for part in split_list(text, what, example)))


def parse_int_list(text: str, what: str, most: int, example: str = "16,64") -> list[int]:
    """``"64"`` or ``"16,64,128"`` -> ints in 1..``most`` without size suffixes (head counts,
    query tokens), order kept, a count given twice an error (:func:`unique_values`); ``example``
    is the option's own sample value that an error message shows (``--mtp``'s is ``1,2``, not a
    head list). A blank list and an empty item are errors too (:func:`split_list`)."""
    out: list[tuple[int, str]] = []
    for typed in split_list(text, what, example):
        part = typed.strip()
        if part.isascii() and part.isdigit():
            refuse_long_number(part, what, part, f" (expected at most {most})")
        if not (part.isascii() and part.isdigit()) or int(part) < 1:
            raise SnapmlaError(f"{what}: {part!r} is not a positive integer (expected e.g. {example})")
        if int(part) > most:
            raise SnapmlaError(f"{what}: {part} is too large (expected at most {most})")
        out.append((int(part), part))
    return unique_values(what, out)


def format_size(value: int) -> str:
    """Inverse of :func:`parse_size` for display: 32768 -> ``32k``, 1000 -> ``1000``."""
    for suffix, unit in (("m", 1024 * 1024), ("k", 1024)):
        if value >= unit and value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def shorten(text: str, limit: int = 24) -> str:
    """``text`` cut to ``limit`` characters for an error message (a 5,000-digit typo, a long key
    of a database file: the message stays one readable line)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and its noun in the right number for a message: ``1 layer``, ``2 layers``,
    ``1 query`` / ``3 queries`` (``plural`` for the nouns that do not take an s)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
