"""Programmatic dependent launch (PDL): start a kernel while the one before it on the stream is
still finishing.

Why this module: the split-KV combine follows the decode kernel on the same stream. Launched
normally, it starts only after the decode grid has fully drained, and then pays its own launch
and CTA rasterization. With the programmatic-stream-serialization attribute the driver may
launch it as soon as every decode CTA has run ``griddepcontrol.launch_dependents`` (the decode
kernels do so at their start); the combine then waits in ``griddepcontrol.wait`` for the decode
grid's completion and memory flush before it reads anything. The attribute is only reachable
through ``cuLaunchKernelEx``, which neither torch nor CuPy exposes, so it is called through
``ctypes`` on ``libcuda`` (as ``tensor_map`` does for the TMA maps). Inside CUDA graph capture
the driver turns the attribute into a programmatic graph edge.

``SNAPMLA_PDL=0`` in the environment launches normally (for A/B timing and as an escape hatch).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from ..env_switch import env_switch
from ..errors import SnapmlaError

LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
LAUNCH_ATTR_VALUE_BYTES = 64  # sizeof(CUlaunchAttributeValue)
CUDA_SUCCESS = 0  # CUresult

_C_TYPES: dict[type, type] = {
    np.int32: ctypes.c_int32,
    np.int64: ctypes.c_int64,
    np.uint32: ctypes.c_uint32,
    np.uint64: ctypes.c_uint64,
    np.float32: ctypes.c_float,
}


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: the id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_ubyte * LAUNCH_ATTR_VALUE_BYTES)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def enabled() -> bool:
    """PDL unless ``SNAPMLA_PDL=0`` (read per call: cheap, and tests / A-B runs can flip it)."""
    return env_switch("SNAPMLA_PDL", True)


@lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def driver_function(name: str, argtypes: Sequence[object]) -> Callable[..., int] | None:
    """``libcuda``'s ``name`` returning a ``CUresult``, or None without a driver or where the
    driver is too old to have it."""
    libcuda = _libcuda()
    fn = None if libcuda is None else getattr(libcuda, name, None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    return fn


@lru_cache(maxsize=1)
def _launch_kernel_ex() -> Callable[..., int] | None:
    return driver_function("cuLaunchKernelEx", [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                                ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)])


def available() -> bool:
    return _launch_kernel_ex() is not None


def pack_args(args: Sequence[object]) -> tuple[ctypes.Array, list[object]]:
    """``kernelParams`` for ``cuLaunchKernelEx``: an array of pointers to each argument's value.
    Ints are device pointers; NumPy scalars keep their C type. Returns the array and the value
    objects, which must stay alive until the launch call returns."""
    values: list[object] = []
    for pos, arg in enumerate(args):
        if isinstance(arg, int):
            values.append(ctypes.c_void_p(arg))
            continue
        ctype = _C_TYPES.get(type(arg))
        if ctype is None:
            raise SnapmlaError(f"kernel argument {pos}: {type(arg).__name__} has no C type for cuLaunchKernelEx")
        values.append(ctype(arg.item()))  # type: ignore[attr-defined]
    pointers = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])  # type: ignore[arg-type]
    return pointers, values


def programmatic_attribute() -> LaunchAttribute:
    """The programmatic-stream-serialization attribute, allowed."""
    attr = LaunchAttribute()
    attr.id = LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.c_int.from_buffer(attr.value).value = 1  # programmaticStreamSerializationAllowed
    return attr


def launch_config(grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int, stream_ptr: int,
                  attr: LaunchAttribute | None) -> LaunchConfig:
    """A ``CUlaunchConfig`` with one attribute (which the caller keeps alive with it) or, with
    ``attr`` None, none (a plain launch)."""
    g = (*grid, 1, 1)[:3]
    b = (*block, 1, 1)[:3]
    if attr is None:
        return LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, ctypes.c_void_p(stream_ptr), None, 0)
    return LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, ctypes.c_void_p(stream_ptr),
                        ctypes.pointer(attr), 1)


def check_status(status: int, config: LaunchConfig) -> None:
    """A one-line error naming the launch when ``cuLaunchKernelEx`` did not return success."""
    if status != CUDA_SUCCESS:
        raise SnapmlaError(f"cuLaunchKernelEx failed with CUresult {status} (grid "
                           f"{(config.grid_x, config.grid_y, config.grid_z)}, block "
                           f"{(config.block_x, config.block_y, config.block_z)}, {config.shared_mem} B shared memory)")


def require_launch_kernel_ex() -> Callable[..., int]:
    fn = _launch_kernel_ex()
    if fn is None:
        raise SnapmlaError("cuLaunchKernelEx is not available (driver older than CUDA 12)")
    return fn


def launch_programmatic(function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int,
                        stream_ptr: int, args: Sequence[object]) -> None:
    """Launch with programmatic stream serialization allowed (see the module docstring)."""
    fn = require_launch_kernel_ex()
    attr = programmatic_attribute()  # (kept alive with the configuration that points into it)
    config = launch_config(grid, block, shared_mem, stream_ptr, attr)
    pointers, _values = pack_args(args)
    check_status(fn(ctypes.byref(config), ctypes.c_void_p(function_ptr), pointers, None), config)


class PreparedLaunch:
    """One kernel's ``cuLaunchKernelEx`` launch with one attribute or none, its configuration and
    argument buffers built once (for an op's hot path: :func:`launch_programmatic` builds a dozen
    ctypes objects a call). A call sets the stream and the argument values, whose C types are
    ``arg_types`` or, without them, those of the first call's arguments (:func:`pack_args`); a
    lock keeps two threads from filling the shared buffers at once."""

    __slots__ = ("_attr", "_config", "_function", "_lock", "_pointers", "_values")

    def __init__(self, function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int,
                 attr: LaunchAttribute | None, arg_types: Sequence[type] | None = None) -> None:
        self._attr = attr
        self._config = launch_config(grid, block, shared_mem, 0, attr)
        self._function = ctypes.c_void_p(function_ptr)
        self._values: list[object] | None = None
        self._pointers: ctypes.Array | None = None
        if arg_types is not None:
            self._values = [ctype() for ctype in arg_types]
            self._pointers = (ctypes.c_void_p * max(len(self._values), 1))(
                *[ctypes.addressof(v) for v in self._values])  # type: ignore[arg-type]
        self._lock = threading.Lock()

    def __call__(self, stream_ptr: int, args: Sequence[object], grid: tuple[int, ...] | None = None) -> None:
        """Launch on ``stream_ptr`` with ``args`` (ints for pointers, NumPy scalars or ints for
        values), one per argument type; ``grid``: this launch's, where it differs from the
        prepared one (a kernel sized by its call)."""
        fn = require_launch_kernel_ex()
        with self._lock:
            if self._values is None:
                self._pointers, self._values = pack_args(args)
            else:
                for value, arg in zip(self._values, args, strict=True):
                    value.value = arg  # type: ignore[attr-defined]
            if grid is not None:
                config = self._config
                config.grid_x, config.grid_y, config.grid_z = (*grid, 1, 1)[:3]
            self._config.stream = stream_ptr
            check_status(fn(ctypes.byref(self._config), self._function, self._pointers, None), self._config)


class ProgrammaticLaunch(PreparedLaunch):
    """A :class:`PreparedLaunch` with programmatic stream serialization allowed."""

    __slots__ = ()

    def __init__(self, function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int,
                 arg_types: Sequence[type]) -> None:
        super().__init__(function_ptr, grid, block, shared_mem, programmatic_attribute(), arg_types)
