"""Compile the tuner's kernel variants before timing, in parallel, into the kernel cache.

Why processes and not threads: ``compile_module`` serialises NVRTC behind one process-wide lock
and CuPy's NVRTC call holds the GIL (measured: two threads take as long as two sequential
compiles), so a thread pool gives no parallelism. Worker processes (spawned: no CUDA state is
inherited) each call ``compile_module``, which stores the cubin in the disk cache; the main
process then calls ``compile_module`` again and gets disk hits in milliseconds. If processes
cannot be used the same jobs run in-process, one after another. No GPU is needed.

This module imports nothing heavy (no torch), so the workers start quickly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (nvrtc imports CuPy: the workers import it when they compile)
    from ..runtime.nvrtc import CompiledModule

Job = tuple[str, tuple[tuple[str, int], ...]]  # (source, sorted defines)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def compile_one(job: Job, arch: str) -> str | None:
    """Compile one variant (cached); None when it compiled, else the first line of the error."""
    from ..runtime.nvrtc import compile_module

    source, defines = job
    try:
        module = compile_module(source, dict(defines), arch)
    except Exception as exc:  # noqa: BLE001 - reported per candidate, never fatal
        return _first_line(exc)
    return resource_problem(module)


def resource_problem(module: CompiledModule) -> str | None:
    """Why a compiled variant must not be shipped: register spills / local memory, or wgmma
    instructions ptxas serialized for lack of registers (C751x). None: clean."""
    for res in module.resources.values():
        if res.spills or res.local_bytes:
            return f"ptxas: spills ({res.summary()})"
    if "wgmma.mma_async instructions are serialized" in module.log:
        return "ptxas: wgmma serialized (C751x)"
    return None


def _worker(args: tuple[Job, str]) -> str | None:
    return compile_one(*args)


def _compile_in_workers(jobs: list[Job], arch: str, workers: int,
                        report: Callable[[int, int], None]) -> dict[Job, str | None] | None:
    """Fill the disk cache from spawned worker processes: job -> error, or None if the
    processes could not run at all."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    errors: dict[Job, str | None] = {}
    try:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            results = pool.map(_worker, [(j, arch) for j in jobs])
            for done, (job, error) in enumerate(zip(jobs, results), 1):
                errors[job] = error
                report(done, len(jobs))
    except Exception:  # noqa: BLE001 - no processes here: the caller compiles in-process
        return None
    return errors


def compile_jobs(jobs: Sequence[Job], arch: str, workers: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> dict[Job, str | None]:
    """Compile every distinct job for ``arch``; returns job -> error (None: compiled)."""
    unique = list(dict.fromkeys(jobs))
    report = progress or (lambda done, total: None)
    if workers is None:
        workers = min(len(unique), os.cpu_count() or 1, 16)
    failed: dict[Job, str | None] = {}
    if workers > 1 and len(unique) > 1:
        outcome = _compile_in_workers(unique, arch, workers, report) or {}
        failed = {j: e for j, e in outcome.items() if e is not None}
    # In-process pass: disk-cache hits after the workers (or the real compiles when processes
    # could not run); it leaves every module in this process's memory cache for the timing.
    # A variant that failed in a worker is not compiled again.
    errors: dict[Job, str | None] = {}
    for done, job in enumerate(unique, 1):
        errors[job] = failed[job] if job in failed else compile_one(job, arch)
        report(done, len(unique))
    return errors
