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
