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
from collections.abc import Callable
from functools import lru_cache

from ..errors import SnapmlaError
from . import pdl

LAUNCH_ATTR_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID (cuda.h)


def cluster_attribute(dims: tuple[int, int, int]) -> pdl.LaunchAttribute:
    """The cluster-dimension attribute: three unsigned ints (x, y, z) at the value's start."""
    attr = pdl.LaunchAttribute()
    attr.id = LAUNCH_ATTR_CLUSTER_DIMENSION
    (ctypes.c_uint * 3).from_buffer(attr.value)[:] = list(dims)
    return attr


@lru_cache(maxsize=1)
def _occupancy_fn() -> Callable[..., int] | None:
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
    return count.value if status == pdl.CUDA_SUCCESS else 0


class ClusterLaunch(pdl.PreparedLaunch):
    """One kernel's launch in clusters of ``dims`` (the decode call's hot path): a
    :class:`pdl.PreparedLaunch` with the cluster-dimension attribute, its argument types those
    of the first call (a prepared decode plan keeps them fixed)."""

    __slots__ = ("dims",)

    def __init__(self, function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int,
                 dims: tuple[int, int, int]) -> None:
        if any(g % d for g, d in zip((*grid, 1, 1)[:3], dims, strict=True)):
            raise SnapmlaError(f"cluster launch: grid {grid} is not a multiple of the cluster {dims}")
        super().__init__(function_ptr, grid, block, shared_mem, cluster_attribute(dims))
        self.dims = dims
