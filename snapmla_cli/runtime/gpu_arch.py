"""Which GPUs snapmla's kernels run on, checked before anything is compiled for one.

Why: NVRTC compiles a kernel for whatever GPU it is handed, and a Hopper-only instruction
(``wgmma``, ``setmaxnreg``, ``cp.async.bulk``) then fails inside ptxas with a log of hundreds of
lines; a kernel that happens to compile for an architecture it was never run on is worse, since
nothing checked its results there. So a kernel loads only on the architectures its source is
registered for (:mod:`.registry`: what CI compiles and the GPU tests run), and anything else is
one line naming the GPU, its compute capability and what the kernel needs.
"""

from __future__ import annotations

import torch

from ..errors import NoGpuError
from .nvrtc import DEFAULT_ARCH

# What a user would recognise behind each target the registry builds for.
ARCH_DESCRIPTIONS: dict[str, str] = {
    "sm_90a": "9.0 (Hopper: H100, H200, H20, H800, GH200)",
    "sm_89": "8.9 (Ada: L4, L40S, RTX 4090)",
}


class UnsupportedGpuError(NoGpuError):
    """There is a CUDA GPU, but not one the kernel is built and checked for."""


def device_arch(capability: tuple[int, int]) -> str:
    """NVRTC target for a compute capability: Hopper needs the ``a`` variant for wgmma/FP8."""
    major, minor = capability
    if (major, minor) == (9, 0):
        return "sm_90a"
    return f"sm_{major}{minor}"


def supported_archs(source: str) -> tuple[str, ...]:
    """The targets ``source`` (a file under ``kernels/``) is registered for, in registry order;
    a source outside the registry (the diagnostics) is built for the default target only."""
    from .registry import KERNEL_SOURCES  # the registry imports the ops, which import this

    archs = dict.fromkeys(arch for var in KERNEL_SOURCES.get(source, ()) for arch in var.archs)
    return tuple(archs) or (DEFAULT_ARCH,)


def common_archs() -> tuple[str, ...]:
    """The targets every registered source is built for: where all of snapmla's kernels run
    (what a decode step needs: prep, decode and combine)."""
    from .registry import KERNEL_SOURCES

    per_source = [supported_archs(source) for source in KERNEL_SOURCES]
    return tuple(arch for arch in per_source[0] if all(arch in archs for archs in per_source))


def describe_archs(archs: tuple[str, ...]) -> str:
    """``9.0 (Hopper: ...) or 8.9 (...)``: targets as compute capabilities a user recognises."""
    return " or ".join(ARCH_DESCRIPTIONS.get(arch, arch) for arch in archs)


def unsupported_reason(what: str, archs: tuple[str, ...], index: int, name: str,
                       capability: tuple[int, int]) -> str | None:
    """Why GPU ``index`` (``name``, ``capability``) cannot run ``what``, built for ``archs``;
    None when it can."""
    if device_arch(capability) in archs:
        return None
    major, minor = capability
    return (f"cuda:{index} ({name}, compute capability {major}.{minor}) cannot run {what}: "
            f"built for compute capability {describe_archs(archs)} only")


def _gpu(index: int) -> tuple[str, tuple[int, int]]:
    major, minor = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), (int(major), int(minor))


def refuse_if(reason: str | None) -> None:
    """Raise :class:`UnsupportedGpuError` with ``reason`` (one of the ``..._problem`` answers)
    unless it is None."""
    if reason is not None:
        raise UnsupportedGpuError(reason)


def require_arch(source: str, index: int) -> None:
    """Raise :class:`UnsupportedGpuError` unless GPU ``index`` is one ``source`` is built for."""
    refuse_if(unsupported_reason(source, supported_archs(source), index, *_gpu(index)))


def kernels_gpu_problem(index: int) -> str | None:
    """Why GPU ``index`` cannot run snapmla's kernels (all of them, as a decode step does), or
    None: what ``verify``, ``bench`` and ``tune`` ask before they plan any GPU work."""
    return unsupported_reason("snapmla's kernels", common_archs(), index, *_gpu(index))


def require_kernels_gpu(index: int) -> None:
    """Raise :class:`UnsupportedGpuError` when :func:`kernels_gpu_problem` finds one."""
    refuse_if(kernels_gpu_problem(index))
