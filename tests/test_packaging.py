"""An installed snapmla, not only the checkout, carries its kernels and its shipped tuning
database: the wheel maps the top-level ``kernels/`` and ``tuning_db/`` into the package
(``pyproject.toml``), and :mod:`snapmla_cli.bundled` finds them there.

Without this, ``pip install git+...`` or a wheel gave a package whose first decode call failed
with "kernel sources: folder .../site-packages/kernels not found".
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from snapmla_cli import __version__
from snapmla_cli.bundled import KERNELS, TUNING_DB, bundled_dir
from snapmla_cli.runtime.kernel_cache import CACHE_DIR_ENV
from snapmla_cli.runtime.nvrtc import KERNEL_DIR_ENV, kernel_dir, product_sources_hash
from snapmla_cli.tuning.db import TUNING_DIR_ENV, shipped_dir

REPO = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md", "snapmla_cli", KERNELS, TUNING_DB)
KERNEL_SUFFIXES = (".cu", ".cuh")


def _pyproject_packages() -> list[str]:
    tomllib = pytest.importorskip("tomllib")
    with (REPO / "pyproject.toml").open("rb") as handle:
        return list(tomllib.load(handle)["tool"]["setuptools"]["packages"])


def _source_packages() -> set[str]:
    """Every folder of ``snapmla_cli/`` with an ``__init__.py``, as a dotted name."""
    return {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "snapmla_cli").rglob("__init__.py")}


def _bundled_packages() -> set[str]:
    """``snapmla_cli.kernels``, its subfolders, ``snapmla_cli.tuning_db``."""
    names = {f"snapmla_cli.{TUNING_DB}", f"snapmla_cli.{KERNELS}"}
    for folder in (REPO / KERNELS).rglob("*"):
        if folder.is_dir() and not folder.name.startswith((".", "__")):
            names.add(".".join(("snapmla_cli", KERNELS, *folder.relative_to(REPO / KERNELS).parts)))
    return names


def test_pyproject_lists_every_package_once() -> None:
    """A new subpackage missing from the explicit list would be dropped from wheels silently."""
    listed = _pyproject_packages()
    assert len(listed) == len(set(listed))
    assert set(listed) == _source_packages() | _bundled_packages()


def test_checkout_resolves_the_top_level_folders() -> None:
    assert bundled_dir(KERNELS) == REPO / KERNELS
    assert shipped_dir() == REPO / TUNING_DB


def test_package_copy_wins_over_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed layout: the folder inside the package is used even where a checkout's
    folder of the same name sits beside the package."""
    from snapmla_cli import bundled

    package = tmp_path / "snapmla_cli"
    (package / KERNELS).mkdir(parents=True)
    (tmp_path / KERNELS).mkdir()
    monkeypatch.setattr(bundled, "PACKAGE_ROOT", package)
    assert bundled.bundled_dir(KERNELS) == package / KERNELS
    assert bundled.bundled_dir(TUNING_DB) == tmp_path / TUNING_DB  # neither exists: the checkout's, named in errors


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(args, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """A wheel built from a copy of the tree (the build writes ``build/`` beside its sources) and
    installed into a folder of its own: (wheel, site folder, environment that sees only it)."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    env = {k: v for k, v in os.environ.items() if k not in (KERNEL_DIR_ENV, TUNING_DIR_ENV, "PYTHONPATH")}
    wheels = work / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheels)],
         work, env)
    (wheel,) = wheels.glob("snapmla-*.whl")
    site = work / "site"
    _run([*pip, "install", str(wheel), "--no-deps", "--no-index", "-q", "--target", str(site)], work, env)
    env["PYTHONPATH"] = str(site)
    return wheel, site, env


def test_wheel_holds_every_kernel_source_and_database(installed: tuple[Path, Path, dict[str, str]]) -> None:
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = [p for p in (REPO / KERNELS).rglob("*") if p.suffix in KERNEL_SUFFIXES]
    databases = list((REPO / TUNING_DB).glob("*.yaml"))
    assert kernels and databases
    for path in kernels + databases:
        assert f"snapmla_cli/{path.relative_to(REPO).as_posix()}" in names
    python = {p.relative_to(REPO).as_posix() for p in (REPO / "snapmla_cli").rglob("*.py")}
    assert python <= names
    assert f"snapmla-{__version__}.dist-info/METADATA" in names


def test_installed_package_finds_its_kernels(installed: tuple[Path, Path, dict[str, str]]) -> None:
    """Run from outside the checkout, with only the installed copy on the path: the kernels and
    the database resolve inside it, and the kernels hash like the checkout's (the tuning
    database's entries are stamped with that hash, so they stay current after installing)."""
    _, site, env = installed
    probe = ("import json, snapmla_cli; from snapmla_cli.runtime.nvrtc import kernel_dir, product_sources_hash; "
             "from snapmla_cli.tuning.db import shipped_dir; from snapmla_cli.cli.common import version_line; "
             "print(json.dumps([snapmla_cli.__file__, str(kernel_dir()), product_sources_hash(kernel_dir()), "
             "str(shipped_dir()), version_line()]))")
    package, kernels, digest, database, version = json.loads(_run([sys.executable, "-c", probe], site.parent, env))
    assert Path(package).resolve().is_relative_to(site.resolve())
    assert Path(kernels) == site.resolve() / "snapmla_cli" / KERNELS
    assert digest == product_sources_hash(kernel_dir())
    assert Path(database) == site.resolve() / "snapmla_cli" / TUNING_DB
    assert {p.name for p in Path(database).glob("*.yaml")} == {p.name for p in (REPO / TUNING_DB).glob("*.yaml")}
    assert version == f"snapmla {__version__} (kernel sources {digest})"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy's NVRTC (the cuda extra)")
def test_installed_kernels_compile(installed: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    """NVRTC builds a kernel from the installed copy, headers of ``common/`` included, into an
    empty compile cache (no GPU needed)."""
    _, site, env = installed
    probe = ("import json; from snapmla_cli.runtime import nvrtc; "
             "from snapmla_cli.runtime.registry import PREP_DEFINES, PREP_SOURCE; "
             "m = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, 'sm_90a'); "
             "print(json.dumps([m.origin, m.entry_names(), str(nvrtc.kernel_dir())]))")
    origin, entries, kernels = json.loads(_run([sys.executable, "-c", probe], site.parent,
                                               {**env, CACHE_DIR_ENV: str(tmp_path / "cache")}))
    assert origin == "nvrtc" and entries
    assert Path(kernels) == site.resolve() / "snapmla_cli" / KERNELS
