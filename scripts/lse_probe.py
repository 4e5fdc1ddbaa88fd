"""Where an FP8 kernel's lse leaves the emulation's (verify's synthetic problem): per row, per
request, against the row's lse, with the kernels' split plan and with one split a request.

Usage (GPU): python3 scripts/lse_probe.py [--heads 64] [--mtp 1] [--ctx 32768] [--batch 4]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from snapmla_cli.analysis.verify import (
    make_problem,
    request_tokens,
    run_emulation,
    synthetic_source,
)
from snapmla_cli.numerics.problem import DecodeProblem
from snapmla_cli.ops.decode import decode_fp8, get_mla_metadata
from snapmla_cli.ops.decode_config import variant_config
from snapmla_cli.ops.prep import quantize_q


def kernel_lse(problem: DecodeProblem, version: int, max_splits: int | None) -> torch.Tensor:
    layout = problem.layout
    _b, s_q, h_q, _ = problem.q.shape
    cfg = variant_config(s_q * h_q, version).with_sms(torch.cuda.get_device_properties(0).multi_processor_count)
    if max_splits is not None:
        cfg = replace(cfg, split=replace(cfg.split, max_splits_per_request=max_splits))
    meta, splits = get_mla_metadata(layout.cache_seqlens, s_q * h_q, 1, config=cfg)
    _, lse = decode_fp8(quantize_q(problem.q), problem.fp8_cache(), layout.block_table, layout.cache_seqlens,
                        meta, splits, problem.softmax_scale, problem.causal, config=cfg)
    print(f"  v{version} splits per request: {torch.diff(splits.cpu()).tolist()}")
    return lse.double().cpu()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--mtp", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    source = synthetic_source(None)
    problem = make_problem(source, request_tokens(source, args.batch, args.ctx), args.heads, args.mtp, True, 0)
    _, emul_lse = run_emulation(problem)
    cpu_q = problem.q_quantized()
    problem = problem.to(torch.device("cuda"))
    emul_lse = emul_lse.double().cpu()
    gpu_q = quantize_q(problem.q)
    for part in ("content", "scale", "rope"):
        a = getattr(cpu_q, part).contiguous().view(torch.uint8).flatten()
        g = getattr(gpu_q, part).cpu().contiguous().view(torch.uint8).flatten()
        print(f"quantize_q on the GPU vs the CPU quantizer, {part}: {int((a != g).sum())} of {a.numel()} bytes differ")
    layout = problem.layout
    cpu_cache = problem.fp8_cache()
    from snapmla_cli.numerics.emulation import emulate_fp8_decode
    from snapmla_cli.numerics.quant import QuantizedRows

    gpu_rows = QuantizedRows(*(getattr(gpu_q, part).cpu() for part in ("content", "scale", "rope")))
    _, with_gpu_q = emulate_fp8_decode(gpu_rows, cpu_cache.cpu(), layout.block_table.cpu(), layout.cache_seqlens.cpu(),
                                       problem.softmax_scale, problem.causal)
    print(f"emulation with the GPU's Q vs with the CPU's: max |lse diff| "
          f"{float((with_gpu_q.double() - emul_lse).abs().max()):.5f}")
    for version, max_splits in ((3, None), (3, 1), (2, None), (2, 1)):
        lse = kernel_lse(problem, version, max_splits)
        diff = lse - emul_lse  # [b, h_q, s_q]
        worst = diff.abs().flatten().argmax()
        print(f"v{version} max_splits {max_splits}: max |diff| {float(diff.abs().max()):.5f}, mean diff "
              f"{float(diff.mean()):+.5f}, per request max {[round(float(d.abs().max()), 5) for d in diff]}")
        b, h, s = (int(i) for i in torch.unravel_index(worst, diff.shape))
        print(f"  worst row b {b} h {h} s {s}: lse {float(emul_lse[b, h, s]):.4f}, kernel {float(lse[b, h, s]):.4f}")
        flat_l, flat_d = emul_lse.flatten(), diff.flatten()
        print(f"  corr(|diff|, lse) {float(torch.corrcoef(torch.stack([flat_d.abs(), flat_l]))[0, 1]):+.3f}; "
              f"rows with |diff| > 1e-2: {int((flat_d.abs() > 1e-2).sum())} of {flat_d.numel()}")
        for h_i in range(min(args.heads, 4)):
            print(f"  head {h_i} diffs over requests: {[round(float(x), 5) for x in diff[:, h_i, 0]]}")


if __name__ == "__main__":
    main()
