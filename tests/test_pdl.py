"""CPU checks of the programmatic-dependent-launch path (runtime/pdl.py): the ctypes mirrors of
the driver's launch structs have the driver's layout, arguments are packed with their C types,
and only kernels built for sm_90+ (where griddepcontrol.wait exists) are launched that way."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.runtime import pdl
from snapmla_cli.runtime.launch import supports_programmatic


def test_launch_structs_match_the_driver_layout() -> None:
    # cuda.h: CUlaunchAttribute = {id, pad to 8, 64-byte value}; CUlaunchConfig = 7 uints,
    # the stream handle, the attribute pointer, the attribute count
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72
    assert pdl.LaunchAttribute.value.offset == 8
    assert pdl.LaunchConfig.shared_mem.offset == 24
    assert pdl.LaunchConfig.stream.offset == 32
    assert pdl.LaunchConfig.attrs.offset == 40
    assert pdl.LaunchConfig.num_attrs.offset == 48
    assert ctypes.sizeof(pdl.LaunchConfig) == 56


def test_arguments_are_packed_with_their_c_types() -> None:
    pointers, values = pdl.pack_args([0x7F0000001000, np.int32(-3), np.float32(0.5), np.int64(2**40)])
    assert len(values) == 4
    assert ctypes.c_void_p.from_address(pointers[0]).value == 0x7F0000001000
    assert ctypes.c_int32.from_address(pointers[1]).value == -3
    assert ctypes.c_float.from_address(pointers[2]).value == 0.5
    assert ctypes.c_int64.from_address(pointers[3]).value == 2**40
    with pytest.raises(SnapmlaError, match="argument 1: float has no C type"):
        pdl.pack_args([0, 1.5])


def test_environment_switch(monkeypatch) -> None:
    monkeypatch.delenv("SNAPMLA_PDL", raising=False)
    assert pdl.enabled()
    monkeypatch.setenv("SNAPMLA_PDL", "0")
    assert not pdl.enabled()


@pytest.mark.parametrize(("arch", "expected"), [("sm_90a", True), ("sm_100a", True), ("sm_89", False),
                                                ("sm_80", False)])
def test_only_sm90_builds_launch_programmatically(arch: str, expected: bool) -> None:
    kernel = SimpleNamespace(compiled=SimpleNamespace(arch=arch))
    assert supports_programmatic(kernel) is expected  # type: ignore[arg-type]


def test_only_an_off_word_switches_pdl_off(monkeypatch) -> None:
    for value, expected in (("1", True), ("true", True), ("0", False), ("off", False)):
        monkeypatch.setenv("SNAPMLA_PDL", value)
        assert pdl.enabled() is expected
    monkeypatch.setenv("SNAPMLA_PDL", "2")  # neither word: the default (on), and a warning naming it
    with pytest.warns(UserWarning, match=r"SNAPMLA_PDL='2' is neither on .* taken as on"):
        assert pdl.enabled() is True


def test_the_programmatic_attribute_and_the_launch_configuration() -> None:
    attr = pdl.programmatic_attribute()
    assert attr.id == 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert ctypes.c_int.from_buffer(attr.value).value == 1  # allowed
    config = pdl.launch_config((4,), (128, 2), 1024, 0xABC0, attr)
    assert (config.grid_x, config.grid_y, config.grid_z) == (4, 1, 1)
    assert (config.block_x, config.block_y, config.block_z) == (128, 2, 1)
    assert config.shared_mem == 1024 and config.stream == 0xABC0
    assert config.num_attrs == 1 and ctypes.addressof(config.attrs.contents) == ctypes.addressof(attr)
    pdl.check_status(pdl.CUDA_SUCCESS, config)
    with pytest.raises(SnapmlaError, match=r"CUresult 1 \(grid \(4, 1, 1\), block \(128, 2, 1\), 1024 B"):
        pdl.check_status(1, config)  # CUDA_ERROR_INVALID_VALUE


def test_a_prepared_launch_sets_the_stream_and_the_arguments_of_each_call(monkeypatch) -> None:
    launched: list[tuple[int, int, int, int]] = []

    def fake_launch_kernel_ex(config_ref, function, params, extra) -> int:
        config = config_ref._obj
        launched.append((config.stream, function.value, ctypes.c_void_p.from_address(params[0]).value,
                         ctypes.c_int32.from_address(params[1]).value))
        return 0

    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: fake_launch_kernel_ex)
    prepared = pdl.ProgrammaticLaunch(0x1234, (2,), (64,), 0, [ctypes.c_void_p, ctypes.c_int32])
    prepared(0x77, [0xBEEF000, 5])
    prepared(0x78, [0xCAFE000, -6])
    assert launched == [(0x77, 0x1234, 0xBEEF000, 5), (0x78, 0x1234, 0xCAFE000, -6)]
    with pytest.raises(ValueError, match="shorter"):
        prepared(0x78, [0xCAFE000])  # one argument short: never launched with a stale value
    assert len(launched) == 2
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: (lambda *args: 2))
    with pytest.raises(SnapmlaError, match="cuLaunchKernelEx failed with CUresult 2"):
        prepared(0x77, [0xBEEF000, 5])
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: None)
    with pytest.raises(SnapmlaError, match="cuLaunchKernelEx is not available"):
        prepared(0x77, [0xBEEF000, 5])


def test_a_plain_prepared_launch_has_no_attribute_and_packs_the_first_calls_types(monkeypatch) -> None:
    """The decode kernel's prepared launch (runtime/launch.py prepare_plain): no attribute, its
    argument types those of its first call (pointers as ints, NumPy scalars), later calls only
    store new values."""
    launched: list[tuple[int, int, float, int]] = []

    def fake_launch_kernel_ex(config_ref, function, params, extra) -> int:
        config = config_ref._obj
        assert config.num_attrs == 0 and not config.attrs
        launched.append((ctypes.c_void_p.from_address(params[0]).value, ctypes.c_int32.from_address(params[1]).value,
                         ctypes.c_float.from_address(params[2]).value, config.stream))
        return 0

    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: fake_launch_kernel_ex)
    prepared = pdl.PreparedLaunch(0x1234, (3, 2), (384,), 200_000, None)
    assert prepared._config.shared_mem == 200_000 and prepared._config.grid_y == 2
    prepared(0x10, [0xBEEF000, np.int32(7), np.float32(0.5)])
    prepared(0x20, [0xCAFE000, np.int32(-3), np.float32(2.25)])
    assert launched == [(0xBEEF000, 7, 0.5, 0x10), (0xCAFE000, -3, 2.25, 0x20)]


def test_a_kernel_handle_prepares_one_launch_per_block_and_argument_types(monkeypatch) -> None:
    """KernelHandle.launch (the prep ops' path): one prepared launch per device, block and
    argument types, the grid set per call; another argument type gets its own (a pointer is
    never stored into an int slot)."""
    from snapmla_cli.runtime import launch

    seen: list[tuple[tuple[int, int, int], int, list[object]]] = []

    def fake_launch_kernel_ex(config_ref, function, params, extra) -> int:
        config = config_ref._obj
        first = ctypes.c_void_p.from_address(params[0]).value
        seen.append(((config.grid_x, config.grid_y, config.grid_z), config.stream, [first]))
        return 0

    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: fake_launch_kernel_ex)
    monkeypatch.setattr(launch, "current_raw_stream", lambda index: 0x99)
    monkeypatch.setattr(launch, "current_device_index", lambda: 0)
    handle = launch.KernelHandle("prep.cu", "snapmla_fake")
    handle._functions[0] = SimpleNamespace(ptr=0x4242)  # (as if loaded on device 0)
    handle.launch(0, (3, 1, 1), (256, 1, 1), (0xA000, np.int32(3)))
    handle.launch(0, (7, 1, 1), (256, 1, 1), (0xB000, np.int32(7)))
    handle.launch(0, (2, 1, 1), (256, 1, 1), (0xC000, np.int64(2)))
    assert seen == [((3, 1, 1), 0x99, [0xA000]), ((7, 1, 1), 0x99, [0xB000]), ((2, 1, 1), 0x99, [0xC000])]
    assert len(handle._launches) == 2  # int32 and int64 counts: two prepared launches
    handle.forget()
    assert not handle._launches
