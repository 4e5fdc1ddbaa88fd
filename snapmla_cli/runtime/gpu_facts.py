"""Facts about the machine's GPUs (NVML, plus torch for the SM count) and its CUDA toolchain.

``GpuFacts.key`` is what the tuning database (SPEC section 9) is keyed on: the GPU name as NVML
reports it, the SM count, the compute capability and the CUDA driver major version. Nothing here
raises on a machine without a GPU or driver: the lists are empty and ``reason`` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    uuid: str
    sm_count: int | None  # from torch (NVML does not report it); None when CUDA is not usable
    compute_capability: tuple[int, int]
    memory_bytes: int
    max_sm_clock_mhz: int | None
    max_mem_clock_mhz: int | None
    driver_version: str
    cuda_driver_version: str  # e.g. "13.0"

    @property
    def cuda_driver_major(self) -> int:
        return int(self.cuda_driver_version.split(".")[0])

    @property
    def key(self) -> tuple[str, int | None, tuple[int, int], int]:
        """The tuning-database key (SPEC section 9)."""
        return (self.name, self.sm_count, self.compute_capability, self.cuda_driver_major)


@dataclass(frozen=True)
class GpuListing:
    gpus: list[GpuFacts]
    reason: str = ""  # why the list is empty (no driver, NVML missing, ...)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_uuid(props: object) -> str | None:
    """NVML's UUID (``GPU-...``) of the GPU whose torch device properties are ``props``, or None
    when this torch does not report one: how torch's devices (those CUDA_VISIBLE_DEVICES lets it
    see, renumbered) are matched with NVML's (every GPU of the host)."""
    uuid = getattr(props, "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None


def _sm_counts() -> dict[str, int]:
    """SM count per GPU UUID (``GPU-...``), from torch when it can use CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        counts = {}
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            counts[nvml_uuid(props) or f"index-{i}"] = props.multi_processor_count
        return counts
    except Exception:  # noqa: BLE001 - a broken CUDA setup only means "n/a" here
        return {}


Answer = TypeVar("Answer")  # what one NVML query returns


def _optional(fn: Callable[..., Answer], *args: object) -> Answer | None:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - NVML raises NVMLError_NotSupported etc. per query
        return None


def list_gpus() -> GpuListing:
    """Every GPU NVML sees; an empty listing with a reason when there is none or no driver."""
    try:
        import pynvml
    except ImportError:
        return GpuListing([], "nvidia-ml-py (pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return GpuListing([], f"no NVIDIA driver ({_text(exc).strip() or type(exc).__name__})")
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        cuda_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        sm_counts = _sm_counts()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            sm = sm_counts.get(uuid, sm_counts.get(f"index-{i}"))
            gpus.append(GpuFacts(
                index=i,
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                uuid=uuid,
                sm_count=sm,
                compute_capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                max_sm_clock_mhz=_optional(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM),
                max_mem_clock_mhz=_optional(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM),
                driver_version=driver,
                cuda_driver_version=cuda_version,
            ))
        return GpuListing(gpus, "" if gpus else "NVML reports no GPU")
    except Exception as exc:  # noqa: BLE001 - a lost GPU, one the container may not query, ...
        return GpuListing([], f"NVML failed ({type(exc).__name__}: {_text(exc).strip() or 'no message'})")
    finally:
        _optional(pynvml.nvmlShutdown)


@dataclass(frozen=True)
class ToolchainFacts:
    torch_version: str
    torch_cuda: str | None  # the CUDA version torch was built with, None for a CPU build
    cuda_available: bool
    cupy_version: str | None
    cupy_error: str | None
    nvrtc_version: str | None
    nvrtc_error: str | None


def toolchain_facts() -> ToolchainFacts:
    import torch

    cupy_version = cupy_error = nvrtc_version = nvrtc_error = None
    try:
        import cupy

        cupy_version = cupy.__version__
        try:
            major, minor = cupy.cuda.nvrtc.getVersion()
            nvrtc_version = f"{major}.{minor}"
        except Exception as exc:  # noqa: BLE001 - missing libnvrtc shows up here
            nvrtc_error = _first_line(exc)
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken install
        cupy_error = _first_line(exc)
        nvrtc_error = "needs CuPy"
    return ToolchainFacts(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        cupy_version=cupy_version,
        cupy_error=cupy_error,
        nvrtc_version=nvrtc_version,
        nvrtc_error=nvrtc_error,
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
