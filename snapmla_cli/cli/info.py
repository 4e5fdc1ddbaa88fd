"""``snapmla info``: the GPUs, the CUDA toolchain and the tuning database this machine would use,
as a table and lines, or (``--json``) as one document that a deployment check or a bug report
can read without parsing the text."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..cache.atomic import check_outputs
from ..report_header import report_header
from ..runtime.gpu_arch import common_archs, describe_archs, device_arch
from ..runtime.gpu_facts import GpuListing, ToolchainFacts, list_gpus, toolchain_facts
from ..runtime.nvrtc import kernel_sources_stamp
from ..tables import figure_table
from ..tuning import describe_survey, survey_database
from .common import (
    file_path,
    output_option,
    report_console,
    version_line,
    write_json_file,
    write_json_stdout,
    wrote_lines,
)

if TYPE_CHECKING:  # (the lookup module is imported when info runs, not when the CLI starts)
    from ..tuning.lookup import DatabaseSurvey

INFO_JSON_FORMAT = "snapmla-info"


def info_as_dict(listing: GpuListing, archs: tuple[str, ...], runs_kernels: list[bool], tc: ToolchainFacts,
                 kernels: str | None, database: DatabaseSurvey) -> dict[str, Any]:
    """Everything ``snapmla info`` prints, as plain data: the GPUs with NVML's facts and whether
    snapmla's kernels run on each, the toolchain, the kernel sources' hash and the database
    (folders, skipped files, every entry that applies per GPU with why it is stale)."""
    return {
        **report_header(INFO_JSON_FORMAT, (kernels, "")),  # the stamp info read and printed
        "kernel_archs": sorted(archs),
        "gpus": [{**dataclasses.asdict(g), "compute_capability": list(g.compute_capability),
                  "runs_kernels": runs} for g, runs in zip(listing.gpus, runs_kernels)],
        "no_gpu_reason": listing.reason or None,
        "toolchain": dataclasses.asdict(tc),
        "tuning": database.as_dict(),
    }


def info_command(
    json_path: Annotated[Path | None, output_option("--json", help="Write the facts as JSON (format snapmla-info, version 1).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the --json file.")] = False,
) -> None:
    """Show the GPUs, the CUDA toolchain (NVRTC, CuPy, torch) and the tuning database.

    GPU facts come from NVML (SM count from torch). Without a GPU or driver it says so and
    still exits 0."""
    check_outputs([("--json", file_path(json_path))], force)
    stamp = kernel_sources_stamp()  # read once: the version line, the stale marks, the JSON
    listing = list_gpus()
    archs = common_archs()
    runs_kernels = [device_arch(g.compute_capability) in archs for g in listing.gpus]
    tc = toolchain_facts()
    database = survey_database(listing.gpus, stamp[0])  # one survey for the lines and the JSON
    payload = functools.partial(info_as_dict, listing, archs, runs_kernels, tc, stamp[0], database)
    write_json_file(json_path, payload, force)  # before the report (see write_json_file)
    out = report_console(json_path)
    out.print(version_line(stamp))
    if listing.gpus:
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
    out.print(f"torch: {tc.torch_version} (CUDA build: {tc.torch_cuda or 'none, CPU-only'}; "
              f"CUDA usable: {'yes' if tc.cuda_available else 'no'})")
    out.print(f"CuPy: {tc.cupy_version or 'not usable (' + str(tc.cupy_error) + ')'}")
    out.print(f"NVRTC: {tc.nvrtc_version or 'not usable (' + str(tc.nvrtc_error) + ')'}")
    for line in describe_survey(database):
        out.print(line)
    write_json_stdout(json_path, payload)
    for line in wrote_lines(json_path):
        out.print(line)
