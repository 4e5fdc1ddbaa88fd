"""Fill the NVRTC disk cache for every registered kernel variant in parallel (one process per
core), so that the GPU tests and benchmarks that follow start without compiling. Extra FP8
decode variants can be named as arguments in the format of ``config_from_spec``
(``bench_decode.py --sweep`` takes the same)."""

from __future__ import annotations

import sys
import time

from snapmla_cli.ops.decode_config import config_from_spec, fp8_defines, fp8_kernel
from snapmla_cli.runtime.registry import KERNEL_SOURCES
from snapmla_cli.tuning.compile import compile_jobs

ARCH = "sm_90a"


def main() -> None:
    jobs = [(source, tuple(sorted((k, int(v)) for k, v in var.defines.items())))
            for source, variants in KERNEL_SOURCES.items() for var in variants if ARCH in var.archs]
    for spec in sys.argv[1:]:
        cfg = config_from_spec(spec)
        jobs.append((fp8_kernel(cfg)[0], tuple(sorted(fp8_defines(cfg).items()))))
    start = time.perf_counter()
    errors = compile_jobs(jobs, ARCH)
    bad = {job: err for job, err in errors.items() if err}
    print(f"precompiled {len(errors)} variants in {time.perf_counter() - start:.1f}s; {len(bad)} failed")
    for job, err in bad.items():
        print(f"  {job}: {err}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
