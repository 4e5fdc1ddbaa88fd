"""A sibling test module of tests/gpu/ loaded as a module of its own, so that a test file reuses
another's helpers (data generators, reference checks, plan inspection) rather than copies of
them; only the module object is bound, so its tests are not collected twice."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FOLDER = Path(__file__).resolve().parent


def load(name: str) -> ModuleType:
    """tests/gpu/``name``.py, loaded once per process."""
    key = f"_sibling_{name}"
    if key in sys.modules:
        return sys.modules[key]
    if str(FOLDER) not in sys.path:  # (graph_steps, which test_coverage_gaps imports by name)
        sys.path.insert(0, str(FOLDER))
    spec = importlib.util.spec_from_file_location(key, FOLDER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
