"""CPU checks of the TMA tensor-map helper: bad cache sizes are one-line errors, and a machine
without the NVIDIA driver gets a NoGpuError naming it (the map is encoded by libcuda)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from snapmla_cli.errors import NoGpuError, SnapmlaError
from snapmla_cli.runtime import tensor_map


def _has_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_partial_pages_are_rejected() -> None:
    with pytest.raises(SnapmlaError, match="whole 64-token pages"):
        tensor_map.fp8_cache_tensor_maps(torch.zeros(63, 656, dtype=torch.uint8))
    with pytest.raises(SnapmlaError, match="whole 64-token pages"):
        tensor_map.fp8_cache_tensor_maps(torch.zeros(64 * 656 + 1, dtype=torch.uint8))
    with pytest.raises(SnapmlaError, match="whole 64-token pages of 1152 B"):
        tensor_map.bf16_cache_tensor_map(torch.zeros(63, 1, 576, dtype=torch.bfloat16))


@pytest.mark.skipif(_has_libcuda(), reason="the driver is installed here")
def test_missing_driver_is_a_nogpu_error() -> None:
    tensor_map._encode_tiled.cache_clear()
    with pytest.raises(NoGpuError, match="libcuda.so.1"):
        tensor_map.encode_byte_map(0x1000, 64, 656, 128, 64, True)
