"""Small pieces shared by the subcommands: consoles, number formatting, progress bars, the
``--device`` choice and writing JSON reports."""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..cache.atomic import write_text_atomic
from ..errors import SnapmlaError

_PIPE_WIDTH = 160  # rich's width when the output is not a terminal (pipes, files, CI logs)


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def console(stderr: bool = False) -> Console:
    """A console on stdout (tables) or stderr (progress); wide enough for the tables in logs.
    Markup is off (paths may hold brackets): style with ``rich.text.Text``."""
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, markup=False, width=None if probe.is_terminal else _PIPE_WIDTH)


def require_at_least(option: str, value: int | None, least: int = 1) -> None:
    """A one-line error naming ``option`` when a count given on the command line is below
    ``least`` (None: the option was left out)."""
    if value is not None and value < least:
        raise SnapmlaError(f"{option}: expected at least {least}, got {value}")


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.{digits}e}"


def progress(err: Console) -> Progress:
    """A transient progress bar on stderr (disappears when done, invisible in pipes)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,  # off a terminal rich would still end with an empty line
    )


def _json_safe(value: object) -> object:
    """Standard JSON has no inf/NaN: write them as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: Path, payload: dict) -> None:
    write_text_atomic(path, json.dumps(_json_safe(payload), indent=2) + "\n")
