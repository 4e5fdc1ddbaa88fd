"""The ``--plot`` outputs of ``snapmla quantize`` and ``snapmla bench``: which files a figure may
be written to, and matplotlib loaded headless. One place, so both commands refuse a bad
``--plot`` the same way, up front, before any work (and never with matplotlib's traceback)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from .errors import SnapmlaError

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_plot_path(path: Path) -> None:
    """A one-line error unless ``path`` names a figure format the plots are written in."""
    if Path(path).suffix.lower() not in PLOT_SUFFIXES:
        raise SnapmlaError(f"--plot {path}: expected a {', '.join(PLOT_SUFFIXES)} file")


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or a one-line error saying
    how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SnapmlaError("--plot needs matplotlib: pip install 'snapmla[plot]'") from None
    return plt


def check_plot_output(path: Path) -> ModuleType:
    """Everything about a ``--plot`` path that can fail before the work: its format and
    matplotlib (whether the file may be overwritten is :func:`cache.atomic.check_writable`'s).
    Returns ``matplotlib.pyplot`` for the plotting functions, which check again on their own."""
    check_plot_path(path)
    return pyplot()
