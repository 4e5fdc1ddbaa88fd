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


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """Maps encoded without a driver (zero bytes, kept in host memory), a small map cache, and a
    switch standing in for ``torch.cuda.is_current_stream_capturing``."""
    state = {"capturing": False}
    monkeypatch.setattr(tensor_map, "encode_byte_map", lambda *args: bytes(tensor_map.TENSOR_MAP_BYTES))
    monkeypatch.setattr(tensor_map, "_capturing", lambda cache: state["capturing"])
    monkeypatch.setattr(tensor_map, "MAX_CACHED_MAPS", 2)
    monkeypatch.setattr(tensor_map, "TENSOR_MAP_ALIGN", 1)  # (a host buffer stands in for the GPU's)
    monkeypatch.setattr(tensor_map, "_maps", type(tensor_map._maps)())
    monkeypatch.setattr(tensor_map, "_pinned", {})
    return state


def _caches(count: int) -> list[torch.Tensor]:
    return [torch.zeros(64, 656, dtype=torch.uint8) for _ in range(count)]


def test_maps_evicted_without_a_graph_are_rebuilt(fake_driver: dict[str, bool]) -> None:
    first, *others = _caches(4)
    maps = tensor_map.fp8_cache_tensor_maps(first)
    assert tensor_map.fp8_cache_tensor_maps(first) is maps  # cached
    for cache in others:  # three more caches: the first one's maps are evicted
        tensor_map.fp8_cache_tensor_maps(cache)
    assert tensor_map.fp8_cache_tensor_maps(first) is not maps


def test_maps_used_in_a_graph_capture_outlive_their_eviction(fake_driver: dict[str, bool]) -> None:
    """A captured graph keeps the maps' device address: evicted and freed, the buffer could be
    reused by the caching allocator and the replay's TMA would read garbage as its map."""
    first, *others = _caches(4)
    maps = tensor_map.fp8_cache_tensor_maps(first)
    fake_driver["capturing"] = True
    assert tensor_map.fp8_cache_tensor_maps(first) is maps  # used by the capture: pinned
    with pytest.raises(SnapmlaError, match="^k_cache: its TMA tensor maps are built"):
        tensor_map.fp8_cache_tensor_maps(others[0])  # no maps yet: not built inside a capture
    fake_driver["capturing"] = False
    for cache in others:
        tensor_map.fp8_cache_tensor_maps(cache)
    assert len(tensor_map._maps) == 2 and tensor_map._pinned
    assert tensor_map.fp8_cache_tensor_maps(first) is maps  # the graph's buffer, not a new one


def test_maps_forgotten_by_the_cache_are_freed_after_their_gpu_drains(fake_driver: dict[str, bool],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel on another stream than the maps were made on may still read them when the LRU
    forgets them: the GPU is synchronized before the buffer goes back to the caching allocator."""
    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    on_gpu = type("GpuBuffer", (), {"is_cuda": True, "device": "cuda:3"})()  # stands in for a CUDA tensor
    tensor_map._maps[(3, 0x1000, 64, 656)] = on_gpu  # type: ignore[assignment]
    first, second = _caches(2)
    tensor_map.fp8_cache_tensor_maps(first)
    assert not synced  # two entries: nothing forgotten
    tensor_map.fp8_cache_tensor_maps(second)  # the GPU buffer is the least recently used
    assert synced == ["cuda:3"] and all(kept is not on_gpu for kept in tensor_map._maps.values())
