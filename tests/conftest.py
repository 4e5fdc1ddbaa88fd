"""Shared pytest setup: tests marked ``gpu`` are skipped when torch sees no CUDA GPU, a
fixture gives a test its own tuning-database folders, and one takes permissions away.

Why here and not in each file: CI machines have no GPU, and every GPU test module should skip
the same way (one reason line in ``-ra``), while still being collected so import errors show;
the tuning tests and the decode-choice tests need the same isolation from the user's and the
shipped databases.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

GPU_SKIP_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # (not ``"gpu" in item.keywords``: a
            item.add_marker(skip_gpu)  # parametrize id "gpu" is a keyword too, and skipped a CPU test)


@pytest.fixture
def isolated_tuning_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """(user, shipped) tuning-database folders under tmp_path, in place of the real ones, with the
    lookup's memo cleared before and after."""
    from snapmla_cli.tuning import db as tdb
    from snapmla_cli.tuning import lookup

    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(user))
    monkeypatch.setattr(tdb, "shipped_dir", lambda: shipped)
    lookup.clear_cache(reset_warnings=True)
    yield user, shipped
    lookup.clear_cache(reset_warnings=True)


@pytest.fixture
def denied_paths(monkeypatch: pytest.MonkeyPatch) -> set[Path]:
    """Paths ``os.access`` answers False for: add one to take its permissions away, remove it to
    give them back. The tests run as root, whom a chmod stops from nothing."""
    denied: set[Path] = set()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *args, **kwargs:
                        False if Path(path) in denied else real_access(path, mode, *args, **kwargs))
    return denied
