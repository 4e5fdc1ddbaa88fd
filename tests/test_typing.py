"""The package and the developer scripts type-check (``[tool.mypy]`` in pyproject.toml: every
function annotated, every body checked).

Why a test: the brief asks for typed Python, and a type error is often a real bug that no other
test reaches (one found this way: a count helper was handed a text, ``counted("dump", ...)``,
and printed the right words only by luck). mypy runs without a GPU, in about 15 s cold.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# mypy is in the test extra (pip install -e ".[test]", which CI runs); the GPU machine's image has
# no mypy, and its `pytest -m gpu` run must still collect this module.
mypy_api = pytest.importorskip("mypy.api", reason="mypy is in the test extra")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _from_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """mypy finds ``snapmla_cli`` and the scripts' sibling imports from the working folder."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module: the package is analysed once, not per test."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(cache: Path, *targets: str) -> tuple[str, int]:
    stdout, stderr, status = mypy_api.run([
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(cache),
        "--no-error-summary",
        *targets,
    ])
    return stdout + stderr, status


def test_package_type_checks(cache_dir: Path) -> None:
    report, status = _mypy(cache_dir, str(ROOT / "snapmla_cli"))
    assert status == 0, report


def test_scripts_type_check(cache_dir: Path) -> None:
    """The scripts import the package and run on the GPU machine only: a wrong argument type
    there costs device time before it shows."""
    report, status = _mypy(cache_dir, "--explicit-package-bases", str(ROOT / "scripts"))
    assert status == 0, report


def test_a_type_error_is_reported(tmp_path: Path, cache_dir: Path) -> None:
    """The check can fail: a call with a wrong argument type in a file of its own."""
    bad = tmp_path / "bad_call.py"
    bad.write_text("from snapmla_cli.sizes import counted\n\nprint(counted('dump', 'query'))\n")
    report, status = _mypy(cache_dir, str(bad))
    assert status == 1 and 'incompatible type "str"; expected "int"' in report, report


def test_a_caller_sees_the_public_api_typed(tmp_path: Path, cache_dir: Path) -> None:
    """An engine's ``import snapmla_cli as snapmla`` gets the real signatures (the package ships
    py.typed): the names resolve lazily through a module ``__getattr__``, which mypy alone reads
    as Any, so a wrong argument to any public function once type-checked."""
    user = tmp_path / "engine_step.py"
    user.write_text(
        "import torch\n"
        "import snapmla_cli as snapmla\n\n"
        "def step(q: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:\n"
        "    meta, splits = snapmla.get_mla_metadata(lens, 16, 1)\n"
        "    work = snapmla.GraphWorkList(4, 16, 'cuda', max_context=4096)\n"
        "    work.update(lens)\n"
        "    return snapmla.quantize_q(q).scale\n\n"
        "wrong: int = snapmla.quantize_q('text')\n"
    )
    report, status = _mypy(cache_dir, str(user))
    assert status == 1, report
    assert 'Argument 1 to "quantize_q" has incompatible type "str"; expected "Tensor"' in report, report
    assert 'expression has type "QuantizedRows", variable has type "int"' in report, report
    assert report.count("error:") == 2, report  # the correct lines pass
