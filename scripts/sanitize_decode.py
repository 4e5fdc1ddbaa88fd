"""A small decode sweep for compute-sanitizer (memcheck / racecheck / synccheck):
``compute-sanitizer --tool racecheck python3 scripts/sanitize_decode.py [default,v3-rows,...]``.
Every kernel configuration the heuristic uses (16, 32, 64+ rows), both formats, odd lengths,
empty requests; the FP8 kernels are named as in ``snapmla verify --fp8-kernel``."""

from __future__ import annotations

import sys

import torch

from snapmla_cli.analysis.verify import fp8_kernel_implementation, run_bf16_kernel
from snapmla_cli.numerics.problem import random_problem

CASES = [([0, 1, 65, 300], 1, 16, False), ([70, 129], 2, 16, True), ([200, 0, 64], 1, 64, True),
         ([130], 3, 20, True), ([333, 64], 2, 64, True)]


def main() -> None:
    device = torch.device("cuda")
    fp8_impls = [fp8_kernel_implementation(spec) for spec in (sys.argv[1] if len(sys.argv) > 1 else "default").split(",")]
    for seqlens, s_q, h_q, causal in CASES:
        prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=1).to(device)
        finite = {impl.name: bool(impl.run(prob)[0].isfinite().all()) for impl in fp8_impls}
        finite["bf16"] = bool(run_bf16_kernel(prob)[0].isfinite().all())
        torch.cuda.synchronize()
        print(f"{seqlens} s_q={s_q} h_q={h_q}: finite {finite}", flush=True)


if __name__ == "__main__":
    main()
