// FP8 (E4M3) and bf16 conversions with the exact rounding SPEC section 3 prescribes.
//
// Quantization: e4m3 = round-to-nearest-even, saturating at +-448 (cvt.rn.satfinite.e4m3x2.f32,
// which equals the reference's clamp-then-round); bf16 = round-to-nearest-even (cvt.rn.bf16x2).
// Dequantization: E4M3 -> f16 -> f32 and bf16 -> f32 are exact (bit moves), so the only
// rounding left is the one the caller asks for.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/types.cuh"

namespace snapmla {

// ---- bf16 <-> f32 ----

// Eight bf16 packed in a uint4 -> eight floats (exact: a bf16 is the top half of an f32).
__device__ __forceinline__ void bf16x8_to_f32(const uint4& v, float (&out)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// Four bf16 packed in a uint2 -> four floats (exact).
__device__ __forceinline__ void bf16x4_to_f32(const uint2& v, float (&out)[4]) {
    out[0] = __uint_as_float(v.x << 16);
    out[1] = __uint_as_float(v.x & 0xffff0000u);
    out[2] = __uint_as_float(v.y << 16);
    out[3] = __uint_as_float(v.y & 0xffff0000u);
}

// Two floats -> packed bf16x2, round to nearest even; `lo` lands in the low 16 bits.
__device__ __forceinline__ u32 f32x2_to_bf16x2_rn(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
}

// ---- f32 -> E4M3 ----

// Two floats -> two E4M3 bytes (RNE, saturating finite); `lo` lands in the low byte.
__device__ __forceinline__ u32 f32x2_to_e4m3x2(float lo, float hi) {
    return static_cast<u32>(
        __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// Four floats -> four E4M3 bytes in one u32 (element 0 in the lowest byte).
__device__ __forceinline__ u32 f32x4_to_e4m3x4(float a, float b, float c, float d) {
    return f32x2_to_e4m3x2(a, b) | (f32x2_to_e4m3x2(c, d) << 16);
}

// ---- E4M3 -> f32 (exact) ----

// Two E4M3 bytes (low byte = element 0) -> two floats, through an exact f16x2 conversion.
__device__ __forceinline__ float2 e4m3x2_to_f32x2(u32 two_bytes) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu);
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    return make_float2(__half2float(__half(__half_raw{h.x})),
                       __half2float(__half(__half_raw{h.y})));
}

// Four E4M3 bytes in a u32 -> four floats.
__device__ __forceinline__ void e4m3x4_to_f32(u32 four_bytes, float* out) {
    const float2 lo = e4m3x2_to_f32x2(four_bytes);
    const float2 hi = e4m3x2_to_f32x2(four_bytes >> 16);
    out[0] = lo.x;
    out[1] = lo.y;
    out[2] = hi.x;
    out[3] = hi.y;
}

}  // namespace snapmla
