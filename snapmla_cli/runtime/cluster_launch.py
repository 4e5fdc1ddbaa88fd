"""Thread-block cluster launches: a kernel's grid launched in clusters of CTAs that share
distributed shared memory (sm_90), for the decode kernel's cluster merge (ops/cluster_fold.py).

Why this module: the cluster dimension is a launch attribute (``CU_LAUNCH_ATTRIBUTE_CLUSTER_
DIMENSION``), reachable only through ``cuLaunchKernelEx``, which neither torch nor CuPy exposes;
it is called through ``ctypes`` on ``libcuda`` as :mod:`.pdl` does for programmatic launches
(whose ctypes structures it shares). A cluster's CTAs are placed on one GPC together, so fewer
clusters than SMs / n may fit at once: :func:`max_active_clusters` asks the driver
(``cuOccupancyMaxActiveClusters``) before a plan relies on one wave.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from functools import lru_cache

from ..errors import SnapmlaError
from . import pdl

LAUNCH_ATTR_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID (cuda.h)
_CUDA_SUCCESS = 0


def cluster_attribute(dims: tuple[int, int, int]) -> pdl.LaunchAttribute:
    """The cluster-dimension attribute: three unsigned ints (x, y, z) at the value's start."""
    attr = pdl.LaunchAttribute()
    attr.id = LAUNCH_ATTR_CLUSTER_DIMENSION
    (ctypes.c_uint * 3).from_buffer(attr.value)[:] = list(dims)
    return attr


@lru_cache(maxsize=1)
def _occupancy_fn():
    return pdl.driver_function("cuOccupancyMaxActiveClusters",
                               [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(pdl.LaunchConfig)])


def max_active_clusters(function_ptr: int, dims: tuple[int, int, int], block: tuple[int, ...],
                        shared_mem: int) -> int:
    """How many clusters of ``dims`` CTAs of this kernel (``block`` threads, ``shared_mem`` bytes
    of dynamic shared memory, already opted in) the current device holds at once; 0 when the
    driver cannot say (then no cluster launch is planned)."""
    fn = _occupancy_fn()
    if fn is None or not pdl.available():
        return 0
    attr = cluster_attribute(dims)
    config = pdl.launch_config(dims, block, shared_mem, 0, attr)
    count = ctypes.c_int(0)
    status = fn(ctypes.byref(count), ctypes.c_void_p(function_ptr), ctypes.byref(config))
    return count.value if status == _CUDA_SUCCESS else 0


class ClusterLaunch:
    """One kernel's launch in clusters of ``dims``, its configuration built once (the decode
    call's hot path). The argument buffers take their C types from the first call's arguments
    (ints: pointers; NumPy scalars: their own type), which a prepared decode plan keeps fixed; a
    lock keeps two threads from filling them at once."""

    __slots__ = ("_attr", "_config", "_function", "_lock", "_pointers", "_values", "dims")

    def __init__(self, function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int,
                 dims: tuple[int, int, int]) -> None:
        if any(g % d for g, d in zip((*grid, 1, 1)[:3], dims, strict=True)):
            raise SnapmlaError(f"cluster launch: grid {grid} is not a multiple of the cluster {dims}")
        self.dims = dims
        self._attr = cluster_attribute(dims)
        self._config = pdl.launch_config(grid, block, shared_mem, 0, self._attr)
        self._function = ctypes.c_void_p(function_ptr)
        self._values: list[object] | None = None
        self._pointers: ctypes.Array | None = None
        self._lock = threading.Lock()

    def __call__(self, stream_ptr: int, args: Sequence[object]) -> None:
        """Launch on ``stream_ptr`` with ``args`` (ints for pointers, NumPy scalars)."""
        fn = pdl.require_launch_kernel_ex()
        with self._lock:
            if self._values is None:
                self._pointers, self._values = pdl.pack_args(args)
            else:
                for value, arg in zip(self._values, args, strict=True):
                    value.value = arg  # type: ignore[attr-defined]
            self._config.stream = stream_ptr
            pdl.check_status(fn(ctypes.byref(self._config), self._function, self._pointers, None), self._config)
