"""Tables of figures for the terminal, built in one place so that every command treats a cell
that does not fit the same way: folded onto a second line, never cropped to "18,305,1…", which
reads as a different number."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, Final

from rich.table import Table

FIGURE_OVERFLOW: Final = "fold"


def figure_table(title: str, columns: Iterable[str], *, left: Collection[str] = (), **table_options: Any) -> Table:
    """A rich table whose columns are right-aligned figures (the names in ``left`` are text
    columns, left-aligned) and fold rather than crop."""
    table = Table(title=title, **table_options)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right", overflow=FIGURE_OVERFLOW)
    return table
