// Token preparation kernels (SPEC section 3): fused Q-quant, fused K-append into the paged
// 656-byte cache, and fetch-dequant of cached tokens back to dense bf16 [tokens, 576].
//
// These are memory-bound streaming kernels. Work unit: one warp per token row, with
// PREP_ROWS_PER_WARP rows loaded before any is processed (more bytes in flight per warp), a
// grid-stride loop over row groups so any grid size covers any n, 16-byte loads of bf16 rows,
// 8- or 16-byte stores, every warp-wide access fully coalesced (lane maps in common/quant.cuh
// and below). Nothing here is Hopper-only: the file also compiles for sm_89.
//
// Bytes written by the quantizers equal snapmla_cli.numerics.quant.quantize_rows /
// snapmla_cli.cache.layout.pack_tokens; dequantized rows equal
// `QuantizedRows.dequantize(float32).to(bfloat16)` (float32 multiply, then RNE to bf16).

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "common/quant.cuh"
#include "common/types.cuh"

#ifndef PREP_WARPS_PER_CTA
#define PREP_WARPS_PER_CTA 8  // 256 threads: small CTAs keep the tail of a launch short
#endif
#ifndef PREP_ROWS_PER_WARP
#define PREP_ROWS_PER_WARP 2  // rows a warp loads before it processes any of them
#endif

namespace snapmla {
namespace prep {

constexpr int WARPS_PER_CTA = PREP_WARPS_PER_CTA;
constexpr int ROWS_PER_WARP = PREP_ROWS_PER_WARP;
constexpr int THREADS = WARPS_PER_CTA * WARP_SIZE;
static_assert(WARPS_PER_CTA >= 1 && THREADS <= 1024, "CTA size");
static_assert(ROWS_PER_WARP >= 1 && ROWS_PER_WARP <= 8, "rows per warp");

// Dequant lane map of one 656-byte token (and of its SoA equivalent):
//   content: lane l owns E4M3 bytes [8l, 8l+8) and [256+8l, 256+8l+8) (two coalesced 8-byte
//            loads) and writes bf16 elements at the same offsets (two coalesced 16-byte stores);
//   rope:    lanes 0..7 own bf16 elements [8l, 8l+8): one 16-byte load, one 16-byte store.
constexpr int DQ_CONTENT_PER_CHUNK = 8;
constexpr int DQ_HALF = D_CONTENT / 2;
constexpr int DQ_ROPE_PER_LANE = 8;
constexpr int DQ_ROPE_LANES = D_ROPE / DQ_ROPE_PER_LANE;
static_assert(DQ_HALF == WARP_SIZE * DQ_CONTENT_PER_CHUNK, "32 lanes x 8 bytes cover half");

struct WarpCoords {
    i64 first_group;  // this warp's first row group
    i64 group_stride; // row groups between two iterations of one warp
    int lane;
};

__device__ __forceinline__ WarpCoords warp_coords() {
    WarpCoords w;
    w.lane = lane_id();
    w.first_group = static_cast<i64>(blockIdx.x) * WARPS_PER_CTA + (threadIdx.x / WARP_SIZE);
    w.group_stride = static_cast<i64>(gridDim.x) * WARPS_PER_CTA;
    return w;
}

// One lane's share of one cached token, ready to be dequantized. A token that must not be read
// (invalid slot, past the end) is all zeros with scale 0, so it dequantizes to +0.0 bf16.
struct TokenFp8 {
    uint2 c0;
    uint2 c1;
    uint4 r;
    float scale;
};

__device__ __forceinline__ TokenFp8 zero_token() {
    TokenFp8 t;
    t.c0 = make_uint2(0u, 0u);
    t.c1 = make_uint2(0u, 0u);
    t.r = make_uint4(0u, 0u, 0u, 0u);
    t.scale = 0.0f;
    return t;
}

__device__ __forceinline__ TokenFp8 load_token(const u8* content, const float* scale,
                                               const __nv_bfloat16* rope, int lane) {
    TokenFp8 t;
    t.c0 = ldg_nc_v2(content + DQ_CONTENT_PER_CHUNK * lane);
    t.c1 = ldg_nc_v2(content + DQ_HALF + DQ_CONTENT_PER_CHUNK * lane);
    t.scale = __uint_as_float(ldg_nc_u32(scale));
    t.r = make_uint4(0u, 0u, 0u, 0u);
    if (lane < DQ_ROPE_LANES) t.r = ldg_nc_v4(rope + DQ_ROPE_PER_LANE * lane);
    return t;
}

__device__ __forceinline__ TokenFp8 load_paged_token(const u8* cache, i64 slot, int lane) {
    const u8* token = cache + slot * FP8_TOKEN_BYTES;
    return load_token(token + CONTENT_OFFSET, reinterpret_cast<const float*>(token + SCALE_OFFSET),
                      reinterpret_cast<const __nv_bfloat16*>(token + ROPE_OFFSET), lane);
}

// 8 E4M3 bytes * s -> 8 bf16 (float32 multiply, then RNE).
__device__ __forceinline__ uint4 dequant8(const uint2& v, float s) {
    float x[8];
    e4m3x4_to_f32(v.x, x);
    e4m3x4_to_f32(v.y, x + 4);
    return make_uint4(f32x2_to_bf16x2_rn(__fmul_rn(x[0], s), __fmul_rn(x[1], s)),
                      f32x2_to_bf16x2_rn(__fmul_rn(x[2], s), __fmul_rn(x[3], s)),
                      f32x2_to_bf16x2_rn(__fmul_rn(x[4], s), __fmul_rn(x[5], s)),
                      f32x2_to_bf16x2_rn(__fmul_rn(x[6], s), __fmul_rn(x[7], s)));
}

// 8 bf16 * s -> 8 bf16 (float32 multiply, then RNE).
__device__ __forceinline__ uint4 rescale8_bf16(const uint4& v, float s) {
    float x[8];
    bf16x8_to_f32(v, x);
    return make_uint4(f32x2_to_bf16x2_rn(__fmul_rn(x[0], s), __fmul_rn(x[1], s)),
                      f32x2_to_bf16x2_rn(__fmul_rn(x[2], s), __fmul_rn(x[3], s)),
                      f32x2_to_bf16x2_rn(__fmul_rn(x[4], s), __fmul_rn(x[5], s)),
                      f32x2_to_bf16x2_rn(__fmul_rn(x[6], s), __fmul_rn(x[7], s)));
}

__device__ __forceinline__ void store_dequant(const TokenFp8& t, __nv_bfloat16* out_row, int lane) {
    stg_v4(out_row + DQ_CONTENT_PER_CHUNK * lane, dequant8(t.c0, t.scale));
    stg_v4(out_row + DQ_HALF + DQ_CONTENT_PER_CHUNK * lane, dequant8(t.c1, t.scale));
    if (lane < DQ_ROPE_LANES) {
        stg_v4(out_row + D_CONTENT + DQ_ROPE_PER_LANE * lane, rescale8_bf16(t.r, t.scale));
    }
}

// A slot is usable when 0 <= slot < num_slots; anything else (-1 padding, garbage) is skipped.
__device__ __forceinline__ bool slot_ok(i64 slot, i64 num_slots) {
    return slot >= 0 && slot < num_slots;
}

// Global token index t of the concatenated output -> cache slot, or -1 when t is past the last
// request's tokens or the block table points outside the cache. cu_seqlens[0] == 0 and
// cu_seqlens[i+1] - cu_seqlens[i] = tokens of request i; a binary search over the b+1 offsets
// (uniform across the warp: every lane loads the same words) finds the request.
__device__ __forceinline__ i64 paged_slot(i64 t, const i32* cu_seqlens, int batch,
                                          const i32* block_table, int max_blocks, i64 num_slots) {
    if (t >= static_cast<i64>(ldg_nc_i32(cu_seqlens + batch))) return -1;
    int lo = 0, hi = batch;  // invariant: cu[lo] <= t < cu[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (static_cast<i64>(ldg_nc_i32(cu_seqlens + mid)) <= t) lo = mid; else hi = mid;
    }
    const i64 j = t - ldg_nc_i32(cu_seqlens + lo);
    const i64 block = j / PAGE_SIZE;
    if (block >= max_blocks) return -1;
    const i64 page = ldg_nc_i32(block_table + static_cast<i64>(lo) * max_blocks + block);
    const i64 slot = page * PAGE_SIZE + (j % PAGE_SIZE);
    return (page >= 0 && slot < num_slots) ? slot : -1;
}

}  // namespace prep
}  // namespace snapmla

using namespace snapmla;
using namespace snapmla::prep;

// (a) Q-quant: q bf16 [rows, 576] -> content E4M3 [rows, 512], scale f32 [rows],
//     pre-scaled rope bf16 [rows, 64].
extern "C" __global__ void __launch_bounds__(prep::THREADS)
snapmla_quantize_q(const __nv_bfloat16* __restrict__ q, u8* __restrict__ content,
                   float* __restrict__ scale, __nv_bfloat16* __restrict__ rope, i64 rows) {
    const WarpCoords w = warp_coords();
    for (i64 group = w.first_group; group * ROWS_PER_WARP < rows; group += w.group_stride) {
        const i64 base = group * ROWS_PER_WARP;
        RowBf16 in[ROWS_PER_WARP];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            if (base + r < rows) in[r] = load_row_bf16(q + (base + r) * D_QK, w.lane);
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const i64 row = base + r;
            if (row >= rows) break;  // warp-uniform
            const RowFp8 o = quantize_row(in[r]);
            u8* c = content + row * D_CONTENT;
            stg_v2(c + QROW_ELEMS_PER_CHUNK * w.lane, o.c0);
            stg_v2(c + QROW_HALF + QROW_ELEMS_PER_CHUNK * w.lane, o.c1);
            if (w.lane == 0) stg_u32(scale + row, __float_as_uint(o.scale));
            if (w.lane < QROW_ROPE_LANES) {
                stg_v2(rope + row * D_ROPE + QROW_ROPE_PER_LANE * w.lane, o.r);
            }
        }
    }
}

// (b) K-append: kv bf16 [n, 576] + slots int32 [n] -> 656-byte tokens of the paged cache
//     uint8 [num_slots, 656] (num_slots = num_blocks * 64). Slots outside [0, num_slots) are
//     skipped: nothing is written for them. Duplicate slots race (one of the rows wins).
extern "C" __global__ void __launch_bounds__(prep::THREADS)
snapmla_append_kv(const __nv_bfloat16* __restrict__ kv, const i32* __restrict__ slots, i64 n,
                  u8* __restrict__ cache, i64 num_slots) {
    const WarpCoords w = warp_coords();
    for (i64 group = w.first_group; group * ROWS_PER_WARP < n; group += w.group_stride) {
        const i64 base = group * ROWS_PER_WARP;
        RowBf16 in[ROWS_PER_WARP];
        i64 slot[ROWS_PER_WARP];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            slot[r] = -1;
            if (base + r < n) {
                slot[r] = ldg_nc_i32(slots + base + r);
                in[r] = load_row_bf16(kv + (base + r) * D_QK, w.lane);
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            if (!slot_ok(slot[r], num_slots)) continue;  // warp-uniform
            const RowFp8 o = quantize_row(in[r]);
            u8* token = cache + slot[r] * FP8_TOKEN_BYTES;
            stg_v2(token + CONTENT_OFFSET + QROW_ELEMS_PER_CHUNK * w.lane, o.c0);
            stg_v2(token + CONTENT_OFFSET + QROW_HALF + QROW_ELEMS_PER_CHUNK * w.lane, o.c1);
            // scale + 12 zero pad bytes: one 16-byte chunk at offset 512
            if (w.lane == 0) {
                stg_v4(token + SCALE_OFFSET, make_uint4(__float_as_uint(o.scale), 0u, 0u, 0u));
            }
            if (w.lane < QROW_ROPE_LANES) {
                stg_v2(token + ROPE_OFFSET + 2 * QROW_ROPE_PER_LANE * w.lane, o.r);
            }
        }
    }
}

// (c) fetch-dequant, paged: request i's tokens 0..n_i-1 (through block_table int32
//     [batch, max_blocks]) -> out bf16 [total_tokens, 576] at rows cu_seqlens[i] ..
//     cu_seqlens[i+1]-1. Rows past cu_seqlens[batch], and rows whose block-table entry points
//     outside the cache, are written as zeros.
extern "C" __global__ void __launch_bounds__(prep::THREADS)
snapmla_fetch_dequant_paged(const u8* __restrict__ cache, i64 num_slots,
                            const i32* __restrict__ block_table, int max_blocks,
                            const i32* __restrict__ cu_seqlens, int batch,
                            __nv_bfloat16* __restrict__ out, i64 total_tokens) {
    const WarpCoords w = warp_coords();
    for (i64 group = w.first_group; group * ROWS_PER_WARP < total_tokens;
         group += w.group_stride) {
        const i64 base = group * ROWS_PER_WARP;
        TokenFp8 tok[ROWS_PER_WARP];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            tok[r] = zero_token();
            if (base + r >= total_tokens) continue;
            const i64 slot =
                paged_slot(base + r, cu_seqlens, batch, block_table, max_blocks, num_slots);
            if (slot >= 0) tok[r] = load_paged_token(cache, slot, w.lane);
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            if (base + r >= total_tokens) break;
            store_dequant(tok[r], out + (base + r) * D_QK, w.lane);
        }
    }
}

// (c') fetch-dequant from a slot list: out[i] = dequant(cache[slots[i]]); invalid slot -> zeros.
extern "C" __global__ void __launch_bounds__(prep::THREADS)
snapmla_fetch_dequant_slots(const u8* __restrict__ cache, i64 num_slots,
                            const i32* __restrict__ slots, i64 n, __nv_bfloat16* __restrict__ out) {
    const WarpCoords w = warp_coords();
    for (i64 group = w.first_group; group * ROWS_PER_WARP < n; group += w.group_stride) {
        const i64 base = group * ROWS_PER_WARP;
        TokenFp8 tok[ROWS_PER_WARP];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            tok[r] = zero_token();
            if (base + r >= n) continue;
            const i64 slot = ldg_nc_i32(slots + base + r);
            if (slot_ok(slot, num_slots)) tok[r] = load_paged_token(cache, slot, w.lane);
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            if (base + r >= n) break;
            store_dequant(tok[r], out + (base + r) * D_QK, w.lane);
        }
    }
}

// (d) fetch-dequant from the structure-of-arrays cache of SGLang-FluentLLM: content uint8
//     [num_slots, 512], scale f32 [num_slots], rope bf16 [num_slots, 64]; invalid slot -> zeros.
extern "C" __global__ void __launch_bounds__(prep::THREADS)
snapmla_fetch_dequant_soa(const u8* __restrict__ content, const float* __restrict__ scale,
                          const __nv_bfloat16* __restrict__ rope, i64 num_slots,
                          const i32* __restrict__ slots, i64 n, __nv_bfloat16* __restrict__ out) {
    const WarpCoords w = warp_coords();
    for (i64 group = w.first_group; group * ROWS_PER_WARP < n; group += w.group_stride) {
        const i64 base = group * ROWS_PER_WARP;
        TokenFp8 tok[ROWS_PER_WARP];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            tok[r] = zero_token();
            if (base + r >= n) continue;
            const i64 slot = ldg_nc_i32(slots + base + r);
            if (slot_ok(slot, num_slots)) {
                tok[r] = load_token(content + slot * D_CONTENT, scale + slot, rope + slot * D_ROPE,
                                    w.lane);
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            if (base + r >= n) break;
            store_dequant(tok[r], out + (base + r) * D_QK, w.lane);
        }
    }
}
