// Warp-per-row RoPE-aware per-token quantization (SPEC section 3), shared by the Q-quant and
// K-append kernels (and by any later kernel that quantizes rows on the fly).
//
// Lane map of one 576-wide bf16 row; every warp-wide store writes whole 32-byte sectors:
//   content, PREP_CONTENT_MAP 0 (default): lane l owns elements [8l, 8l+8) and [256+8l,
//            256+8l+8): two coalesced 16-byte loads (512 contiguous bytes each), and after
//            quantization two 8-byte E4M3 stores at the same element offsets (256 contiguous
//            bytes = 8 whole sectors each);
//   content, PREP_CONTENT_MAP 1: lane l owns elements [16l, 16l+16): two 16-byte loads at byte
//            offsets 32l and 32l+16 (each instruction touches half of each of 32 sectors; they go
//            through L1, allocating, so the second should hit the lines the first brought in),
//            and one 16-byte E4M3 store per lane (512 contiguous bytes): one store instruction
//            per row instead of two, at the price of the strided loads. The benchmark's --sweep
//            measures both;
//   rope:    lane l owns elements [512+2l, 512+2l+2): one 4-byte load (128 contiguous bytes per
//            warp); the 64 RoPE divisions are spread over all 32 lanes (2 per lane), the fewest
//            warp instructions for them (4 per lane on 16 lanes before).
// Numerics, bit for bit as snapmla_cli.numerics.quant.quantize_rows:
//   s = max(amax / 448, 2^-32) (IEEE division), c_q = e4m3_rn_sat(c / s), r' = bf16_rn(r / s).
// (amax is a max, exact in any order; every quotient is computed by the same per-element
// function whatever lane holds it, so the lane map does not change a single bit.)
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

#ifndef PREP_CONTENT_MAP
#define PREP_CONTENT_MAP 0
#endif
static_assert(PREP_CONTENT_MAP == 0 || PREP_CONTENT_MAP == 1, "PREP_CONTENT_MAP is 0 or 1");

constexpr int QROW_CHUNK = 8;                             // content elements per 16-byte load
constexpr int QROW_HALF = D_CONTENT / 2;                  // 256
constexpr int QROW_ROPE_PER_LANE = D_ROPE / WARP_SIZE;    // 2 elements (4 bytes)
static_assert(QROW_HALF == WARP_SIZE * QROW_CHUNK, "32 lanes x 8 elements cover half a row");
static_assert(QROW_ROPE_PER_LANE == 2, "one bf16x2 word of RoPE per lane");

// First content element of lane l's chunk 0 and chunk 1 (8 elements each).
__device__ __forceinline__ int content_chunk0(int lane) {
    return PREP_CONTENT_MAP ? 2 * QROW_CHUNK * lane : QROW_CHUNK * lane;
}
__device__ __forceinline__ int content_chunk1(int lane) {
    return PREP_CONTENT_MAP ? 2 * QROW_CHUNK * lane + QROW_CHUNK : QROW_HALF + QROW_CHUNK * lane;
}

// Raw bf16 bits of one row as one lane holds them.
struct RowBf16 {
    uint4 c0;  // content elements [content_chunk0, +8)
    uint4 c1;  // content elements [content_chunk1, +8)
    u32 r;     // rope elements [2l, 2l+2)
};

// One lane's share of a quantized row.
struct RowFp8 {
    uint4 c;      // E4M3 of chunk 0 (.x, .y) and chunk 1 (.z, .w), lowest byte = first element
    u32 r;        // pre-scaled bf16 rope [2l, 2l+2), element 2l in the low half
    float scale;  // the row's dequant scale s (same in every lane)
};

__device__ __forceinline__ RowBf16 load_row_bf16(const __nv_bfloat16* row, int lane) {
    RowBf16 v;
    if (PREP_CONTENT_MAP) {
        v.c0 = ldg_nc_v4_l1(row + content_chunk0(lane));
        v.c1 = ldg_nc_v4_l1(row + content_chunk1(lane));
    } else {
        v.c0 = ldg_nc_v4(row + content_chunk0(lane));
        v.c1 = ldg_nc_v4(row + content_chunk1(lane));
    }
    v.r = ldg_nc_u32(row + D_CONTENT + QROW_ROPE_PER_LANE * lane);
    return v;
}

// The 512 E4M3 content bytes of a quantized row, written at `dst` (16-byte aligned) with whole
// sectors per instruction (the lane map above).
__device__ __forceinline__ void store_content(u8* dst, const RowFp8& o, int lane) {
    if (PREP_CONTENT_MAP) {
        stg_v4(dst + content_chunk0(lane), o.c);
    } else {
        stg_v2(dst + content_chunk0(lane), make_uint2(o.c.x, o.c.y));
        stg_v2(dst + content_chunk1(lane), make_uint2(o.c.z, o.c.w));
    }
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

// Sixteen content floats (lo = chunk 0, hi = chunk 1) divided by s -> sixteen E4M3 bytes, the
// first element of chunk 0 in the lowest byte. kFast: |c| <= amax and s finite, so the fast quotient is exact
// (or E4M3-zero); otherwise IEEE division.
template <bool kFast>
__device__ __forceinline__ uint4 quantize16_e4m3(const float (&lo)[8], const float (&hi)[8],
                                                 const RowDivisor& d) {
    float q[16];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        q[i] = kFast ? div_markstein(lo[i], d.s, d.y) : __fdiv_rn(lo[i], d.s);
        q[8 + i] = kFast ? div_markstein(hi[i], d.s, d.y) : __fdiv_rn(hi[i], d.s);
    }
    return make_uint4(f32x4_to_e4m3x4(q[0], q[1], q[2], q[3]),
                      f32x4_to_e4m3x4(q[4], q[5], q[6], q[7]),
                      f32x4_to_e4m3x4(q[8], q[9], q[10], q[11]),
                      f32x4_to_e4m3x4(q[12], q[13], q[14], q[15]));
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
        out.c = quantize16_e4m3<true>(c0, c1, d);
    } else {
        out.c = quantize16_e4m3<false>(c0, c1, d);
    }
    const float r0 = __uint_as_float(in.r << 16);
    const float r1 = __uint_as_float(in.r & 0xffff0000u);
    out.r = f32x2_to_bf16x2_rn(div_rope(r0, d), div_rope(r1, d));
    return out;
}

}  // namespace snapmla
