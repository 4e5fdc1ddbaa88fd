"""How sensitive is the FP8 decode output to small logit errors, on the `verify` data versus the
random data of the GPU tests? Perturbs the content logits inside the SPEC emulation (random
relative noise, a systematic shrink, or noise relative to the row's largest logit) and reports
rel_l2 against the unperturbed emulation and the float64 reference. CPU only.

Why: the wgmma kernel passes the random-data GPU tests but failed `snapmla verify --ctx 32k`;
this measures how much logit error each data set tolerates (docs/DESIGN.md, "wgmma kernel: open
numerics problem"). Usage: ``PYTHONPATH=. python3 scripts/logit_error_sensitivity.py [h_q]``."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from snapmla_cli.analysis.verify import make_problem, request_tokens, synthetic_source
from snapmla_cli.cache.layout import dequantize_cache
from snapmla_cli.numerics import emulation
from snapmla_cli.numerics.decode_ref import decode_reference
from snapmla_cli.numerics.metrics import compare
from snapmla_cli.numerics.problem import DecodeProblem, random_problem

EPSILONS = (2**-14, 2**-12, 2**-10)
Perturb = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
MODELS: dict[str, Callable[[float], Perturb]] = {
    "rel": lambda eps: lambda r, g: r * (1 + eps * torch.randn(r.shape, generator=g, dtype=r.dtype)),
    "bias": lambda eps: lambda r, g: r * (1 - eps),
    "abs": lambda eps: lambda r, g: r + eps * r.abs().amax(dim=1, keepdim=True)
    * torch.randn(r.shape, generator=g, dtype=r.dtype),
}


def emulate(prob: DecodeProblem, perturb: Perturb | None) -> torch.Tensor:
    """The SPEC emulation, with ``perturb`` applied to the content logits (q_c @ k_c^T)."""
    original = emulation._split_rows
    plain_matmul = torch.Tensor.__matmul__

    def split_rows(q_c: torch.Tensor, q_s: torch.Tensor, q_r: torch.Tensor, k_c: torch.Tensor,
                   k_s: torch.Tensor, k_r: torch.Tensor, visible: torch.Tensor, start: int,
                   softmax_scale: float) -> emulation.PartialResult:
        gen = torch.Generator().manual_seed(start)

        def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            r = plain_matmul(a, b)
            is_content_logits = r.dim() == 2 and r.shape == (q_c.shape[0], k_c.shape[0]) and a.shape[1] == q_c.shape[1]
            return r if perturb is None or not is_content_logits else perturb(r, gen)

        torch.Tensor.__matmul__ = matmul  # type: ignore[method-assign,assignment]  # the perturbation's hook
        try:
            return original(q_c, q_s, q_r, k_c, k_s, k_r, visible, start, softmax_scale)
        finally:
            torch.Tensor.__matmul__ = plain_matmul  # type: ignore[method-assign]

    if perturb is not None:
        emulation._split_rows = split_rows
    try:
        lay = prob.layout
        out, _ = emulation.emulate_fp8_decode(prob.q_quantized(), prob.fp8_cache(), lay.block_table,
                                              lay.cache_seqlens, prob.softmax_scale, prob.causal)
        return out
    finally:
        emulation._split_rows = original


def report(prob: DecodeProblem, label: str) -> None:
    lay = prob.layout
    args = (lay.block_table, lay.cache_seqlens, prob.softmax_scale, prob.causal)
    ref, _ = decode_reference(prob.q, prob.bf16_cache().squeeze(2), *args)
    floor, _ = decode_reference(prob.q_quantized().dequantize(torch.float64),
                                dequantize_cache(prob.fp8_cache(), torch.float64), *args)
    base = emulate(prob, None)
    fl = compare(floor, ref).rel_l2
    print(f"{label}: emulation vs ref64 {compare(base, ref).rel_l2:.3e}, floor {fl:.3e} "
          f"(ref gate {1.1 * fl + 1e-3:.3e}, emulation gate 5e-3)")
    for name, model in MODELS.items():
        for eps in EPSILONS:
            out = emulate(prob, model(eps))
            print(f"   {name:4s} eps 2^{int(math.log2(eps))}: vs emulation {compare(out, base).rel_l2:.3e}"
                  f"  vs ref64 {compare(out, ref).rel_l2:.3e}", flush=True)


def main() -> None:
    heads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    source = synthetic_source(None)
    report(make_problem(source, request_tokens(source, 1, 32 * 1024), heads, 1, causal=True),
           f"verify synthetic h_q {heads}, 32k")
    report(random_problem([5000], 1, heads, causal=False, seed=5), f"test random h_q {heads}, 5000")


if __name__ == "__main__":
    main()
