// Split-KV combine: merges the float32 partials (O/L, lse) of every request that was split by
// log-sum-exp weighting (decode_common.cuh: the same operations as the decode kernels' folded
// merge), and writes out = 0, lse = +inf for requests with no keys at all. Requests with exactly
// one split were written directly by the decode kernel and are skipped, and with `folded` the
// split ones too (the decode kernel merged them).
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
                __nv_bfloat16* out, float* lse, int h_q, int s_q, int folded) {
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
    // one split: written by the decode kernel; `folded`: so were the split requests (the decode
    // kernel merged them, decode_common.cuh fold_split), only requests without keys are left
    if (count == 1 || (folded && count > 1)) return;
    const DecodeShape shape{h_q, s_q, 0};
    const long out_base = (static_cast<long>(req) * rows + row) * kDimV;
    auto split_lse = [&](int s) { return __ldcg(partial_lse + static_cast<long>(begin + s) * rows + row); };
    const float lse_total = merged_lse(count, split_lse);

    float4 acc[kVecsPerLane];
#pragma unroll
    for (int v = 0; v < kVecsPerLane; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < count; ++s) {
        const float w = split_weight(split_lse(s), lse_total);
        if (w < 0.f) continue;
        const float4* src = reinterpret_cast<const float4*>(partial_out + (static_cast<long>(begin + s) * rows + row) * kDimV);
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) fma4(acc[v], w, __ldcg(src + v * 32 + lane));
    }
#pragma unroll
    for (int v = 0; v < kVecsPerLane; ++v)
        store_out4(out, nullptr, out_base + (v * 32 + lane) * kVec, false, acc[v].x, acc[v].y, acc[v].z, acc[v].w);
    if (lane == 0) lse[lse_index(req, row, shape)] = lse_total;
}
