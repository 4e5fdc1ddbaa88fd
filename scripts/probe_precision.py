"""Where does the FP8 kernel's error against the SPEC emulation come from? Runs one `verify`
problem (synthetic default, last layer) through the mma.sync kernel (exact float32
accumulation) and the wgmma kernel: at its default split, at much finer splits (shorter PV
accumulation chains per split), and with float32 promotion of the QK and/or PV accumulation;
prints rel_l2 against the (split-aware) emulation and the float64 reference. A diagnostic for kernel work; `snapmla verify` is the gate."""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from snapmla_cli.analysis.verify import (
    FP8_KERNEL_VARIANTS,
    make_problem,
    request_tokens,
    synthetic_source,
)
from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.emulation import emulate_fp8_decode
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.ops.decode import decode_fp8, get_mla_metadata
from snapmla_cli.ops.decode_config import variant_config
from snapmla_cli.ops.schedule import split_token_bounds


def main() -> None:
    heads, mtp, ctx, batch = (int(x) for x in (sys.argv[1:] + ["16", "1", "32768", "4"])[:4])
    dev = torch.device("cuda")
    source = synthetic_source(None)
    prob = make_problem(source, request_tokens(source, batch, ctx), heads, mtp, causal=True).to(dev)
    lay = prob.layout
    q8 = prob.q_quantized()
    cache = prob.fp8_cache()
    ref, _ = decode_reference(prob.q, prob.bf16_cache().squeeze(2), lay.block_table, lay.cache_seqlens,
                              prob.softmax_scale, prob.causal)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    variants = [(name, False) for name in FP8_KERNEL_VARIANTS] + [("v3-unpromoted", True)]
    for label, fine in variants:
        version, overrides = FP8_KERNEL_VARIANTS[label]
        cfg = variant_config(heads * mtp, version, **overrides).with_sms(sms)
        if fine:
            label += "-fine"
            cfg = replace(cfg, split=replace(cfg.split, min_blocks_per_split=1, num_sms=4096, max_splits_per_request=512))
        meta, splits = get_mla_metadata(lay.cache_seqlens, heads * mtp, 1, config=cfg)
        out, _lse = decode_fp8(q8, cache, lay.block_table, lay.cache_seqlens, meta, splits, prob.softmax_scale,
                              prob.causal, config=cfg)
        bounds = split_token_bounds(splits, meta, [int(n) for n in lay.cache_seqlens.tolist()])
        emul, _ = emulate_fp8_decode(q8, cache, lay.block_table, lay.cache_seqlens, prob.softmax_scale,
                                     prob.causal, split_bounds=bounds)
        print(f"h{heads} s_q{mtp} ctx{ctx} {label:16s} splits {meta.shape[0]:5d}: vs emul rel_l2 "
              f"{compare(out, emul).rel_l2:.3e}  vs ref64 {compare(out, ref).rel_l2:.3e}  "
              f"emul vs ref64 {compare(emul, ref).rel_l2:.3e}", flush=True)


if __name__ == "__main__":
    main()
