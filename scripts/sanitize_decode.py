"""A small decode sweep for compute-sanitizer (memcheck / racecheck / synccheck):
``compute-sanitizer --tool racecheck python3 scripts/sanitize_decode.py``. Every kernel
configuration the heuristic uses (16, 32, 64+ rows), both formats, odd lengths, empty requests."""

from __future__ import annotations

import torch

from snapmla_cli.numerics.problem import random_problem
from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata
from snapmla_cli.ops.prep import quantize_q

CASES = [([0, 1, 65, 300], 1, 16, False), ([70, 129], 2, 16, True), ([200, 0, 64], 1, 64, True),
         ([130], 3, 20, True)]


def main() -> None:
    device = torch.device("cuda")
    for seqlens, s_q, h_q, causal in CASES:
        prob = random_problem(seqlens, s_q, h_q, causal=causal, seed=1).to("cpu")
        table = prob.layout.block_table.to(device)
        lens = prob.layout.cache_seqlens.to(device)
        q = prob.q.to(device)
        meta, splits = get_mla_metadata(lens, s_q * h_q, 1, fp8=True)
        out8, _ = decode_fp8(quantize_q(q), prob.fp8_cache().to(device), table, lens, meta, splits,
                             prob.softmax_scale, causal)
        meta16, splits16 = get_mla_metadata(lens, s_q * h_q, 1, fp8=False)
        out16, _ = decode_bf16(q, prob.bf16_cache().to(device), table, lens, meta16, splits16,
                               prob.softmax_scale, causal)
        torch.cuda.synchronize()
        print(f"{seqlens} s_q={s_q} h_q={h_q}: finite fp8={bool(out8.isfinite().all())} "
              f"bf16={bool(out16.isfinite().all())}", flush=True)


if __name__ == "__main__":
    main()
