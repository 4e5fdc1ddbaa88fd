"""Load compiled kernels on the current torch CUDA device and launch them on torch's stream.

Why this shape: the decode step calls these kernels hundreds of times a second and inside CUDA
graphs, so the launch path does no I/O, no host sync, no device allocation and no driver query:
a dict lookup for the kernel, torch's current stream, then CuPy's launch. Arguments are explicit
about their C types because CuPy does not check them: tensors become raw pointers, and integers
or floats must be wrapped with :func:`i32` / :func:`i64` / :func:`f32` (a bare Python ``int``
is rejected rather than silently passed as 64 bits to an ``int`` parameter)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ..errors import NoGpuError, SnapmlaError
from . import pdl
from .gpu_arch import device_arch, require_arch
from .nvrtc import CompiledModule, compile_module

DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in (cuFuncSetAttribute)

Scalar = np.int32 | np.int64 | np.uint32 | np.uint64 | np.float32
_SCALARS = (np.int32, np.int64, np.uint32, np.uint64, np.float32)
Dim = int | tuple[int, ...]


def i32(x: int) -> np.int32:
    """A C ``int`` argument."""
    if not -(2**31) <= int(x) < 2**31:
        raise SnapmlaError(f"kernel argument {x} does not fit a 32-bit int")
    return np.int32(x)


def i64(x: int) -> np.int64:
    """A C ``long long`` / ``int64_t`` argument."""
    return np.int64(x)


def f32(x: float) -> np.float32:
    """A C ``float`` argument."""
    return np.float32(x)


@dataclass(eq=False)
class Kernel:
    """A launchable kernel on one device (keeps its CuPy module alive)."""

    name: str
    source: str
    device_index: int
    function: Any  # cupy.cuda.function.Function
    compiled: CompiledModule
    max_dynamic_smem: int = 0

    def __call__(self, grid: Dim, block: Dim, args: Sequence[object], shared_mem: int = 0) -> None:
        launch(self, grid, block, args, shared_mem)


def require_gpu() -> None:
    """Raise :class:`NoGpuError` (one line) unless torch sees a CUDA GPU and CuPy is importable."""
    if not torch.cuda.is_available():
        raise NoGpuError("no CUDA GPU available (torch.cuda.is_available() is False)")
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise NoGpuError(
            "CuPy is not installed; the CUDA kernels need it (pip install 'snapmla[cuda]')"
        ) from None


_KERNELS: dict[tuple[object, ...], Kernel] = {}
_MODULES: dict[tuple[str, int], Any] = {}
_HANDLES: weakref.WeakSet[KernelHandle] = weakref.WeakSet()


_CLEAR_HOOKS: list[Callable[[], None]] = []


def on_kernels_cleared(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever the loaded kernels are forgotten: an op that caches launch plans
    holding :class:`Kernel` objects drops them too."""
    _CLEAR_HOOKS.append(hook)


def clear_loaded_kernels() -> None:
    """Forget loaded kernels (tests; a changed SNAPMLA_KERNEL_DIR)."""
    _KERNELS.clear()
    _MODULES.clear()
    for handle in list(_HANDLES):
        handle.forget()
    for hook in _CLEAR_HOOKS:
        hook()


def get_kernel(
    source: str,
    kernel_name: str,
    defines: Mapping[str, int | str] | None = None,
    *,
    device: int | torch.device | None = None,
    dynamic_smem: int = 0,
) -> Kernel:
    """The kernel ``kernel_name`` of ``kernels/<source>`` compiled for ``device`` (default: the
    current torch device). Cached in memory after the first call; ``dynamic_smem`` opts the
    kernel into more than 48 KB of dynamic shared memory."""
    if device is None:
        if not torch.cuda.is_available():
            require_gpu()
        index = torch.cuda.current_device()
    else:
        index = torch.device("cuda", device).index if isinstance(device, int) else device.index
        if index is None:
            index = torch.cuda.current_device()
    # Cheap key on the hot path; the defines are validated by compile_module on a miss.
    key = (
        source,
        kernel_name,
        tuple(sorted((k, str(v)) for k, v in defines.items())) if defines else (),
        index,
    )
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _load(source, kernel_name, defines, index)
        _KERNELS[key] = kernel
    if dynamic_smem > kernel.max_dynamic_smem:
        _set_dynamic_smem(kernel, dynamic_smem)
    return kernel


def _load(
    source: str, kernel_name: str, defines: Mapping[str, int | str] | None, index: int
) -> Kernel:
    require_gpu()
    require_arch(source, index)  # before NVRTC: ptxas' log for an unsupported target is no message
    import cupy

    arch = device_arch(torch.cuda.get_device_capability(index))
    names = (kernel_name,) if "<" in kernel_name else ()
    compiled = compile_module(source, defines, arch, name_expressions=names)
    with cupy.cuda.Device(index):
        module = _MODULES.get((compiled.key, index))
        if module is None:
            module = cupy.cuda.function.Module()
            module.load(compiled.cubin)
            _MODULES[(compiled.key, index)] = module
        try:
            function = module.get_function(compiled.symbol(kernel_name))
        except cupy.cuda.driver.CUDADriverError:
            raise SnapmlaError(
                f"{source}: no kernel named {kernel_name!r} in the module for {arch} "
                f"(entries: {', '.join(compiled.entry_names())})"
            ) from None
    return Kernel(
        name=kernel_name, source=source, device_index=index, function=function, compiled=compiled
    )


def _set_dynamic_smem(kernel: Kernel, nbytes: int) -> None:
    if nbytes > DEFAULT_DYNAMIC_SMEM_LIMIT:
        import cupy

        driver = cupy.cuda.driver
        with cupy.cuda.Device(kernel.device_index):
            driver.funcSetAttribute(
                kernel.function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes
            )
    kernel.max_dynamic_smem = nbytes


def _opt_in_smem(kernel: Kernel, shared_mem: int) -> None:
    """Opt ``kernel`` into ``shared_mem`` bytes of dynamic shared memory where it has not been
    yet (a comparison on the hot path, the driver call once)."""
    if shared_mem > max(kernel.max_dynamic_smem, DEFAULT_DYNAMIC_SMEM_LIMIT):
        _set_dynamic_smem(kernel, shared_mem)


# ---- the per-call fast path (ops called every decode step) ----
#
# torch's private getters return plain ints without building Python objects (torch.compile's
# generated code uses the same two); a CPU-only torch build lacks them, hence the fallbacks.
_raw_stream_getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_device_getter = getattr(torch._C, "_cuda_getDevice", None)


def current_raw_stream(index: int) -> int:
    """torch's current ``cudaStream_t`` on device ``index``, as an int."""
    if _raw_stream_getter is not None:
        return _raw_stream_getter(index)
    return torch.cuda.current_stream(index).cuda_stream


def current_device_index() -> int:
    """The current CUDA device of this thread (no lazy-init check: a CUDA tensor exists)."""
    if _device_getter is not None:
        return _device_getter()
    return torch.cuda.current_device()


class KernelHandle:
    """One kernel of one compiled variant, resolved once per device and then launched with no
    lookup beyond a dict ``get``: ops keep one handle per kernel at module level.

    ``launch`` takes *raw* arguments, already in the C types CuPy passes on: Python ints for
    pointers (``tensor.data_ptr()``) and NumPy scalars (:func:`i32` / :func:`i64` / :func:`f32`)
    for values. It runs on torch's current stream of device ``index``, switching the current
    device only when it differs (the CuPy function belongs to that device's context).

    Where the driver has ``cuLaunchKernelEx``, a launch goes through a :class:`pdl.PreparedLaunch`
    kept per device, block and argument types (the grid is set per call): CuPy's launch
    converts and checks every argument on each call, a prepared one only stores the new values
    (0.2-0.8 us a call less, docs/PERF.md fifty-seventh session). The types are part of the key
    so that a value is never stored into a slot of another C type (ctypes would truncate a
    pointer silently)."""

    __slots__ = ("__weakref__", "_functions", "_launches", "defines", "name", "source")

    def __init__(self, source: str, name: str, defines: Mapping[str, int | str] | None = None):
        self.source = source
        self.name = name
        self.defines = dict(defines) if defines else {}
        self._functions: dict[int, Any] = {}
        self._launches: dict[tuple[object, ...], pdl.PreparedLaunch | None] = {}
        _HANDLES.add(self)

    def forget(self) -> None:
        self._functions.clear()
        self._launches.clear()

    def function(self, index: int) -> Any:
        """The CuPy function for device ``index`` (compiled / loaded on first use)."""
        fn = self._functions.get(index)
        if fn is None:
            fn = get_kernel(self.source, self.name, self.defines, device=index).function
            self._functions[index] = fn
        return fn

    def launch(
        self,
        index: int,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[object],
    ) -> None:
        key = (index, block, *map(type, args))
        prepared = self._launches.get(key)
        if prepared is None and key not in self._launches:  # (None: CuPy launches it)
            prepared = self._launches[key] = self._prepare(index, grid, block)
        if current_device_index() == index:
            self._issue(prepared, index, grid, block, args)
        else:
            with torch.cuda.device(index):
                self._issue(prepared, index, grid, block, args)

    def _prepare(self, index: int, grid: tuple[int, int, int], block: tuple[int, int, int]) -> pdl.PreparedLaunch | None:
        """The prepared launch of a new key, or None without ``cuLaunchKernelEx`` (then CuPy)."""
        if not pdl.available():
            return None
        return pdl.PreparedLaunch(self.function(index).ptr, grid, block, 0, None)

    def _issue(self, prepared: pdl.PreparedLaunch | None, index: int, grid: tuple[int, int, int],
               block: tuple[int, int, int], args: Sequence[object]) -> None:
        stream_ptr = current_raw_stream(index)
        if prepared is not None:
            prepared(stream_ptr, args, grid)
            return
        self.function(index)(grid, block, args, 0, _stream_wrapper(stream_ptr))


class _RawStream:
    """torch's ``cudaStream_t`` as CuPy's launch sees it: CuPy's ``Function.__call__`` reads only
    ``stream.ptr``. Creating a CuPy ``Stream`` object instead would query the driver, which is
    best avoided while a CUDA graph is being captured; this wrapper makes no CUDA call."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


_STREAM_WRAPPERS: dict[int, _RawStream] = {}


def _stream_wrapper(ptr: int) -> _RawStream:
    """A cached :class:`_RawStream` per stream handle (no object built per launch)."""
    wrapper = _STREAM_WRAPPERS.get(ptr)
    if wrapper is None:
        if len(_STREAM_WRAPPERS) >= 1024:  # streams come and go: keep the cache bounded
            _STREAM_WRAPPERS.clear()
        wrapper = _STREAM_WRAPPERS[ptr] = _RawStream(ptr)
    return wrapper


def _dim3(d: Dim) -> tuple[int, ...]:
    return (d,) if isinstance(d, int) else tuple(d)


@lru_cache(maxsize=16)
def _arch_at_least_sm90(arch: str) -> bool:
    digits = "".join(ch for ch in arch if ch.isdecimal())
    return bool(digits) and int(digits) >= 90


def supports_programmatic(kernel: Kernel) -> bool:
    """Whether ``kernel`` was built for sm_90 or later, where its ``griddepcontrol.wait`` is
    compiled in (kernels/common/ptx.cuh): launched programmatically without it, it would read
    its predecessor's output early."""
    return _arch_at_least_sm90(kernel.compiled.arch)


def launch(
    kernel: Kernel, grid: Dim, block: Dim, args: Sequence[object], shared_mem: int = 0,
    programmatic: bool = False,
) -> None:
    """Launch on torch's current stream of the kernel's device; no sync, no allocation.

    ``args``: torch tensors (passed as device pointers), ``None`` (a null pointer) or
    :func:`i32` / :func:`i64` / :func:`f32` values. ``programmatic``: the kernel waits for its
    predecessor with ``griddepcontrol.wait`` and may be launched before that one has drained
    (:mod:`.pdl`; a plain launch where that is unavailable or ``SNAPMLA_PDL=0``).
    """
    kargs: list[object] = []
    for pos, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            kargs.append(arg.data_ptr())
        elif isinstance(arg, _SCALARS):
            kargs.append(arg)
        elif arg is None:
            kargs.append(0)
        else:
            raise SnapmlaError(
                f"{kernel.name}: argument {pos} is a {type(arg).__name__}; pass tensors, None, "
                "or wrap numbers with i32()/i64()/f32() so their C type is explicit"
            )
    launch_raw(kernel, _dim3(grid), _dim3(block), kargs, shared_mem, programmatic)


def prepare_programmatic(kernel: Kernel, grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int,
                         arg_types: Sequence[type]) -> pdl.ProgrammaticLaunch | None:
    """A reusable programmatic launch of ``kernel`` (:class:`pdl.ProgrammaticLaunch`), or None
    where PDL is unavailable or the kernel lacks its wait (then :func:`launch_raw` with
    ``programmatic=True`` launches it normally)."""
    if not (pdl.available() and supports_programmatic(kernel)):
        return None
    return pdl.ProgrammaticLaunch(kernel.function.ptr, grid, block, shared_mem, arg_types)


def prepare_plain(kernel: Kernel, grid: tuple[int, ...], block: tuple[int, ...],
                  shared_mem: int) -> pdl.PreparedLaunch | None:
    """A reusable plain launch of ``kernel`` through ``cuLaunchKernelEx`` (:class:`pdl.
    PreparedLaunch` without attributes, its argument types those of the first call), or None
    where the driver lacks it (then :func:`launch_raw`). Why: CuPy's launch converts and checks
    every argument on each call, a prepared launch only stores the new values, as the decode
    plan's cluster and programmatic launches already did. The kernel's shared-memory opt-in is
    set here, as :func:`launch_raw` would on its first launch."""
    if not pdl.available():
        return None
    _opt_in_smem(kernel, shared_mem)
    return pdl.PreparedLaunch(kernel.function.ptr, grid, block, shared_mem, None)


def launch_prepared(kernel: Kernel, prepared: pdl.ProgrammaticLaunch | None, grid: tuple[int, ...],
                    block: tuple[int, ...], kargs: list[object], shared_mem: int = 0) -> None:
    """A programmatic launch through ``prepared`` (from :func:`prepare_programmatic` with the same
    kernel, grid, block and shared memory) unless ``SNAPMLA_PDL=0`` or there is none."""
    if prepared is not None and pdl.enabled():
        prepared(current_raw_stream(kernel.device_index), kargs)
        return
    launch_raw(kernel, grid, block, kargs, shared_mem, programmatic=True)


def launch_raw(
    kernel: Kernel, grid: tuple[int, ...], block: tuple[int, ...], kargs: list[object], shared_mem: int = 0,
    programmatic: bool = False,
) -> None:
    """:func:`launch` with the arguments already raw (ints for pointers, NumPy scalars) and the
    grid and block as tuples: the hot path of an op that prepared its launch once."""
    _opt_in_smem(kernel, shared_mem)
    stream_ptr = current_raw_stream(kernel.device_index)
    if programmatic and pdl.enabled() and pdl.available() and supports_programmatic(kernel):
        pdl.launch_programmatic(kernel.function.ptr, grid, block, shared_mem, stream_ptr, kargs)
        return
    kernel.function(grid, block, kargs, shared_mem=shared_mem, stream=_stream_wrapper(stream_ptr))
