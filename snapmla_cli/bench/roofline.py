"""Work accounting of SPEC section 7: FLOPs, bytes, and the effective roofline time."""

from __future__ import annotations

from dataclasses import dataclass

from ..numerics.formats import BF16_TOKEN_BYTES, D_CONTENT, D_QK, D_ROPE, D_V, FP8_TOKEN_BYTES


@dataclass(frozen=True)
class Ceilings:
    """Measured on the same GPU in the same run: bf16 and fp8 matrix rates (FLOP/s) and copy
    bandwidth (bytes read + written per second)."""

    p16: float
    p8: float
    bandwidth: float


@dataclass(frozen=True)
class DecodeWork:
    """One decode call of ``batch`` requests of ``context`` cached tokens each. ``causal`` as the
    call's flag: query token t then sees ``context - s_q + t + 1`` keys (SPEC section 2), which
    section 7's FLOPs count; the benchmarks decode causally, as MTP engines do."""

    batch: int
    s_q: int
    h_q: int
    context: int
    causal: bool = False

    @property
    def row_keys(self) -> int:
        """sum over query rows of visible keys (non-causal: every row sees the context)."""
        if not self.causal:
            return self.batch * self.s_q * self.h_q * self.context
        visible = sum(min(max(self.context - self.s_q + t + 1, 0), self.context) for t in range(self.s_q))
        return self.batch * self.h_q * visible

    @property
    def flops(self) -> float:
        return 2.0 * self.row_keys * (D_QK + D_V)

    def bytes(self, fp8: bool) -> float:
        kv = self.batch * self.context * (FP8_TOKEN_BYTES if fp8 else BF16_TOKEN_BYTES)
        q = self.batch * self.s_q * self.h_q * D_QK * 2
        out = self.batch * self.s_q * self.h_q * D_V * 2
        return float(kv + q + out)

    def t_min(self, fp8: bool, c: Ceilings) -> float:
        memory = self.bytes(fp8) / c.bandwidth
        if fp8:
            compute = self.row_keys * (2 * (D_CONTENT + D_V) / c.p8 + 2 * D_ROPE / c.p16)
        else:
            compute = self.flops / c.p16
        return max(memory, compute)
