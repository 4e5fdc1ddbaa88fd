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
from typing import TYPE_CHECKING

from .nvrtc import DEFAULT_ARCH, CompiledModule, compile_module, kernel_dir

if TYPE_CHECKING:  # imported at run time inside _decode_variants (ops imports the runtime)
    from ..ops.decode_config import DecodeConfig


@dataclass(frozen=True)
class Variant:
    """Kernels one compile of a source must produce, with the defines and archs to use."""

    kernels: tuple[str, ...]
    defines: Mapping[str, int | str] = field(default_factory=dict)
    archs: tuple[str, ...] = (DEFAULT_ARCH,)


def variant(
    *kernels: str, archs: tuple[str, ...] = (DEFAULT_ARCH,), **defines: int | str
) -> Variant:
    return Variant(kernels=tuple(kernels), defines=dict(defines), archs=tuple(archs))


def built(kernel: str, defines: Mapping[str, int | str]) -> Variant:
    """One kernel of a source compiled with a configuration's defines, for the default arch."""
    return Variant(kernels=(kernel,), defines=dict(defines))


# Prep kernels: nothing Hopper-only, so they are also checked for Ada (sm_89).
PREP_SOURCE = "prep.cu"
PREP_KERNELS = (
    "snapmla_quantize_q",
    "snapmla_append_kv",
    "snapmla_append_kv_i64",
    "snapmla_fetch_dequant_paged",
    "snapmla_fetch_dequant_slots",
    "snapmla_fetch_dequant_slots_i64",
    "snapmla_fetch_dequant_soa",
    "snapmla_fetch_dequant_soa_i64",
)
PREP_ARCHS = ("sm_90a", "sm_89")
# Launch geometry the ops use; the kernel reads the same values as -D defines.
# PREP_CONTENT_MAP: 0 = coalesced content loads + two 8-byte stores per lane, 1 = strided loads +
# one 16-byte store per lane (kernels/common/quant.cuh; scripts/bench_prep.py --sweep times both).
PREP_DEFINES: dict[str, int] = {
    "PREP_WARPS_PER_CTA": 8,
    "PREP_ROWS_PER_WARP": 2,
    "PREP_CONTENT_MAP": 0,
}

def _decode_variants() -> dict[str, tuple[Variant, ...]]:
    """The decode kernels as the built-in heuristics compile them for 16, 32 and 64+ rows: the
    wgmma FP8 kernel, the mma.sync FP8 kernel and the two BF16 baselines (Hopper only; the
    tuner adds its own variants)."""
    from ..ops.cluster_fold import cluster_defines
    from ..ops.decode_config import (
        BF16_MMA_SYNC,
        BF16_WGMMA,
        FP8_MMA_SYNC,
        FP8_WGMMA,
        WG_MODES,
        balanced,
        bf16_defines,
        bf16_kernel,
        column_capable,
        fp8_config_valid,
        fp8_defines,
        fp8_kernel,
        heuristic_config,
        variant_config,
    )

    rows = (16, 32, 64)
    variants: dict[str, tuple[Variant, ...]] = {}
    for version in (FP8_WGMMA, FP8_MMA_SYNC):
        configs = [heuristic_config(r, True, version) for r in rows]
        source, name = fp8_kernel(configs[0])
        variants[source] = tuple(built(name, fp8_defines(c)) for c in configs)
    # the cluster-merge builds of the defaults (ops/cluster_fold.py: b 64 runs them)
    variants["decode_fp8_wgmma.cu"] += tuple(built("snapmla_decode_fp8_wgmma", cluster_defines(fp8_defines(c)))
                                             for c in (heuristic_config(r, True, FP8_WGMMA) for r in rows))
    wgmma_fp8: list[DecodeConfig] = []  # every FP8 wgmma layout registered below
    # the wgmma kernel's other warpgroup modes: selectable (verify --fp8-kernel v3-rows /
    # v3-pingpong / v3-alt / v3-rows-m), so CI compiles them too, as the verifier builds them
    # (rows = M only where it is valid, at 64 rows)
    for r in rows:
        base = heuristic_config(r, True, FP8_WGMMA)
        modes = (variant_config(r, FP8_WGMMA, wg_mode=m) for m in WG_MODES if m != base.wg_mode)
        others = [c for c in modes if fp8_config_valid(c)]
        wgmma_fp8 += [base, *others]
        variants["decode_fp8_wgmma.cu"] += tuple(built("snapmla_decode_fp8_wgmma", fp8_defines(c)) for c in others)
    # the balanced split policy's column builds of every FP8 wgmma layout above that can run them
    columns = {tuple(sorted(fp8_defines(balanced(c)).items())): balanced(c) for c in wgmma_fp8
               if column_capable(c, True)}
    variants["decode_fp8_wgmma.cu"] += tuple(built("snapmla_decode_fp8_wgmma", fp8_defines(c))
                                             for c in columns.values())
    for version in (BF16_WGMMA, BF16_MMA_SYNC):  # the wgmma kernel has one tile for all rows
        bf16_builds = {tuple(sorted(bf16_defines(c).items())): c for c in (heuristic_config(r, False, version) for r in rows)}
        bf16_builds.update({tuple(sorted(bf16_defines(balanced(c)).items())): balanced(c)
                            for c in list(bf16_builds.values()) if column_capable(c, False)})
        source, name = bf16_kernel(next(iter(bf16_builds.values())))
        variants[source] = tuple(built(name, bf16_defines(c)) for c in bf16_builds.values())
        if version == BF16_WGMMA:  # its cluster-merge build (ops/cluster_fold.py)
            variants[source] += (built(name, cluster_defines(bf16_defines(heuristic_config(64, False, version)))),)
    variants["combine.cu"] = tuple(variant("snapmla_combine", COMBINE_ROWS=r) for r in (1, 4))
    return variants


KERNEL_SOURCES: dict[str, tuple[Variant, ...]] = {
    PREP_SOURCE: (
        variant(*PREP_KERNELS, archs=PREP_ARCHS, **PREP_DEFINES),
        variant(*PREP_KERNELS, archs=PREP_ARCHS, PREP_WARPS_PER_CTA=4, PREP_ROWS_PER_WARP=1),
        variant(*PREP_KERNELS, archs=PREP_ARCHS, **{**PREP_DEFINES, "PREP_CONTENT_MAP": 1}),
    ),
    **_decode_variants(),
}


def iter_variants() -> Iterator[tuple[str, Variant, str]]:
    """``(source, variant, arch)`` for every registered compile."""
    for source, variants in KERNEL_SOURCES.items():
        for var in variants:
            for arch in var.archs:
                yield source, var, arch


def unregistered_sources() -> list[str]:
    """``.cu`` files under ``kernels/`` that no entry of ``KERNEL_SOURCES`` compiles (so CI
    would not check them)."""
    folder = kernel_dir()
    found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.cu"))
    return [name for name in found if name not in KERNEL_SOURCES]


def compile_all() -> list[CompiledModule]:
    """Compile (or fetch from the caches) every registered variant."""
    return [compile_module(source, var.defines, arch) for source, var, arch in iter_variants()]
