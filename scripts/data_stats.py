"""Measure the synthetic default data for docs/DATA.md: value ranges per layer, what the probe
queries' attention looks like, and where the quantization error of each part comes from.

    python scripts/data_stats.py [--tokens 32k] [--layers 8] [--seed 0]

Prints markdown tables (about 35 s on two CPU cores at 32k tokens).
"""

from __future__ import annotations

import argparse

import torch

from snapmla_cli.analysis.fidelity import attention_over_tokens
from snapmla_cli.cache.synth import SynthSpec, effective_keys, layer_stats, synth_dump
from snapmla_cli.numerics.configs import CONFIGS
from snapmla_cli.numerics.formats import D_CONTENT, default_softmax_scale
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.sizes import parse_size


def snap_with_exact_rope(kv: torch.Tensor) -> torch.Tensor:
    """``snap`` but the RoPE part kept as given: isolates the cost of the pre-scaled bf16 RoPE."""
    fake = CONFIGS["snap"].fake_quant(kv)
    fake[:, D_CONTENT:] = kv[:, D_CONTENT:].float()
    return fake


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="32k")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = SynthSpec(layers=args.layers, tokens=parse_size(args.tokens), seed=args.seed)
    dump = synth_dump(spec)
    scale = default_softmax_scale()
    print("| layer | content max | content rms | content p99.9 | RoPE rms | RoPE p99.9 | RoPE max "
          "| token amax max/median | eff. keys (median) | top weight (median) | mean RoPE logit "
          "| std content logit | std RoPE logit |")
    print("|" + "---|" * 13)
    extra = []
    for layer in dump.layers:
        if layer.queries is None:
            raise SystemExit(f"layer {layer.index}: the dump holds no queries")
        st = layer_stats(layer.kv)
        q = layer.queries.double().reshape(-1, layer.kv.shape[1])
        kv = layer.kv.double()
        logit_c = scale * (q[:, :D_CONTENT] @ kv[:, :D_CONTENT].T)
        logit_r = scale * (q[:, D_CONTENT:] @ kv[:, D_CONTENT:].T)
        logits = logit_c + logit_r
        n_eff = effective_keys(logits).median()
        top = torch.softmax(logits, dim=-1).amax(dim=-1).median()
        print(f"| {layer.index} | {st.content_absmax:.3g} | {st.content_rms:.3g} | {st.content_p999:.3g} "
              f"| {st.rope_rms:.3g} | {st.rope_p999:.4g} | {st.rope_absmax:.4g} | {st.token_amax_spread:.3g} "
              f"| {float(n_eff):.0f} | {float(top):.2f} | {float(logit_r.mean()):.1f} "
              f"| {float(logit_c.std(dim=1).mean()):.2f} | {float(logit_r.std(dim=1).mean()):.2f} |")
        ref = attention_over_tokens(layer.queries, layer.kv, scale)
        row = {c: compare(attention_over_tokens(layer.queries, CONFIGS[c].fake_quant(layer.kv), scale), ref).rel_l2
               for c in ("snap", "A", "B", "C", "D", "G")}
        row["snap, exact RoPE"] = compare(attention_over_tokens(layer.queries, snap_with_exact_rope(layer.kv), scale),
                                          ref).rel_l2
        e4m3_rope = CONFIGS["A"].fake_quant(layer.kv)[:, D_CONTENT:]
        snap = CONFIGS["snap"].fake_quant(layer.kv)
        x = layer.kv.float()
        row["content MSE (snap)"] = float((snap[:, :D_CONTENT] - x[:, :D_CONTENT]).pow(2).mean())
        row["RoPE MSE (E4M3, A)"] = float((e4m3_rope - x[:, D_CONTENT:]).pow(2).mean())
        row["RoPE MSE (bf16 pre-scaled, snap)"] = float((snap[:, D_CONTENT:] - x[:, D_CONTENT:]).pow(2).mean())
        extra.append((layer.index, row))
    keys = list(extra[0][1])
    print()
    print("| layer | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for index, row in extra:
        print(f"| {index} | " + " | ".join(f"{row[k]:.3e}" for k in keys) + " |")
    means = {k: sum(r[k] for _, r in extra) / len(extra) for k in keys}
    print("| mean | " + " | ".join(f"{means[k]:.3e}" for k in keys) + " |")


if __name__ == "__main__":
    main()
