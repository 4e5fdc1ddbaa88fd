"""Quick probe of the wgmma FP8 decode against the mma.sync kernel and the emulation on one
shape (debugging aid for kernel work; the real checks are tests/gpu/test_decode.py)."""

from __future__ import annotations

import sys

import torch

from snapmla_cli.numerics.emulation import emulate_fp8_decode
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.numerics.problem import random_problem
from snapmla_cli.numerics.quant import quantize_rows
from snapmla_cli.ops.decode import decode_fp8, get_mla_metadata
from snapmla_cli.ops.decode_config import heuristic_config
from snapmla_cli.ops.schedule import split_token_bounds


def main() -> None:
    seqlens = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64").split(",")]
    s_q, h_q = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (1, 16)
    dev = torch.device("cuda")
    prob = random_problem(seqlens, s_q, h_q, causal=False, seed=1)
    cache = prob.fp8_cache().to(dev)
    q = quantize_rows(prob.q.to(dev))
    table, lens = prob.layout.block_table.to(dev), prob.layout.cache_seqlens.to(dev)
    outs = {}
    for ver in (3, 2):
        cfg = heuristic_config(s_q * h_q, True, ver).with_sms(132)
        meta, splits = get_mla_metadata(lens, s_q * h_q, 1, config=cfg)
        out, lse = decode_fp8(q, cache, table, lens, meta, splits, prob.softmax_scale, False, config=cfg)
        torch.cuda.synchronize()
        outs[ver] = (out, lse, meta, splits)
    bounds = split_token_bounds(outs[3][3], outs[3][2], [int(n) for n in lens.tolist()])
    emul, emul_lse = emulate_fp8_decode(q, cache, table, lens, prob.softmax_scale, False, split_bounds=bounds)
    for ver, (out, lse, _, _) in outs.items():
        print(f"v{ver}: vs emul {compare(out, emul)} lse {compare(lse, emul_lse).max_abs:.3e} nan {out.isnan().any().item()}")
    o3, o2 = outs[3][0].float(), outs[2][0].float()
    err = (o3 - o2).abs().amax(dim=-1)  # [b, s_q, h_q]
    print("max err per row (v3 vs v2):", err.flatten()[:32].tolist())
    d = (o3 - o2).abs()[0, 0, 0]
    print("first row: err over dims (32-dim chunks):", [round(x, 4) for x in d.view(16, 32).amax(-1).tolist()])
    print("v3 row0[:8]", o3[0, 0, 0, :8].tolist())
    print("v2 row0[:8]", o2[0, 0, 0, :8].tolist())


if __name__ == "__main__":
    main()
