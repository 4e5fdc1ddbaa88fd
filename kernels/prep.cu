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
// The slot-list dequant kernels need few registers: with up to 2 rows per warp, ask for full
// occupancy (2048 threads per SM, at most 32 registers a thread; ptxas fits them without spills),
// the most rows in flight per SM for these pure streaming kernels. (The paged kernel's request
// search needs a few more registers; more rows per warp would spill at 32.)
constexpr int DQ_MIN_CTAS = (ROWS_PER_WARP <= 2 && 2048 / THREADS > 0) ? 2048 / THREADS : 1;

// Dequant lane map of one 656-byte token (and of its SoA equivalent):
//   content: lane l owns E4M3 bytes [8l, 8l+8) and [256+8l, 256+8l+8) (two coalesced 8-byte
//            loads) and writes bf16 elements at the same offsets (two coalesced 16-byte stores);
//   rope:    lanes 0..7 own bf16 elements [8l, 8l+8): one 16-byte load, one 16-byte store.
constexpr int DQ_CONTENT_PER_CHUNK = 8;
constexpr int DQ_HALF = D_CONTENT / 2;
constexpr int DQ_ROPE_PER_LANE = 8;
constexpr int DQ_ROPE_LANES = D_ROPE / DQ_ROPE_PER_LANE;
static_assert(DQ_HALF == WARP_SIZE * DQ_CONTENT_PER_CHUNK, "32 lanes x 8 bytes cover half");

// K-append store map of one 656-byte token: every 32-byte sector inside the token is written
// whole by one store instruction (no partial-sector write for L2 to merge):
//   bytes 0..511:   the content, store_content() (common/quant.cuh): two 8-byte stores per lane
//                   (map 0) or one 16-byte store per lane (map 1);
//   bytes 512..655: 9 chunks of 16 bytes in one 16-byte store by lanes 0..8: lane 0 the scale +
//                   12 zero pad bytes, lane j = 1..8 RoPE elements [8(j-1), 8j), gathered with
//                   4 shuffles from lanes 4(j-1)..4(j-1)+3. Before, the scale chunk and the RoPE
//                   were two stores, both half-covering the sector [512, 544) of even slots.
// (Only the sector a token shares with its neighbour, 16 bytes at one end, stays partial:
// slot * 656 is 16 mod 32 for odd slots; no store shape can avoid that one.)
constexpr int TAIL_LANES = (FP8_TOKEN_BYTES - SCALE_OFFSET) / VEC_BYTES;  // 9
constexpr int ROPE_WORDS_PER_CHUNK = VEC_BYTES / 4;                       // 4 lanes' bf16x2 words
static_assert(TAIL_LANES == 9 && ROPE_OFFSET == SCALE_OFFSET + VEC_BYTES, "tail chunk layout");

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

// Slot indices come as int32 or int64 (vLLM's slot_mapping is int64): read either natively, so
// no conversion kernel runs on the host side.
__device__ __forceinline__ i64 load_slot(const i32* p) { return ldg_nc_i32(p); }
__device__ __forceinline__ i64 load_slot(const i64* p) { return ldg_nc_i64(p); }

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

// Writes one quantized row as a 656-byte token (store map above). All 32 lanes must call it
// (the RoPE gather shuffles).
__device__ __forceinline__ void store_token(u8* token, const RowFp8& o, int lane) {
    store_content(token + CONTENT_OFFSET, o, lane);
    const int src = (ROPE_WORDS_PER_CHUNK * (lane - 1)) & (WARP_SIZE - 1);
    const u32 w0 = __shfl_sync(FULL_MASK, o.r, src);
    const u32 w1 = __shfl_sync(FULL_MASK, o.r, src + 1);
    const u32 w2 = __shfl_sync(FULL_MASK, o.r, src + 2);
    const u32 w3 = __shfl_sync(FULL_MASK, o.r, src + 3);
    const uint4 tail = lane == 0 ? make_uint4(__float_as_uint(o.scale), 0u, 0u, 0u)
                                 : make_uint4(w0, w1, w2, w3);
    if (lane < TAIL_LANES) stg_v4(token + SCALE_OFFSET + VEC_BYTES * lane, tail);
}

// A slot is usable when 0 <= slot < num_slots; anything else (-1 padding, garbage) is skipped.
__device__ __forceinline__ bool slot_ok(i64 slot, i64 num_slots) {
    return slot >= 0 && slot < num_slots;
}

// The request holding global token t: the largest i in [0, batch) with cu[i] <= t, given
// cu[0] = 0 <= t < cu[batch] (cu non-decreasing; empty requests repeat a value, and "largest"
// skips them). A 32-ary search: each step, lane k tests the candidate lo + (k+1)*step with one
// coalesced load, and the ballot's popcount is how many candidates are <= t (a prefix, cu being
// sorted), so the interval shrinks 32-fold per dependent load (1 step for batch <= 32, 2 up to
// 1024) instead of 2-fold. Warp-uniform in t: all 32 lanes must call it.
__device__ __forceinline__ int find_request(i64 t, const i32* cu_seqlens, int batch, int lane) {
    int lo = 0, hi = batch;  // invariant: cu[lo] <= t < cu[hi]
    while (hi - lo > 1) {
        const int step = (hi - lo + WARP_SIZE - 1) / WARP_SIZE;
        const i64 idx = lo + static_cast<i64>(lane + 1) * step;
        const bool le = idx < hi && static_cast<i64>(ldg_nc_i32(cu_seqlens + idx)) <= t;
        const int k = __popc(__ballot_sync(FULL_MASK, le));
        lo += k * step;
        hi = min(hi, lo + step);
    }
    return lo;
}

// Cache slot of position j of request req, or -1 when the block table points outside the cache
// (or j is past the table's capacity).
__device__ __forceinline__ i64 paged_slot(int req, i64 j, const i32* block_table, int max_blocks,
                                          i64 num_slots) {
    const i64 block = j / PAGE_SIZE;
    if (block >= max_blocks) return -1;
    const i64 page = ldg_nc_i32(block_table + static_cast<i64>(req) * max_blocks + block);
    const i64 slot = page * PAGE_SIZE + (j % PAGE_SIZE);
    return (page >= 0 && slot < num_slots) ? slot : -1;
}

// ---- kernel bodies (templated on the slot index type) ----

template <typename SlotT>
__device__ __forceinline__ void append_kv_body(const __nv_bfloat16* __restrict__ kv,
                                               const SlotT* __restrict__ slots, i64 n,
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
                slot[r] = load_slot(slots + base + r);
                in[r] = load_row_bf16(kv + (base + r) * D_QK, w.lane);
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            if (!slot_ok(slot[r], num_slots)) continue;  // warp-uniform
            store_token(cache + slot[r] * FP8_TOKEN_BYTES, quantize_row(in[r]), w.lane);
        }
    }
}

// Gather + dequantize: row r of `out` is the token at slots[r] (zeros for an out-of-range slot).
// `load_at(slot, lane)` reads one token from whichever cache layout the caller has.
template <typename SlotT, typename LoadToken>
__device__ __forceinline__ void fetch_rows_body(i64 num_slots, const SlotT* __restrict__ slots,
                                                i64 n, __nv_bfloat16* __restrict__ out,
                                                LoadToken load_at) {
    const WarpCoords w = warp_coords();
    for (i64 group = w.first_group; group * ROWS_PER_WARP < n; group += w.group_stride) {
        const i64 base = group * ROWS_PER_WARP;
        TokenFp8 tok[ROWS_PER_WARP];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            tok[r] = zero_token();
            if (base + r >= n) continue;
            const i64 slot = load_slot(slots + base + r);
            if (slot_ok(slot, num_slots)) tok[r] = load_at(slot, w.lane);
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            if (base + r >= n) break;
            store_dequant(tok[r], out + (base + r) * D_QK, w.lane);
        }
    }
}

// Paged 656-byte cache.
template <typename SlotT>
__device__ __forceinline__ void fetch_slots_body(const u8* __restrict__ cache, i64 num_slots,
                                                 const SlotT* __restrict__ slots, i64 n,
                                                 __nv_bfloat16* __restrict__ out) {
    fetch_rows_body(num_slots, slots, n, out,
                    [&](i64 slot, int lane) { return load_paged_token(cache, slot, lane); });
}

// Structure-of-arrays cache (content, scale, rope in three tensors).
template <typename SlotT>
__device__ __forceinline__ void fetch_soa_body(const u8* __restrict__ content,
                                               const float* __restrict__ scale,
                                               const __nv_bfloat16* __restrict__ rope,
                                               i64 num_slots, const SlotT* __restrict__ slots,
                                               i64 n, __nv_bfloat16* __restrict__ out) {
    fetch_rows_body(num_slots, slots, n, out, [&](i64 slot, int lane) {
        return load_token(content + slot * D_CONTENT, scale + slot, rope + slot * D_ROPE, lane);
    });
}

}  // namespace prep
}  // namespace snapmla

using namespace snapmla;
using namespace snapmla::prep;

// (a) Q-quant: q bf16 [rows, 576] -> content E4M3 [rows, 512], scale f32 [rows],
//     pre-scaled rope bf16 [rows, 64]. Per row: one 16-byte store per lane (512 contiguous
//     content bytes), one 4-byte store per lane (128 contiguous RoPE bytes), the scale by lane 0.
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
            store_content(content + row * D_CONTENT, o, w.lane);
            stg_u32(rope + row * D_ROPE + QROW_ROPE_PER_LANE * w.lane, o.r);
            if (w.lane == 0) stg_u32(scale + row, __float_as_uint(o.scale));
        }
    }
}

// (b) K-append: kv bf16 [n, 576] + slots int32 / int64 [n] -> 656-byte tokens of the paged cache
//     uint8 [num_slots, 656] (num_slots = num_blocks * 64). Slots outside [0, num_slots) are
//     skipped: nothing is written for them. Duplicate slots race (one of the rows wins).
extern "C" __global__ void __launch_bounds__(prep::THREADS)
snapmla_append_kv(const __nv_bfloat16* __restrict__ kv, const i32* __restrict__ slots, i64 n,
                  u8* __restrict__ cache, i64 num_slots) {
    append_kv_body(kv, slots, n, cache, num_slots);
}

extern "C" __global__ void __launch_bounds__(prep::THREADS)
snapmla_append_kv_i64(const __nv_bfloat16* __restrict__ kv, const i64* __restrict__ slots, i64 n,
                      u8* __restrict__ cache, i64 num_slots) {
    append_kv_body(kv, slots, n, cache, num_slots);
}

// (c) fetch-dequant, paged: request i's tokens 0..n_i-1 (through block_table int32
//     [batch, max_blocks]) -> out bf16 [total_tokens, 576] at rows cu_seqlens[i] ..
//     cu_seqlens[i+1]-1. Rows past cu_seqlens[batch], and rows whose block-table entry points
//     outside the cache, are written as zeros. A warp's rows are consecutive tokens, so the
//     request is searched once per row group and reused while the rows stay inside it.
extern "C" __global__ void __launch_bounds__(prep::THREADS)
snapmla_fetch_dequant_paged(const u8* __restrict__ cache, i64 num_slots,
                            const i32* __restrict__ block_table, int max_blocks,
                            const i32* __restrict__ cu_seqlens, int batch,
                            __nv_bfloat16* __restrict__ out, i64 total_tokens) {
    const WarpCoords w = warp_coords();
    const i64 end = batch > 0 ? static_cast<i64>(ldg_nc_i32(cu_seqlens + batch)) : 0;
    for (i64 group = w.first_group; group * ROWS_PER_WARP < total_tokens;
         group += w.group_stride) {
        const i64 base = group * ROWS_PER_WARP;
        TokenFp8 tok[ROWS_PER_WARP];
        int req = -1;                       // request of the previous row, if any
        i64 req_begin = 0, req_end = 0;     // its token range [cu[req], cu[req+1])
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            tok[r] = zero_token();
            const i64 t = base + r;
            if (t >= total_tokens || t >= end) continue;  // warp-uniform
            if (req < 0 || t >= req_end) {
                req = find_request(t, cu_seqlens, batch, w.lane);
                req_begin = ldg_nc_i32(cu_seqlens + req);
                req_end = ldg_nc_i32(cu_seqlens + req + 1);
            }
            const i64 slot = paged_slot(req, t - req_begin, block_table, max_blocks, num_slots);
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
extern "C" __global__ void __launch_bounds__(prep::THREADS, prep::DQ_MIN_CTAS)
snapmla_fetch_dequant_slots(const u8* __restrict__ cache, i64 num_slots,
                            const i32* __restrict__ slots, i64 n, __nv_bfloat16* __restrict__ out) {
    fetch_slots_body(cache, num_slots, slots, n, out);
}

extern "C" __global__ void __launch_bounds__(prep::THREADS, prep::DQ_MIN_CTAS)
snapmla_fetch_dequant_slots_i64(const u8* __restrict__ cache, i64 num_slots,
                                const i64* __restrict__ slots, i64 n,
                                __nv_bfloat16* __restrict__ out) {
    fetch_slots_body(cache, num_slots, slots, n, out);
}

// (d) fetch-dequant from the structure-of-arrays cache of SGLang-FluentLLM: content uint8
//     [num_slots, 512], scale f32 [num_slots], rope bf16 [num_slots, 64]; invalid slot -> zeros.
extern "C" __global__ void __launch_bounds__(prep::THREADS, prep::DQ_MIN_CTAS)
snapmla_fetch_dequant_soa(const u8* __restrict__ content, const float* __restrict__ scale,
                          const __nv_bfloat16* __restrict__ rope, i64 num_slots,
                          const i32* __restrict__ slots, i64 n, __nv_bfloat16* __restrict__ out) {
    fetch_soa_body(content, scale, rope, num_slots, slots, n, out);
}

extern "C" __global__ void __launch_bounds__(prep::THREADS, prep::DQ_MIN_CTAS)
snapmla_fetch_dequant_soa_i64(const u8* __restrict__ content, const float* __restrict__ scale,
                              const __nv_bfloat16* __restrict__ rope, i64 num_slots,
                              const i64* __restrict__ slots, i64 n,
                              __nv_bfloat16* __restrict__ out) {
    fetch_soa_body(content, scale, rope, num_slots, slots, n, out);
}
