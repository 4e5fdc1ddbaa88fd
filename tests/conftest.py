"""Shared pytest setup: tests marked ``gpu`` are skipped when torch sees no CUDA GPU.

Why here and not in each file: CI machines have no GPU, and every GPU test module should skip
the same way (one reason line in ``-ra``), while still being collected so import errors show.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
