"""The registered kernels compiled by this machine's NVRTC: the GPU machine's toolkit can be
older than the one CI installs (13.0 against 13.5), and an older ptxas serialized the BF16
kernel's wgmmas (C7514) that the newer one kept in flight. Nothing launches here; the marker
only makes ``pytest -m gpu`` on the GPU machine run it."""

from __future__ import annotations

import pytest

from snapmla_cli.runtime import nvrtc
from snapmla_cli.runtime.registry import iter_variants
from snapmla_cli.tuning.compile import resource_problem

pytestmark = pytest.mark.gpu

WGMMA_VARIANTS = [(source, var) for source, var, arch in iter_variants() if arch == "sm_90a"]


@pytest.mark.parametrize(("source", "var"), WGMMA_VARIANTS,
                         ids=[f"{s}:{'-'.join(f'{k}{v}' for k, v in sorted(var.defines.items()) if k != 'SNAPMLA_EXPECT_SMEM')}"
                              for s, var in WGMMA_VARIANTS])
def test_registered_kernels_are_clean_with_this_machines_nvrtc(source, var) -> None:
    module = nvrtc.compile_module(source, var.defines, "sm_90a")
    assert resource_problem(module) is None, f"NVRTC {nvrtc.nvrtc_version()}: {module.log}"


def test_this_gpu_is_one_the_kernels_are_built_for() -> None:
    """torch's real device queries, read through runtime/gpu_arch (the CPU tests stand them in):
    the Hopper GPU the suite runs on must pass every source's check, else no kernel would load."""
    import torch

    from snapmla_cli.runtime.gpu_arch import kernels_gpu_problem, require_arch
    from snapmla_cli.runtime.registry import KERNEL_SOURCES

    assert torch.cuda.get_device_capability(0) == (9, 0), "the GPU suite is written for Hopper"
    assert kernels_gpu_problem(0) is None
    for source in KERNEL_SOURCES:
        require_arch(source, 0)
