"""The GPU suite's own helpers, loaded as tests/gpu/test_coverage_gaps.py loads test_prep.py: the
proposed tests reuse _run / _check_against_reference / _nan_outputs (test_coverage_gaps.py) and
_Step / _plan_cluster (test_split_fold_gpu.py) rather than copies of them. Works from tests/gpu/
(the sibling files) and from anywhere else (the repository's tests/gpu/ beside snapmla_cli)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import snapmla_cli


def gpu_test_dir() -> Path:
    here = Path(__file__).resolve().parent
    if (here / "test_coverage_gaps.py").is_file():
        return here
    return Path(snapmla_cli.__file__).resolve().parents[1] / "tests" / "gpu"


def load(name: str) -> ModuleType:
    """tests/gpu/<name>.py as a module of its own (its tests are not collected twice: only the
    module object is bound here)."""
    key = f"_audit_{name}"
    if key in sys.modules:
        return sys.modules[key]
    folder = gpu_test_dir()
    if str(folder) not in sys.path:  # (graph_steps, which test_coverage_gaps imports by name)
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(key, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
