"""Every kernel source under ``kernels/`` and the define-sets it must compile with.

Why a registry: CI compiles each variant listed here for its archs (no GPU needed) and fails on
any spill or stack frame, ``snapmla info`` reports their resources, and the benchmark measures
cold and warm compile times over the same list. Adding a kernel is one line in
``KERNEL_SOURCES``, e.g.::

    "decode_fp8.cu": (variant("snapmla_decode_fp8", HQ_TILE=64, STAGES=2),),
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from .nvrtc import DEFAULT_ARCH, CompiledModule, compile_module


@dataclass(frozen=True)
class Variant:
    """Kernels one compile of a source must produce, with the defines and archs to use."""

    kernels: tuple[str, ...]
    defines: Mapping[str, int | str] = field(default_factory=dict)
    archs: tuple[str, ...] = (DEFAULT_ARCH,)


def variant(*kernels: str, archs: tuple[str, ...] = (DEFAULT_ARCH,), **defines: int | str) -> Variant:
    return Variant(kernels=tuple(kernels), defines=dict(defines), archs=tuple(archs))


# Prep kernels: nothing Hopper-only, so they are also checked for Ada (sm_89).
PREP_SOURCE = "prep.cu"
PREP_KERNELS = (
    "snapmla_quantize_q",
    "snapmla_append_kv",
    "snapmla_fetch_dequant_paged",
    "snapmla_fetch_dequant_slots",
    "snapmla_fetch_dequant_soa",
)
PREP_ARCHS = ("sm_90a", "sm_89")
# Launch geometry the ops use; the kernel reads the same values as -D defines.
PREP_DEFINES: dict[str, int] = {"PREP_WARPS_PER_CTA": 8, "PREP_ROWS_PER_WARP": 2}

KERNEL_SOURCES: dict[str, tuple[Variant, ...]] = {
    PREP_SOURCE: (
        variant(*PREP_KERNELS, archs=PREP_ARCHS, **PREP_DEFINES),
        variant(*PREP_KERNELS, archs=PREP_ARCHS, PREP_WARPS_PER_CTA=4, PREP_ROWS_PER_WARP=1),
    ),
}


def iter_variants() -> Iterator[tuple[str, Variant, str]]:
    """``(source, variant, arch)`` for every registered compile."""
    for source, variants in KERNEL_SOURCES.items():
        for var in variants:
            for arch in var.archs:
                yield source, var, arch


def compile_all() -> list[CompiledModule]:
    """Compile (or fetch from the caches) every registered variant."""
    return [compile_module(source, var.defines, arch) for source, var, arch in iter_variants()]
