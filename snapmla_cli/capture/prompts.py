"""Prompt files for ``snapmla dump``: plain text (one prompt per non-blank line) or JSON Lines
(each line a JSON string, or an object with a ``prompt`` or ``text`` field, so multi-line
prompts can be written with ``\\n``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..cache.dump_file import check_input_file
from ..errors import SnapmlaError


def read_prompts(path: Path) -> list[str]:
    """The prompts of ``path`` (UTF-8, with or without a BOM) in file order; an empty or
    unreadable file is a one-line error."""
    path = Path(path)
    check_input_file(path, "--prompts")  # also: a fifo would block the read forever
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading BOM is no part of the first prompt
    except (OSError, UnicodeDecodeError) as exc:
        raise SnapmlaError(f"--prompts {path}: cannot read it ({exc})") from None
    lines = [(n, line) for n, line in enumerate(_lines(text), start=1) if line.strip()]
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        prompts = [_json_prompt(path, n, line) for n, line in lines]
    else:
        prompts = [line.strip() for _, line in lines]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise SnapmlaError(f"--prompts {path}: the file holds no prompts")
    return prompts


def _lines(text: str) -> list[str]:
    """``text`` split at line ends, "\\n" or "\\r\\n" only. ``str.splitlines`` also splits at
    form feed, \\x1c-\\x1e, NEL and U+2028/U+2029, which may stand inside a prompt (and JSON allows
    U+2028 raw inside a string), so it would cut one prompt or one JSON line in two."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _json_prompt(path: Path, n: int, line: str) -> str:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SnapmlaError(f"--prompts {path}:{n}: not JSON ({exc.msg})") from None
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in ("prompt", "text"):
            if isinstance(item.get(key), str):
                return item[key]
    raise SnapmlaError(
        f"--prompts {path}:{n}: expected a JSON string or an object with 'prompt' or 'text'"
    )
