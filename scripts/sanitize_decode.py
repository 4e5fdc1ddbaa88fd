"""A small decode sweep for compute-sanitizer (memcheck / racecheck / synccheck):
``compute-sanitizer --tool racecheck python3 scripts/sanitize_decode.py [default,v3-rows,... [SEED [NAME=V,...]]]``
(the last: kernel switches laid over the FP8 builds, e.g. ``TAIL_ZERO=0``, as scripts/ab_defines.py).
Every kernel configuration the heuristic uses (16, 32, 64+ rows), both formats, odd lengths,
empty requests; the FP8 kernels are named as in ``snapmla verify --fp8-kernel``.

Each output is also checked against a float64 decode of the same (dequantized) inputs, so that
a run in which the sanitizer reports a hazard says whether the kernel actually read a value too
early (a stale L or P would be far off) or whether the report is about the tool's ordering model
(values right). Give each run its own SEED: shared memory keeps what the previous process's
kernel left there, and with the same data a value read too early could be the right one by
chance. Exit status 1 when a value is off."""

from __future__ import annotations

import sys

import torch
from ab_defines import parse_defines  # this folder is sys.path[0]

from snapmla_cli.analysis.verify import Implementation, fp8_kernel_implementation, run_bf16_kernel
from snapmla_cli.bench.decode_case import extra_defines
from snapmla_cli.cache.layout import dequantize_cache
from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.numerics.problem import random_problem
from snapmla_cli.numerics.quant import quantize_rows

CASES = [([0, 1, 65, 300], 1, 16, False), ([70, 129], 2, 16, True), ([200, 0, 64], 1, 64, True),
         ([130], 3, 20, True), ([333, 64], 2, 64, True),
         # equal requests: their splits run as thread-block clusters (ops/cluster_fold.py), 4 and 2
         ([1000, 1000], 1, 64, True), ([600, 0, 600], 2, 16, True)]
# far looser than the kernels' gates (FP8 P rounding gives ~3e-3): only a value read before it
# was written (an L partial or a P tile of another page) lands above these
FP8_VALUE_GATE, BF16_VALUE_GATE = 3e-2, 1e-2


def main() -> None:
    fp8_impls = [fp8_kernel_implementation(spec) for spec in (sys.argv[1] if len(sys.argv) > 1 else "default").split(",")]
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with extra_defines(parse_defines(sys.argv[3] if len(sys.argv) > 3 else "")):
        all_ok = run_cases(fp8_impls, seed)
    sys.exit(0 if all_ok else 1)


def run_cases(fp8_impls: list[Implementation], seed: int) -> bool:
    """Every case once through each FP8 kernel and the BF16 one; whether all values were right."""
    device = torch.device("cuda")
    all_ok = True
    for seqlens, s_q, h_q, causal in CASES:
        prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=seed).to(device)
        table, lens = prob.layout.block_table, prob.layout.cache_seqlens
        floor, _ = decode_reference(quantize_rows(prob.q).dequantize(), dequantize_cache(prob.fp8_cache()), table,
                                    lens, prob.softmax_scale, causal)
        exact, _ = decode_reference(prob.q, prob.bf16_cache().squeeze(2), table, lens, prob.softmax_scale, causal)
        errors = {impl.name: compare(impl.run(prob)[0], floor).rel_l2 for impl in fp8_impls}
        errors["bf16"] = compare(run_bf16_kernel(prob)[0], exact).rel_l2
        torch.cuda.synchronize()
        ok = all(err <= (BF16_VALUE_GATE if name == "bf16" else FP8_VALUE_GATE) for name, err in errors.items())
        all_ok &= ok
        print(f"{seqlens} s_q={s_q} h_q={h_q}: rel_l2 " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
              + ("" if ok else "  VALUES OFF"), flush=True)
    return all_ok


if __name__ == "__main__":
    main()
