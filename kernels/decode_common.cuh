// Pieces shared by the FP8 and BF16 split-KV decode kernels: the work-list entry written by
// get_mla_metadata, row bookkeeping (row = token * h_q + head), visibility (SPEC section 2),
// and the epilogue that writes either the final bf16 output or a float32 split partial.
#pragma once

#include "common/ptx.cuh"

// NVRTC has no <cmath>: +inf as a bit pattern.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace snapmla {

constexpr int kPageTokens = PAGE_SIZE;  // tokens per page == tokens per KV block
constexpr int kDimV = D_V;              // output width
constexpr int kRowsPerGroup = 16;      // MMA M: query rows per row group
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;


// One piece of work: request, its KV blocks [block_begin, block_end) and the partial slot (-1:
// the request has a single split, write the final output directly). The work list is
// [columns x items_per_column], a column's items first to last; an unused place holds an empty
// item (no blocks, request 0) whose partial slot nobody reads. A kernel that runs columns
// (COLUMN_ITEMS) gives CTA row y the items y * items_per_column + k in turn, up to the first
// empty one; the others give it the one item at flat index y (an empty item: the wgmma kernels'
// CTA returns at once, roles::run_column; the mma.sync kernels' loads its Q and writes the
// scratch slot).
struct WorkItem {
    int request;
    int block_begin;
    int block_end;
    int partial;
};

struct DecodeShape {
    int h_q;
    int s_q;
    int causal;
};

// Number of cache tokens query row `row` sees (SPEC section 2); 0 for padding rows.
__device__ __forceinline__ int visible_keys(int row, int rows, int seqlen, DecodeShape shape) {
    if (row >= rows) return 0;
    if (!shape.causal) return seqlen;
    const int token = row / shape.h_q;
    const int v = seqlen - shape.s_q + token + 1;
    return v < 0 ? 0 : (v > seqlen ? seqlen : v);
}

// lse index in [b, h_q, s_q] for (request, row).
__device__ __forceinline__ long lse_index(int request, int row, DecodeShape shape) {
    const int token = row / shape.h_q, head = row % shape.h_q;
    return (static_cast<long>(request) * shape.h_q + head) * shape.s_q + token;
}

// Store 4 consecutive output values of one row: final bf16 or float32 partial.
__device__ __forceinline__ void store_out4(__nv_bfloat16* out, float* partial_out, long offset,
                                           bool to_partial, float v0, float v1, float v2, float v3) {
    if (to_partial) {
        *reinterpret_cast<float4*>(partial_out + offset) = make_float4(v0, v1, v2, v3);
    } else {
        __nv_bfloat162 lo = __floats2bfloat162_rn(v0, v1), hi = __floats2bfloat162_rn(v2, v3);
        uint2 packed;
        packed.x = *reinterpret_cast<unsigned*>(&lo);
        packed.y = *reinterpret_cast<unsigned*>(&hi);
        *reinterpret_cast<uint2*>(out + offset) = packed;
    }
}

// Store 2 consecutive output values of one row (the wgmma kernel's O^T fragment).
__device__ __forceinline__ void store_out2(__nv_bfloat16* out, float* partial_out, long offset,
                                           bool to_partial, float v0, float v1) {
    if (to_partial) {
        *reinterpret_cast<float2*>(partial_out + offset) = make_float2(v0, v1);
    } else {
        *reinterpret_cast<__nv_bfloat162*>(out + offset) = __floats2bfloat162_rn(v0, v1);
    }
}


// ---- Merging a split request's partials (combine.cu, and the wgmma kernels' folded merge) ----
// Both merge in the same float32 operations, so that a merge folded into the decode kernel gives
// the separate combine's bits: the lse over the splits in split order, then per output value the
// splits' partials weighted by exp(lse_s - lse), one fma per split in split order, a split whose
// lse is -inf (it saw no key of the row) skipped.

// lse of one row over its `count` splits, `split_lse(s)` the lse of split s: m + log(sum of
// exp(lse_s - m)) with m the largest; +inf when no split saw a key.
template <class SplitLse>
__device__ __forceinline__ float merged_lse(int count, SplitLse split_lse) {
    float m = -INFINITY;
#pragma unroll 4
    for (int s = 0; s < count; ++s) m = fmaxf(m, split_lse(s));
    if (m == -INFINITY) return INFINITY;
    float total = 0.f;
#pragma unroll 4
    for (int s = 0; s < count; ++s) total += expf(split_lse(s) - m);
    return m + logf(total);
}

// The weight of a split's partial in the merged row; negative (skip it) when the split saw no key.
__device__ __forceinline__ float split_weight(float split_lse, float lse_total) {
    return split_lse == -INFINITY ? -1.f : expf(split_lse - lse_total);
}

__device__ __forceinline__ void fma4(float4& acc, float w, const float4& x) {
    acc.x = fmaf(w, x.x, acc.x);
    acc.y = fmaf(w, x.y, acc.y);
    acc.z = fmaf(w, x.z, acc.z);
    acc.w = fmaf(w, x.w, acc.w);
}

// Where a merge reads and writes: the partials of `count` splits from slot `begin` on (float32
// [slot, rows, 512] and [slot, rows]), the request's final rows.
struct MergeTarget {
    const float* partial_out;
    const float* partial_lse;
    __nv_bfloat16* out;
    float* lse;
    DecodeShape shape;
    int req;
    int begin;
    int count;
};

// The output rows of a merge: the request's bf16 rows and lse.
struct MergeOut {
    __nv_bfloat16* out;
    float* lse;
    DecodeShape shape;
    int req;
};

// Merges float4 columns [vec0, vec0 + kRowVecs) of rows [row0, row0 + n_rows) of a request (out 0,
// lse +inf when no split saw a key) over its `count` splits with kThreads threads (this one `tid`):
// the splits' lse (`split_lse(s, r)`, r = row - row0) in parallel into `weights` (shared memory,
// kWeightStride floats per row), each row's merged lse by one thread into `totals` (n_rows floats;
// written to `o.lse` when `store_lse`), the weights in parallel, then kPassRows rows at a time,
// kThreads / kPassRows threads per row, kSplitsAtOnce splits' loads (`split_vec(s, r, j)`: float4
// vec0 + j of the split's row) in flight. `sync` is a barrier over the kThreads threads; the
// shared memory is free again after the call. Where the partials come from is the caller's: the
// global partial buffers (merge_split_rows) or the cluster's shared memory (cluster_fold); the
// operations are the same, so are the bits.
template <int kThreads, int kPassRows, int kSplitsAtOnce, int kWeightStride, int kRowVecs, class SplitLse,
          class SplitVec, class Sync>
__device__ __forceinline__ void merge_rows(const MergeOut& o, int count, int row0, int n_rows, int vec0,
                                           bool store_lse, int tid, float* weights, float* totals,
                                           SplitLse split_lse, SplitVec split_vec, Sync sync) {
    constexpr int kThreadsPerRow = kThreads / kPassRows;
    static_assert(kThreads % kPassRows == 0 && kRowVecs % kThreadsPerRow == 0, "a pass's rows split evenly");
    constexpr int kVecs = kRowVecs / kThreadsPerRow;  // float4 per thread and row
    const int rows = o.shape.h_q * o.shape.s_q;
    for (int i = tid; i < n_rows * count; i += kThreads) {
        const int r = i / count, s = i - r * count;
        weights[r * kWeightStride + s] = split_lse(s, r);
    }
    sync();
    if (tid < n_rows) {
        const float* w = weights + tid * kWeightStride;
        totals[tid] = merged_lse(count, [&](int s) { return w[s]; });
        if (store_lse) o.lse[lse_index(o.req, row0 + tid, o.shape)] = totals[tid];
    }
    sync();
    for (int i = tid; i < n_rows * count; i += kThreads) {
        const int r = i / count, s = i - r * count;
        weights[r * kWeightStride + s] = split_weight(weights[r * kWeightStride + s], totals[r]);
    }
    sync();
    const int q = tid % kThreadsPerRow;  // float4 columns vec0 + q + kThreadsPerRow v of its row
#pragma unroll 1
    for (int r = tid / kThreadsPerRow; r < n_rows; r += kPassRows) {
        const float* w = weights + r * kWeightStride;
        float4 acc[kVecs];
#pragma unroll
        for (int v = 0; v < kVecs; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
        for (int s0 = 0; s0 < count; s0 += kSplitsAtOnce) {
            float4 x[kSplitsAtOnce][kVecs];
#pragma unroll
            for (int k = 0; k < kSplitsAtOnce; ++k) {
                const int s = min(s0 + k, count - 1);  // (a repeated load past the last split)
#pragma unroll
                for (int v = 0; v < kVecs; ++v) x[k][v] = split_vec(s, r, q + kThreadsPerRow * v);
            }
#pragma unroll
            for (int k = 0; k < kSplitsAtOnce; ++k) {
                const float wk = s0 + k < count ? w[s0 + k] : -1.f;
                if (wk < 0.f) continue;
#pragma unroll
                for (int v = 0; v < kVecs; ++v) fma4(acc[v], wk, x[k][v]);
            }
        }
        const long base = (static_cast<long>(o.req) * rows + row0 + r) * kDimV + 4 * vec0;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
            const long at = base + 4 * (q + kThreadsPerRow * v);
            store_out4(o.out, nullptr, at, false, acc[v].x, acc[v].y, acc[v].z, acc[v].w);
        }
    }
    sync();  // the weights are read before the caller reuses the shared memory
}

// merge_rows over whole rows, the partials read from the global partial buffers of MergeTarget.
template <int kThreads, int kPassRows, int kSplitsAtOnce, int kWeightStride, class Sync>
__device__ __forceinline__ void merge_split_rows(const MergeTarget& t, int row0, int n_rows, int tid, float* weights,
                                                 float* totals, Sync sync) {
    const long rows = t.shape.h_q * t.shape.s_q;
    // L2 reads (__ldcg): another CTA wrote the partials, an L1 line could be stale
    auto split_lse = [&](int s, int r) { return __ldcg(t.partial_lse + (t.begin + s) * rows + row0 + r); };
    auto split_vec = [&](int s, int r, int j) {
        return __ldcg(reinterpret_cast<const float4*>(t.partial_out + ((t.begin + s) * rows + row0 + r) * kDimV) + j);
    };
    merge_rows<kThreads, kPassRows, kSplitsAtOnce, kWeightStride, kDimV / 4>(
        MergeOut{t.out, t.lse, t.shape, t.req}, t.count, row0, n_rows, 0, true, tid, weights, totals, split_lse,
        split_vec, sync);
}

// The folded merge's shared-memory weights: a row tile's splits, so at most this many splits
// per request (the host folds only plans within it).
constexpr int kMaxFoldedSplits = 64;
constexpr int kFoldPassRows = 16;  // rows merged at once: 16 threads per row for 256 threads
constexpr int kFoldSplitsAtOnce = 2;  // splits whose loads are in flight together
// floats of the fold's shared scratch for a row tile of `rows`: weights, totals, the flag
__host__ __device__ constexpr int fold_scratch_floats(int rows) { return rows * (kMaxFoldedSplits + 1) + 1; }

// The split merge folded into the decode kernel: the CTA that stores the last split of a request
// (per row tile; arrivals counted in `arrivals[request * row tiles + row tile]`) merges them and
// resets the counter, instead of a combine kernel after the grid, whose launch and wait for the
// whole grid cost 4-10 us a call (the fold gets back 1-2.5 us at 16-64 rows, docs/PERF.md).
// `arrivals` is nullptr when the combine merges (metadata without a fold, the mma.sync kernels).
// One CTA reads all the partials of its row tile, so requests of more than `max_splits` splits
// are left to the combine kernel, which spreads them over many CTAs (ops/split_fold.py).
struct SplitFold {
    const int* num_splits;  // [b + 1] cumulative split counts (get_mla_metadata)
    int* arrivals;          // [b x row tiles], zero between launches
    int max_splits;         // requests of 2 .. max_splits splits are merged here
};

// Called by all kThreadsN consumer threads (thread `tid`, barrier `barrier`) after they stored
// their split's partial rows [row0, row0 + kTileRows) of request `req`. `scratch`: shared memory
// for fold_scratch_floats(kTileRows) floats, unused until the caller's next barrier.
template <int kThreadsN, int kTileRows>
__device__ __forceinline__ void fold_split(const SplitFold& fold, int req, int row0, int rows, const float* partial_out,
                                           const float* partial_lse, __nv_bfloat16* out, float* lse,
                                           DecodeShape shape, int tid, int barrier, float* scratch) {
    const int begin = __ldg(fold.num_splits + req), count = __ldg(fold.num_splits + req + 1) - begin;
    if (count > fold.max_splits) return;  // the combine kernel merges this request (CTA-uniform)
    float* totals = scratch + kTileRows * kMaxFoldedSplits;
    int* last_s = reinterpret_cast<int*>(totals + kTileRows);
    __threadfence();  // this thread's partial stores, GPU-wide, before the arrival below
    named_barrier_sync(barrier, kThreadsN);
    if (tid == 0) {
        int* arrived = fold.arrivals + static_cast<long>(req) * gridDim.x + blockIdx.x;
        const bool last = atomicAdd(arrived, 1) == count - 1;
        if (last) *arrived = 0;  // every split is in: zero for the next launch
        *last_s = last;
    }
    named_barrier_sync(barrier, kThreadsN);
    const bool merges = *last_s;
    named_barrier_sync(barrier, kThreadsN);  // every thread read the flag before `scratch` is reused
    if (!merges) return;
    __threadfence();  // the other splits' partials: read after their arrivals
    const MergeTarget target{partial_out, partial_lse, out, lse, shape, req, begin, count};
    merge_split_rows<kThreadsN, kFoldPassRows, kFoldSplitsAtOnce, kMaxFoldedSplits>(
        target, row0, min(kTileRows, rows - row0), tid, scratch, totals,
        [&]() { named_barrier_sync(barrier, kThreadsN); });
}

// ---- The split merge of a cluster: a request's splits launched as one thread-block cluster ----
// (ops/cluster_fold.py). Each split keeps its partial rows in its own shared memory (the stages are
// free after the page loop) instead of the global partial buffers, the cluster syncs once, and
// CTA `rank` of `n` merges float4 columns [rank, rank + 1) x 128 / n of every row of the tile,
// reading the n splits' rows from their CTAs' shared memory (split s is rank s). No partial goes
// through L2, no CTA waits for an arrival counter, and the merge is spread over the n CTAs
// instead of done by the last one. A second sync keeps every CTA's shared memory alive until the
// others have read it.
// A partial row's stride in floats: the FP8 epilogue's O^T stores put rows 2c (c = 0..3, a
// lane's quad index) 2 x 520 floats apart, 16 banks, so a warp's 8-byte stores take the two
// wavefronts they need (with 512 the four row pairs would share 16 banks: four); the BF16
// epilogue's rows g (g = 0..7) fall 8 banks apart, two wavefronts as well.
constexpr int kClusterRowStride = kDimV + 8;
constexpr int kMaxClusterSplits = 8;  // the portable cluster size
__host__ __device__ constexpr int cluster_partial_bytes(int rows) { return rows * (kClusterRowStride + 1) * 4; }

// Merges float4 columns [rank, rank + 1) x kRowVecs of the tile's rows from the cluster's
// splits (split s in CTA rank s), the partial rows at shared-memory address `part_addr` in each.
template <int kThreadsN, int kTileRows, int kRowVecs, class Sync>
__device__ __forceinline__ void merge_cluster_slice(unsigned part_addr, int n, int rank, const MergeOut& target,
                                                    int row0, int n_rows, int tid, float* scratch, Sync sync) {
    const unsigned lse_addr = part_addr + kTileRows * kClusterRowStride * 4;
    const int vec0 = rank * kRowVecs;
    auto split_lse = [&](int s, int r) { return ld_shared_cluster_f32(map_shared_rank(lse_addr + 4 * r, s)); };
    auto split_vec = [&](int s, int r, int j) {
        return ld_shared_cluster_v4(map_shared_rank(part_addr + 4 * (r * kClusterRowStride + 4 * (vec0 + j)), s));
    };
    merge_rows<kThreadsN, kFoldPassRows, kFoldSplitsAtOnce, kMaxFoldedSplits, kRowVecs>(
        target, n, row0, n_rows, vec0, rank == 0, tid, scratch, scratch + kTileRows * kMaxFoldedSplits, split_lse,
        split_vec, sync);
}

// Called by all kThreadsN consumer threads (thread `tid`, barrier `barrier`) after they stored
// their split's rows [row0, row0 + kTileRows) at `partial` (shared memory: rows of
// kClusterRowStride floats, then the rows' lse). `scratch`: shared memory for
// fold_scratch_floats(kTileRows) floats. Every CTA of the cluster must call it.
template <int kThreadsN, int kTileRows>
__device__ __forceinline__ void cluster_fold(const float* partial, int n, int rank, int req, int row0, int rows,
                                            __nv_bfloat16* out, float* lse, DecodeShape shape, int tid, int barrier,
                                            float* scratch) {
    constexpr int kVecsPerRow = kDimV / 4;
    const unsigned part_addr = smem_addr(partial);
    const MergeOut target{out, lse, shape, req};
    const int n_rows = min(kTileRows, rows - row0);
    auto sync = [&]() { named_barrier_sync(barrier, kThreadsN); };
    __syncwarp();
    cluster_sync();  // every split's rows are in its shared memory
    if (n == 2)
        merge_cluster_slice<kThreadsN, kTileRows, kVecsPerRow / 2>(part_addr, n, rank, target, row0, n_rows, tid,
                                                                   scratch, sync);
    else if (n == 4)
        merge_cluster_slice<kThreadsN, kTileRows, kVecsPerRow / 4>(part_addr, n, rank, target, row0, n_rows, tid,
                                                                   scratch, sync);
    else if (n == kMaxClusterSplits)
        merge_cluster_slice<kThreadsN, kTileRows, kVecsPerRow / kMaxClusterSplits>(part_addr, n, rank, target, row0,
                                                                                   n_rows, tid, scratch, sync);
    else
        __trap();  // a launch without a cluster of 2, 4 or 8 (the host never makes one)
    __syncwarp();
    cluster_sync();  // the others have read this CTA's rows
}

}  // namespace snapmla
