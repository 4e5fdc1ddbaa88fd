"""``snapmla info``: the GPUs, the CUDA toolchain and the tuning database this machine would use."""

from __future__ import annotations

from ..runtime.gpu_arch import common_archs, describe_archs, device_arch
from ..runtime.gpu_facts import list_gpus, toolchain_facts
from ..tables import figure_table
from ..tuning import describe_database
from .common import console


def info_command() -> None:
    """Show the GPUs, the CUDA toolchain (NVRTC, CuPy, torch) and the tuning database.

    GPU facts come from NVML (SM count from torch). Without a GPU or driver it says so and
    still exits 0."""
    out = console()
    listing = list_gpus()
    if listing.gpus:
        archs = common_archs()
        runs_kernels = [device_arch(g.compute_capability) in archs for g in listing.gpus]
        table = figure_table("GPUs", ("#", "name", "SMs", "cc", "memory GiB", "max SM MHz", "max mem MHz", "driver",
                                      "CUDA driver", "kernels"))
        for g, runs in zip(listing.gpus, runs_kernels):
            table.add_row(str(g.index), g.name, "n/a" if g.sm_count is None else str(g.sm_count),
                          f"{g.compute_capability[0]}.{g.compute_capability[1]}",
                          f"{g.memory_bytes / 2**30:.1f}", str(g.max_sm_clock_mhz or "n/a"),
                          str(g.max_mem_clock_mhz or "n/a"), g.driver_version, g.cuda_driver_version,
                          "yes" if runs else "no")
        out.print(table)
        if not all(runs_kernels):
            out.print(f"snapmla's kernels are built for compute capability {describe_archs(archs)}; "
                      "on the other GPUs only the reference and the emulation run")
    else:
        out.print(f"GPU: none ({listing.reason}); decode kernels cannot run here, the CPU reference and emulation can")
    tc = toolchain_facts()
    out.print(f"torch: {tc.torch_version} (CUDA build: {tc.torch_cuda or 'none, CPU-only'}; "
              f"CUDA usable: {'yes' if tc.cuda_available else 'no'})")
    out.print(f"CuPy: {tc.cupy_version or 'not usable (' + str(tc.cupy_error) + ')'}")
    out.print(f"NVRTC: {tc.nvrtc_version or 'not usable (' + str(tc.nvrtc_error) + ')'}")
    for line in describe_database(listing.gpus):
        out.print(line)
