// Split-KV combine: merges the float32 partials (O/L, lse) of every request that was split by
// log-sum-exp weighting, and writes out = 0, lse = +inf for requests with no keys at all.
// Requests with exactly one split were written directly by the decode kernel and are skipped.
#include "decode_common.cuh"

#ifndef COMBINE_WARPS
#define COMBINE_WARPS 4  // query rows per CTA (one warp each)
#endif

namespace snapmla {
namespace combine {
constexpr int kFloatsPerLane = kDimV / 32;          // 16
constexpr int kVec = 4;                             // float4 per access
constexpr int kVecsPerLane = kFloatsPerLane / kVec; // 4
}  // namespace combine
}  // namespace snapmla

extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32)
snapmla_combine(const float* partial_out, const float* partial_lse, const int* num_splits,
                __nv_bfloat16* out, float* lse, int h_q, int s_q) {
    using namespace snapmla;
    using namespace snapmla::combine;
    // launched programmatically (runtime/pdl.py): the decode grid may still be running
    wait_for_predecessor();
    const int req = blockIdx.x;
    const int rows = h_q * s_q;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.y * COMBINE_WARPS + warp;
    if (row >= rows) return;
    const int begin = num_splits[req];
    const int count = num_splits[req + 1] - begin;
    if (count == 1) return;
    const DecodeShape shape{h_q, s_q, 0};
    const long out_base = (static_cast<long>(req) * rows + row) * kDimV;

    float lse_max = -INFINITY;
    for (int s = lane; s < count; s += 32)
        lse_max = fmaxf(lse_max, partial_lse[static_cast<long>(begin + s) * rows + row]);
    for (int off = 16; off > 0; off /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, off));
    float total = 0.f;
    if (lse_max > -INFINITY) {
        for (int s = lane; s < count; s += 32)
            total += expf(partial_lse[static_cast<long>(begin + s) * rows + row] - lse_max);
        for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    }
    const bool has_keys = lse_max > -INFINITY;
    const float lse_total = has_keys ? lse_max + logf(total) : INFINITY;

    float acc[kFloatsPerLane];
#pragma unroll
    for (int i = 0; i < kFloatsPerLane; ++i) acc[i] = 0.f;
    if (has_keys) {
        for (int s = 0; s < count; ++s) {
            const long part = static_cast<long>(begin + s) * rows + row;
            const float l = partial_lse[part];
            if (l == -INFINITY) continue;
            const float w = expf(l - lse_total);
            const float4* src = reinterpret_cast<const float4*>(partial_out + part * kDimV);
#pragma unroll
            for (int v = 0; v < kVecsPerLane; ++v) {
                const float4 x = src[v * 32 + lane];
                acc[4 * v] += w * x.x; acc[4 * v + 1] += w * x.y;
                acc[4 * v + 2] += w * x.z; acc[4 * v + 3] += w * x.w;
            }
        }
    }
#pragma unroll
    for (int v = 0; v < kVecsPerLane; ++v) {
        store_out4(out, nullptr, out_base + (v * 32 + lane) * kVec, false, acc[4 * v],
                   acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
    }
    if (lane == 0) lse[lse_index(req, row, shape)] = lse_total;
}
