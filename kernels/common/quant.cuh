// Warp-per-row RoPE-aware per-token quantization (SPEC section 3), shared by the Q-quant and
// K-append kernels (and by any later kernel that quantizes rows on the fly).
//
// Lane map of one 576-wide bf16 row (every warp-wide access is fully coalesced):
//   content: lane l owns elements [8l, 8l+8) and [256+8l, 256+8l+8): two 16-byte loads,
//            and after quantization two 8-byte E4M3 stores at the same element offsets;
//   rope:    lanes 0..15 own elements [512+4l, 512+4l+4): one 8-byte load / 8-byte store
//            (spreading the 64 RoPE divisions over 16 lanes instead of 8 halves their latency).
// Numerics, bit for bit as snapmla_cli.numerics.quant.quantize_rows:
//   s = max(amax / 448, 2^-32) (IEEE division), c_q = e4m3_rn_sat(c / s), r' = bf16_rn(r / s).
//
// Division by s: every quotient must be the correctly rounded float32 c / s. A plain
// __fdiv_rn per element costs a MUFU.RCP, an FCHK and ~8 other instructions, which is a large
// share of the time of these memory-bound kernels. With SNAPMLA_FAST_EXACT_DIV (default) the
// reciprocal y = RN(1/s) is computed once per row and each quotient uses Markstein's
// correction, q = RN(a*y), r = fma(-s, q, a) (exact), RN(q + r*y) = RN(a/s) (correct while
// a, q and r are normal floats), with the sign of a restored so that -0 / s = -0:
//   - content: |c| <= amax, so q <= ~448: no overflow; results below 2^-100 (where r might not
//     be exact) are E4M3 zero either way, so only a non-finite s needs __fdiv_rn;
//   - rope: any magnitude, so each quotient outside [2^-100, 2^100] (or |r| < 2^-100) is
//     recomputed with __fdiv_rn.
// Checked against IEEE division on 5e8 (a, b) pairs (every b mantissa) and 3e8 bf16 content
// rows (E4M3 bytes) with no mismatch; the GPU tests compare bytes with the reference.
#pragma once

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"

namespace snapmla {

constexpr int QROW_ELEMS_PER_CHUNK = 8;                                // bf16 per 16-byte load
constexpr int QROW_HALF = D_CONTENT / 2;                               // 256: second chunk offset
constexpr int QROW_CONTENT_PER_LANE = 2 * QROW_ELEMS_PER_CHUNK;        // 16
constexpr int QROW_ROPE_PER_LANE = 4;                                  // bf16 per 8-byte load
constexpr int QROW_ROPE_LANES = D_ROPE / QROW_ROPE_PER_LANE;           // 16
static_assert(QROW_HALF == WARP_SIZE * QROW_ELEMS_PER_CHUNK, "32 lanes x 8 cover half a row");
static_assert(QROW_ROPE_LANES <= WARP_SIZE, "rope fits one warp");

// Raw bf16 bits of one row as one lane holds them.
struct RowBf16 {
    uint4 c0;  // content elements [8l, 8l+8)
    uint4 c1;  // content elements [256+8l, 256+8l+8)
    uint2 r;   // rope elements [4l, 4l+4) (lanes < 16; zero elsewhere)
};

// One lane's share of a quantized row.
struct RowFp8 {
    uint2 c0;     // E4M3 of content [8l, 8l+8)
    uint2 c1;     // E4M3 of content [256+8l, 256+8l+8)
    uint2 r;      // pre-scaled bf16 rope [4l, 4l+4) (lanes < 16)
    float scale;  // the row's dequant scale s (same in every lane)
};

__device__ __forceinline__ RowBf16 load_row_bf16(const __nv_bfloat16* row, int lane) {
    RowBf16 v;
    v.c0 = ldg_nc_v4(row + QROW_ELEMS_PER_CHUNK * lane);
    v.c1 = ldg_nc_v4(row + QROW_HALF + QROW_ELEMS_PER_CHUNK * lane);
    v.r = make_uint2(0u, 0u);
    if (lane < QROW_ROPE_LANES) {
        v.r = ldg_nc_v2(row + D_CONTENT + QROW_ROPE_PER_LANE * lane);
    }
    return v;
}

#ifndef SNAPMLA_FAST_EXACT_DIV
#define SNAPMLA_FAST_EXACT_DIV 1
#endif

constexpr float FAST_DIV_MIN = 0x1p-100f;  // below: the remainder r may be inexact (underflow)
constexpr float FAST_DIV_MAX = 0x1p100f;   // above: q = a*y may overflow

// a / s correctly rounded, given y = __frcp_rn(s); valid in the ranges documented above.
__device__ __forceinline__ float div_markstein(float a, float s, float y) {
    const float q = __fmul_rn(a, y);
    const float r = __fmaf_rn(-s, q, a);
    return copysignf(__fmaf_rn(r, y, q), a);
}

// The row's divisor s with its reciprocal, and whether the fast quotient applies at all.
struct RowDivisor {
    float s;
    float y;
    bool fast;
};

__device__ __forceinline__ RowDivisor make_divisor(float s) {
    RowDivisor d;
    d.s = s;
    d.y = __frcp_rn(s);
    d.fast = SNAPMLA_FAST_EXACT_DIV && isfinite(s);
    return d;
}

// RoPE element: any magnitude; fall back to __fdiv_rn outside the fast path's safe range.
__device__ __forceinline__ float div_rope(float r, const RowDivisor& d) {
    float q = div_markstein(r, d.s, d.y);
    const float ar = fabsf(r), aq = fabsf(q);
    const bool safe = r == 0.0f || (ar >= FAST_DIV_MIN && aq >= FAST_DIV_MIN && aq <= FAST_DIV_MAX);
    if (!(d.fast && safe)) q = __fdiv_rn(r, d.s);  // rare: a divergent branch, not a select
    return q;
}

// Eight content floats divided by s -> eight E4M3 bytes. kFast: |c| <= amax and s finite, so
// the fast quotient is exact (or E4M3-zero); otherwise IEEE division.
template <bool kFast>
__device__ __forceinline__ uint2 quantize8_e4m3(const float (&x)[8], const RowDivisor& d) {
    float q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = kFast ? div_markstein(x[i], d.s, d.y) : __fdiv_rn(x[i], d.s);
    return make_uint2(f32x4_to_e4m3x4(q[0], q[1], q[2], q[3]),
                      f32x4_to_e4m3x4(q[4], q[5], q[6], q[7]));
}

// Must be called by all 32 lanes of the warp (it reduces the amax with shuffles).
__device__ __forceinline__ RowFp8 quantize_row(const RowBf16& in) {
    float c0[8], c1[8];
    bf16x8_to_f32(in.c0, c0);
    bf16x8_to_f32(in.c1, c1);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmax_nan(amax, fmax_nan(fabsf(c0[i]), fabsf(c1[i])));
    amax = warp_max_nan(amax);
    const RowDivisor d = make_divisor(fmax_nan(__fdiv_rn(amax, E4M3_MAX), KV_SCALE_FLOOR));

    RowFp8 out;
    out.scale = d.s;
    if (d.fast) {  // warp-uniform: s is the same in every lane
        out.c0 = quantize8_e4m3<true>(c0, d);
        out.c1 = quantize8_e4m3<true>(c1, d);
    } else {
        out.c0 = quantize8_e4m3<false>(c0, d);
        out.c1 = quantize8_e4m3<false>(c1, d);
    }
    float r[4];
    bf16x4_to_f32(in.r, r);
    out.r = make_uint2(f32x2_to_bf16x2_rn(div_rope(r[0], d), div_rope(r[1], d)),
                       f32x2_to_bf16x2_rn(div_rope(r[2], d), div_rope(r[3], d)));
    return out;
}

}  // namespace snapmla
