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
// empty one; the others give it the one item at flat index y (an empty item costs such a CTA
// its Q load and a scratch write, and keeps those kernels' code as it was).
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

}  // namespace snapmla
