"""The reference quantizer (SPEC section 3) against a plain per-token Python loop that rounds with
an independent E4M3 table and a bit-level bf16 rounding."""

from __future__ import annotations

import bisect
import struct

import numpy as np
import pytest
import torch

from snapmla_cli.cache.layout import pack_tokens, quantize_tokens, unpack_tokens
from snapmla_cli.numerics.formats import D_CONTENT, D_QK

# SPEC section 3's constants, written out here rather than imported from the code under test
E4M3_MAX = 448.0
KV_SCALE_FLOOR = 2.0**-32
from snapmla_cli.numerics.quant import e4m3_round, quantize_rows


def _e4m3_table() -> tuple[list[float], list[int]]:
    """Every finite non-negative E4M3 (fn) value and its 7-bit code, ascending."""
    values, codes = [], []
    for code in range(0x7F):  # 0x7F is NaN
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:
            value = mantissa / 8 * 2.0**-6
        else:
            value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        values.append(value)
        codes.append(code)
    return values, codes


_VALUES, _CODES = _e4m3_table()


def e4m3_byte(x: float) -> int:
    """Round-to-nearest-even onto the E4M3 grid, saturating at +-448; returns the byte."""
    sign = 0x80 if (x < 0 or (x == 0 and np.signbit(x))) else 0
    a = min(abs(x), E4M3_MAX)
    i = bisect.bisect_left(_VALUES, a)
    if i < len(_VALUES) and _VALUES[i] == a:
        return sign | _CODES[i]
    lo, hi = i - 1, i
    d_lo, d_hi = a - _VALUES[lo], _VALUES[hi] - a
    pick = lo if d_lo < d_hi else hi if d_hi < d_lo else (lo if _CODES[lo] % 2 == 0 else hi)
    return sign | _CODES[pick]


def bf16_bits(x: np.float32) -> int:
    bits = struct.unpack("<I", struct.pack("<f", float(x)))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def loop_quantize(kv: torch.Tensor) -> bytes:
    """SPEC section 3, one token and one element at a time, in numpy float32."""
    out = bytearray()
    for row in kv.float().numpy():
        content, rope = row[:D_CONTENT], row[D_CONTENT:]
        amax = np.float32(0)
        for v in content:
            amax = max(amax, np.float32(abs(v)))
        s = max(np.float32(amax) / np.float32(448), np.float32(KV_SCALE_FLOOR))
        token = bytearray(656)
        for j, v in enumerate(content):
            token[j] = e4m3_byte(float(np.float32(v) / s))
        token[512:516] = struct.pack("<f", float(s))
        for j, v in enumerate(rope):
            token[528 + 2 * j : 530 + 2 * j] = struct.pack("<H", bf16_bits(np.float32(v) / s))
        out += token
    return bytes(out)


def _tokens(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    gains = torch.tensor([1.0, 1e-3, 37.0, 1e-30, 0.5])[:, None]
    content = torch.randn(5, D_CONTENT, generator=gen) * gains
    rope = torch.randn(5, 64, generator=gen) * 300
    return torch.cat([content, rope], dim=1).to(torch.bfloat16)


def test_quantizer_matches_the_python_loop() -> None:
    kv = _tokens()
    assert quantize_tokens(kv).numpy().tobytes() == loop_quantize(kv)


def test_quantizer_matches_the_loop_on_float32_input() -> None:
    kv = _tokens(1).float() * 1.0001  # not bf16-representable values
    assert quantize_tokens(kv).numpy().tobytes() == loop_quantize(kv)


def test_independent_e4m3_rounding_agrees_on_hard_values() -> None:
    hard = [0.0, 2.0**-10, 2.0**-9 * 1.5, 2.0**-7 * 1.0625, 1.0625, 1.1875, 17.0, 440.0, 448.0, 460.0, 1e9, -3.3,
            float("inf"), float("-inf")]  # saturating, as SPEC says: +-inf to +-448, never NaN
    ours = e4m3_round(torch.tensor(hard)).view(torch.uint8).tolist()
    assert ours == [e4m3_byte(v) for v in hard]


def test_round_trip_error_bound() -> None:
    kv = _tokens(2).float()
    rows = quantize_rows(kv)
    back = rows.dequantize()
    s = rows.scale[:, None]
    content, content_back = kv[:, :D_CONTENT], back[:, :D_CONTENT]
    # normal E4M3: half an ulp is at most 2^-4 relative; subnormals: half a step of s * 2^-9
    bound = content.abs() * 2.0**-4 + s * 2.0**-10
    assert bool(((content_back - content).abs() <= bound * 1.0001).all())
    rope_err = (back[:, D_CONTENT:] - kv[:, D_CONTENT:]).abs()
    assert bool((rope_err <= kv[:, D_CONTENT:].abs() * 2.0**-8 * 1.01 + 1e-30).all())


def test_zero_vector_gets_the_floor_scale_and_dequantizes_to_zero() -> None:
    kv = torch.zeros(2, D_QK)
    kv[1, D_CONTENT:] = torch.linspace(-5, 5, 64)  # zero content, non-zero RoPE
    rows = quantize_rows(kv)
    assert rows.scale.tolist() == [KV_SCALE_FLOOR, KV_SCALE_FLOOR]
    assert rows.content.view(torch.uint8).eq(0).all()
    back = rows.dequantize()
    assert back[0].eq(0).all()
    assert torch.isfinite(rows.rope.float()).all()
    torch.testing.assert_close(back[1, D_CONTENT:], kv[1, D_CONTENT:], rtol=2**-8, atol=0)


def test_448_saturation_and_the_amax_element() -> None:
    assert e4m3_round(torch.tensor([500.0, -1e6, 448.0])).float().tolist() == [448.0, -448.0, 448.0]
    kv = _tokens(3)
    rows = quantize_rows(kv)
    content = rows.content.float()
    # token 3 (gain 1e-30) hits the 2^-32 scale floor and flushes to zero; the others reach 448
    assert content.abs().amax(dim=1).tolist() == [448.0, 448.0, 448.0, 0.0, 448.0]
    assert content.abs().max() <= E4M3_MAX


def test_rope_is_prescaled_by_the_token_scale() -> None:
    kv = _tokens(4).float()
    rows = quantize_rows(kv)
    expect = (kv[:, D_CONTENT:] / rows.scale[:, None]).to(torch.bfloat16)
    assert torch.equal(rows.rope.view(torch.int16), expect.view(torch.int16))
    assert not torch.equal(rows.rope, kv[:, D_CONTENT:].to(torch.bfloat16))


def test_rope_prescaling_is_a_correctly_rounded_division() -> None:
    """SPEC section 3: ``rope / s`` is an IEEE float32 division. With s = fl32(1 / 448) (content
    amax 1) the RoPE value 1.15625 divides to 518.0000x, 520 in bf16, where a multiply by the
    reciprocal lands below 518 and rounds to 516: a value pair on which the two differ."""
    kv = torch.zeros(1, D_QK, dtype=torch.bfloat16)
    kv[0, :D_CONTENT] = 0.5
    kv[0, 0] = 1.0
    kv[0, D_CONTENT:] = 1.15625
    rows = quantize_rows(kv)
    s = np.float32(1.0) / np.float32(448.0)
    assert rows.scale.item() == s
    quotient = np.float32(1.15625) / s  # numpy's float32 division, then bf16 round-to-nearest-even
    assert torch.tensor(float(quotient)).to(torch.bfloat16).item() == 520.0
    assert torch.tensor(float(np.float32(1.15625) * (np.float32(1.0) / s))).to(torch.bfloat16).item() == 516.0
    assert torch.all(rows.rope == 520.0)


def test_pack_unpack_round_trip() -> None:
    rows = quantize_rows(_tokens(5))
    again = unpack_tokens(pack_tokens(rows))
    assert torch.equal(again.content.view(torch.uint8), rows.content.view(torch.uint8))
    assert torch.equal(again.scale, rows.scale)
    assert torch.equal(again.rope.view(torch.int16), rows.rope.view(torch.int16))


@pytest.mark.parametrize("shape", [(2, 3, D_QK), (1, 1, 1, D_QK)])
def test_any_leading_shape(shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    rows = quantize_rows(x)
    flat = quantize_rows(x.reshape(-1, D_QK))
    assert torch.equal(rows.scale.reshape(-1), flat.scale)


def test_a_row_of_another_width_is_named_in_the_librarys_error() -> None:
    """The reference quantizer's shape error is a SnapmlaError (the CLI's one-line kind)."""
    from snapmla_cli.errors import SnapmlaError

    with pytest.raises(SnapmlaError, match=rf"^quantize_rows: expected last dim {D_QK}, got \(1, {D_CONTENT}\)"):
        quantize_rows(torch.zeros(1, D_CONTENT))
