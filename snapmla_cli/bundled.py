"""Where the files snapmla ships beside its Python code live: the CUDA sources (``kernels``),
compiled at run time, and the shipped tuning databases (``tuning_db``).

A source checkout (and an editable install) keeps them at the repository's top level, next to
``snapmla_cli/``. A wheel cannot hold top-level folders, so ``pyproject.toml`` maps them into the
package (``snapmla_cli/kernels``, ``snapmla_cli/tuning_db``): an engine that installs snapmla
from a wheel or a git URL finds its kernels without the repository. One lookup serves both, the
copy inside the package first.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
KERNELS = "kernels"
TUNING_DB = "tuning_db"


def bundled_dir(name: str) -> Path:
    """The folder ``name`` inside the installed package if it is there, else the checkout's
    (which may be absent too: the callers name the folder in their error)."""
    inside = PACKAGE_ROOT / name
    return inside if inside.is_dir() else PACKAGE_ROOT.parent / name
