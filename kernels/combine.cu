// Split-KV combine: merges the float32 partials (O/L, lse) of every request that was split by
// log-sum-exp weighting (decode_common.cuh merge_split_rows: the same operations as the decode
// kernels' folded merge), and writes out = 0, lse = +inf for requests with no keys at all.
// Requests with exactly one split were written directly by the decode kernel and are skipped,
// and so are those of 2 .. `folded_up_to` splits (the decode kernel merged them).
//
// A CTA merges COMBINE_ROWS rows of one request, all of its threads on one row at a time when
// COMBINE_ROWS is 1 (small batches cut into many splits: the loads of 16 splits in flight per
// thread, and one CTA per row spreads a request over the GPU), a warp per row when it is 4.
#include "decode_common.cuh"

#ifndef COMBINE_ROWS
#define COMBINE_ROWS 4  // query rows per CTA
#endif

namespace snapmla {
namespace combine {
constexpr int kThreads = 128;
// splits of a request whose weights the CTA keeps in shared memory (ops/split_fold.py
// MAX_SPLITS_PER_REQUEST: the planner never cuts a request finer)
constexpr int kMaxSplits = 512;
constexpr int kFloat4PerRow = kDimV / 4;
constexpr int kVecs = kFloat4PerRow / (kThreads / COMBINE_ROWS);  // float4 per thread and row
constexpr int kLoadsInFlight = 16;                                // float4 loads per thread at once
constexpr int kSplitsAtOnce = kLoadsInFlight / kVecs;
static_assert(COMBINE_ROWS == 1 || COMBINE_ROWS == 4, "one row per CTA, or one per warp");
}  // namespace combine
}  // namespace snapmla

// (min blocks 1: with the default occupancy target ptxas interleaved the 16 loads with the FMAs
// two at a time; a request of many splits has few CTAs, so its loads must be in flight at once)
extern "C" __global__ void __launch_bounds__(snapmla::combine::kThreads, 1)
snapmla_combine(const float* partial_out, const float* partial_lse, const int* num_splits,
                __nv_bfloat16* out, float* lse, int h_q, int s_q, int folded_up_to) {
    using namespace snapmla;
    using namespace snapmla::combine;
    __shared__ float weights[COMBINE_ROWS * kMaxSplits];
    __shared__ float totals[COMBINE_ROWS];
    // launched programmatically (runtime/pdl.py): the decode grid may still be running
    wait_for_predecessor();
    const int req = blockIdx.x;
    const int rows = h_q * s_q;
    const int row0 = blockIdx.y * COMBINE_ROWS;
    const int begin = num_splits[req];
    const int count = num_splits[req + 1] - begin;
    // one split: written by the decode kernel, and so were the requests it folded
    if (count == 1 || (count > 1 && count <= folded_up_to)) return;
    const MergeTarget target{partial_out, partial_lse, out, lse, DecodeShape{h_q, s_q, 0}, req, begin, count};
    merge_split_rows<kThreads, COMBINE_ROWS, kSplitsAtOnce, kMaxSplits>(
        target, row0, min(COMBINE_ROWS, rows - row0), threadIdx.x, weights, totals, [] { __syncthreads(); });
}
