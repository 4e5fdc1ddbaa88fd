"""The suite collects on the GPU machine's image, which has the runtime dependencies but not the
test extra.

Why a test: `scripts/gpu_check.sh tests` runs `pytest -m gpu tests` there, and pytest imports every
test module before it selects by marker. One module that imported mypy at its top (the test extra,
absent from that image) stopped the whole GPU suite at collection in the forty-first session, a
failure that only shows on the GPU, whose time is scarce. This test collects the suite here with
the test extra's packages made unimportable, as they are on that image.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The test extra's packages that the GPU machine's image does not have (pyproject's `test` extra
# less pytest; transformers is on that image).
ABSENT_ON_GPU_IMAGE = ("mypy", "matplotlib")

# A child interpreter in which importing the packages of argv[1] fails as it does on that image,
# then pytest's collection of argv[2] with the GPU marker; the exit status is pytest's.
COLLECT_WITHOUT_EXTRA = """
import sys, importlib.abc
absent = set(sys.argv[1].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", sys.argv[2]]))
"""


def collect_without(absent: tuple[str, ...], target: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """pytest's collection of `target` (GPU marker) in a child where `absent` cannot be imported."""
    return subprocess.run(
        [sys.executable, "-c", COLLECT_WITHOUT_EXTRA, ",".join(absent), target],
        cwd=cwd,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_gpu_selection_collects_without_the_test_extra() -> None:
    result = collect_without(ABSENT_ON_GPU_IMAGE, "tests", ROOT)
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    assert result.returncode == 0, f"collection failed: {errors or result.stdout[-2000:]}"
    assert "tests/gpu/" in result.stdout, "the GPU selection collected no GPU test"


def test_the_stand_in_makes_the_extra_unimportable(tmp_path: Path) -> None:
    """The stand-in itself bites: a module importing mypy at its top fails to collect under it."""
    imports_mypy = tmp_path / "test_imports_mypy.py"
    imports_mypy.write_text("import mypy.api\n\n\ndef test_nothing() -> None:\n    pass\n")
    result = collect_without(("mypy",), str(imports_mypy), tmp_path)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "No module named 'mypy" in result.stdout, result.stdout[-2000:]


def test_only_gpu_marked_tests_are_skipped_for_want_of_a_gpu(request) -> None:
    """The GPU skip follows the ``gpu`` marker, not pytest's keywords: a CPU test parametrized with
    an id "gpu" (``test_a_merge_does_not_drop_fields_it_does_not_know[gpu]``) was skipped on every
    machine without a GPU while the suite counted it as covered."""
    from conftest import GPU_SKIP_REASON

    items = request.session.items
    skipped_for_gpu = [item for item in items if any(mark.kwargs.get("reason") == GPU_SKIP_REASON
                                                     for mark in item.iter_markers("skip"))]
    assert all(item.get_closest_marker("gpu") is not None for item in skipped_for_gpu), \
        [item.nodeid for item in skipped_for_gpu if item.get_closest_marker("gpu") is None]
    probe = [item for item in items if item.name == "test_a_merge_does_not_drop_fields_it_does_not_know[gpu]"]
    assert all(item.get_closest_marker("gpu") is None and item not in skipped_for_gpu for item in probe)
