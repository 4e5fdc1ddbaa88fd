// SnapMLA FP8 split-KV decode over the 656-byte paged cache (SPEC sections 2, 3 and 5).
//
// CTA = ROW_GROUPS x 2 warps. The warps of a row group share 16 query rows; warp half 0 owns
// content dims [0, 256) and output dims [0, 256), half 1 content dims [256, 512) plus the RoPE
// tile and output dims [256, 512). Per 64-token page:
//   1. cp.async brings the raw 656-byte rows into shared memory (STAGES deep, zero-filled past
//      the sequence end so V never holds poison);
//   2. QK: each warp multiplies its half of the FP8 content (E4M3 -> f16 exactly in registers,
//      f16 MMA, float32 accumulate) and half 1 adds the pre-scaled bf16 RoPE tile into the same
//      accumulator (pre-scaled domain alignment); the two partial logit tiles are exchanged
//      through shared memory and summed (a + b == b + a, so both warps see identical logits);
//   3. online softmax in the log2 domain with V-scale fusion, per-(row, block) P scale sigma,
//      P rounded to E4M3, O and L rescaled by gamma = 2^(m_old - m_new) * sigma_old / sigma_new;
//   4. PV: V = FP8 content read with ldmatrix.trans on byte pairs plus one byte permute, which
//      yields the K-major operand directly (output dims come out interleaved even/odd and are
//      put back in order by the epilogue's indexing).
// Blocks are visited in strictly increasing order inside a split (no rollback of sigma).
#include "common/mma_sync.cuh"
#include "decode_common.cuh"

#ifndef ROW_GROUPS
#define ROW_GROUPS 4  // 16-row groups per CTA: 1, 2 or 4 (16, 32 or 64 query rows)
#endif
#ifndef STAGES
#define STAGES 2  // pages in flight per CTA
#endif
#ifndef MIN_CTAS_PER_SM
#define MIN_CTAS_PER_SM 1
#endif

namespace snapmla {
namespace fp8 {

constexpr int kWarps = 2 * ROW_GROUPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockM = kRowsPerGroup * ROW_GROUPS;
constexpr int kTokenBytes = 656;
constexpr int kScaleOffset = 512;
constexpr int kRopeOffset = 528;
constexpr int kChunksPerToken = kTokenBytes / 16;            // 41 x 16 B
constexpr int kQContentStride = 512 + 16;                    // padded: conflict-free ldmatrix
constexpr int kQRopeStride = 128 + 16;
constexpr int kPageBytes = kPageTokens * kTokenBytes;        // 41984
constexpr int kKSteps = 512 / 16;                             // content k-steps of 16 dims
constexpr int kKStepsPerHalf = kKSteps / 2;
constexpr int kRopeKSteps = 64 / 16;
constexpr int kNTiles = kPageTokens / 8;                      // 8 logit column tiles
constexpr int kOutTilesPerWarp = (kDimV / 2) / 8;             // 32 output column tiles
constexpr float kE4m3Max = 448.0f;
constexpr float kPScaleFloor = 5.421010862427522e-20f;        // 2^-64

constexpr int kSmemQContent = kBlockM * kQContentStride;
constexpr int kSmemQRope = kBlockM * kQRopeStride;
constexpr int kSmemExchange = kWarps * 32 * 32 * 4;           // 32 floats per lane per warp
constexpr int kSmemBytes = kSmemQContent + kSmemQRope + STAGES * kPageBytes + kSmemExchange;
constexpr int kMaxSmemPerCta = 232448;  // 227 KB opt-in limit on sm_90
static_assert(kSmemBytes <= kMaxSmemPerCta, "STAGES x ROW_GROUPS exceed shared memory");

struct Params {
    const unsigned char* q_content;  // [b, s_q, h_q, 512] e4m3
    const float* q_scale;            // [b, s_q, h_q]
    const __nv_bfloat16* q_rope;     // [b, s_q, h_q, 64] pre-scaled
    const unsigned char* k_cache;    // [num_blocks * 64, 656]
    const int* block_table;          // [b, block_table_stride]
    const int* cache_seqlens;        // [b]
    const WorkItem* work;            // [num_work]
    __nv_bfloat16* out;              // [b, s_q, h_q, 512]
    float* lse;                      // [b, h_q, s_q]
    float* partial_out;              // [num_partials, rows, 512]
    float* partial_lse;              // [num_partials, rows]
    int block_table_stride;
    float softmax_scale_log2;        // softmax_scale * log2(e)
    DecodeShape shape;
};

__device__ __forceinline__ void load_page(unsigned char* dst, const unsigned char* k_cache,
                                          int page, int first_token, int seqlen) {
    const unsigned char* src = k_cache + static_cast<long>(page) * kPageBytes;
    for (int c = threadIdx.x; c < kPageTokens * kChunksPerToken; c += kThreads) {
        const int token = c / kChunksPerToken;
        const bool valid = first_token + token < seqlen;
        cp_async_16(dst + c * 16, valid ? src + c * 16 : src, valid);
    }
}

__device__ __forceinline__ void load_q(unsigned char* q_content_s, unsigned char* q_rope_s,
                                       const Params& p, long row_base, int row0, int rows) {
    constexpr int kContentChunks = 512 / 16, kRopeChunks = 128 / 16;
    for (int c = threadIdx.x; c < kBlockM * (kContentChunks + kRopeChunks); c += kThreads) {
        const int r = c / (kContentChunks + kRopeChunks), k = c % (kContentChunks + kRopeChunks);
        const bool valid = row0 + r < rows;
        const long grow = row_base + (valid ? row0 + r : 0);
        if (k < kContentChunks) {
            cp_async_16(q_content_s + r * kQContentStride + k * 16,
                        p.q_content + grow * 512 + k * 16, valid);
        } else {
            const int kr = k - kContentChunks;
            cp_async_16(q_rope_s + r * kQRopeStride + kr * 16,
                        reinterpret_cast<const unsigned char*>(p.q_rope + grow * 64) + kr * 16,
                        valid);
        }
    }
}

}  // namespace fp8
}  // namespace snapmla

using snapmla::fp8::Params;

// Arguments are passed one by one (CuPy launches take scalars and pointers, not structs).
extern "C" __global__ void __launch_bounds__(snapmla::fp8::kThreads, MIN_CTAS_PER_SM)
snapmla_decode_fp8(const unsigned char* q_content, const float* q_scale,
                   const __nv_bfloat16* q_rope, const unsigned char* k_cache,
                   const int* block_table, const int* cache_seqlens,
                   const snapmla::WorkItem* work_list, __nv_bfloat16* out, float* lse,
                   float* partial_out, float* partial_lse, int block_table_stride,
                   float softmax_scale_log2, int h_q, int s_q, int causal) {
    using namespace snapmla;
    using namespace snapmla::fp8;
    const Params p{q_content, q_scale, q_rope, k_cache, block_table, cache_seqlens, work_list,
                   out, lse, partial_out, partial_lse, block_table_stride, softmax_scale_log2,
                   DecodeShape{h_q, s_q, causal}};
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* q_content_s = smem;
    unsigned char* q_rope_s = q_content_s + kSmemQContent;
    unsigned char* pages_s = q_rope_s + kSmemQRope;
    float4* exchange_s = reinterpret_cast<float4*>(pages_s + STAGES * kPageBytes);

    const WorkItem work = p.work[blockIdx.y];
    const int req = work.request;
    const int rows = p.shape.s_q * p.shape.h_q;
    const int row0 = blockIdx.x * kBlockM;
    if (row0 >= rows) return;
    const int seqlen = p.cache_seqlens[req];
    const long row_base = static_cast<long>(req) * rows;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int half = warp / ROW_GROUPS, group = warp % ROW_GROUPS;
    const int partner = (1 - half) * ROW_GROUPS + group;
    const int g = lane / 4, c = lane % 4;
    const int row_lo = row0 + group * kRowsPerGroup + g, row_hi = row_lo + 8;
    const int vis_lo = visible_keys(row_lo, rows, seqlen, p.shape);
    const int vis_hi = visible_keys(row_hi, rows, seqlen, p.shape);
    const int last_row = min(row0 + kBlockM, rows) - 1;
    const int cta_visible = visible_keys(last_row, rows, seqlen, p.shape);
    const int block_begin = work.block_begin;
    const int block_end = min(work.block_end, (cta_visible + kPageTokens - 1) / kPageTokens);
    const int num_blocks = max(block_end - block_begin, 0);

    const float q_scale_lo = row_lo < rows ? p.q_scale[row_base + row_lo] : 0.f;
    const float q_scale_hi = row_hi < rows ? p.q_scale[row_base + row_hi] : 0.f;
    const float qk_scale_lo = q_scale_lo * p.softmax_scale_log2;
    const float qk_scale_hi = q_scale_hi * p.softmax_scale_log2;

    const int* table = p.block_table + static_cast<long>(req) * p.block_table_stride;
    load_q(q_content_s, q_rope_s, p, row_base, row0, rows);
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_blocks) {
            const int blk = block_begin + s;
            load_page(pages_s + s * kPageBytes, p.k_cache, table[blk], blk * kPageTokens, seqlen);
        }
        cp_async_commit();
    }

    float o_acc[kOutTilesPerWarp][4];
#pragma unroll
    for (int i = 0; i < kOutTilesPerWarp; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY;      // running max, log2 domain
    float sig_lo = 1.f, sig_hi = 1.f;              // current P scale
    float l_lo = 0.f, l_hi = 0.f;                  // per-thread partial of L

    const unsigned char* q_warp = q_content_s + group * kRowsPerGroup * kQContentStride;
    const unsigned char* qr_warp = q_rope_s + group * kRowsPerGroup * kQRopeStride;

    for (int it = 0; it < num_blocks; ++it) {
        const int blk = block_begin + it;
        {   // keep STAGES-1 pages in flight
            const int pre = it + STAGES - 1;
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            if (pre < num_blocks) {
                const int pblk = block_begin + pre;
                load_page(pages_s + (pre % STAGES) * kPageBytes, p.k_cache, table[pblk],
                          pblk * kPageTokens, seqlen);
            }
            cp_async_commit();
        }
        const unsigned char* page = pages_s + (it % STAGES) * kPageBytes;

        // ---- QK: partial logits of this warp's half ------------------------------------
        float s_acc[kNTiles][4];
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) s_acc[t][0] = s_acc[t][1] = s_acc[t][2] = s_acc[t][3] = 0.f;
#pragma unroll
        for (int kp = 0; kp < kKStepsPerHalf; kp += 2) {
            const int ks = half * kKStepsPerHalf + kp;
            unsigned qa[4];
            {   // rows 0-7 / 8-15 for k-steps ks and ks+1
                const int r = (lane % 8) + 8 * ((lane / 8) % 2);
                const int chunk = ks + lane / 16;
                ldmatrix_x4(qa, q_warp + r * kQContentStride + chunk * 16);
            }
            unsigned a0[4] = {e4m3x2_to_f16x2(qa[0]), e4m3x2_to_f16x2(qa[1]),
                              e4m3x2_hi_to_f16x2(qa[0]), e4m3x2_hi_to_f16x2(qa[1])};
            unsigned a1[4] = {e4m3x2_to_f16x2(qa[2]), e4m3x2_to_f16x2(qa[3]),
                              e4m3x2_hi_to_f16x2(qa[2]), e4m3x2_hi_to_f16x2(qa[3])};
#pragma unroll
            for (int t0 = 0; t0 < kNTiles; t0 += 2) {
                unsigned kb[4];  // (tile t0, ks), (tile t0, ks+1), (tile t0+1, ks), (tile t0+1, ks+1)
                const int token = 8 * (t0 + lane / 16) + lane % 8;
                const int chunk = ks + (lane / 8) % 2;
                ldmatrix_x4(kb, page + token * kTokenBytes + chunk * 16);
                mma_f16_16816(s_acc[t0], a0, e4m3x2_to_f16x2(kb[0]), e4m3x2_hi_to_f16x2(kb[0]));
                mma_f16_16816(s_acc[t0], a1, e4m3x2_to_f16x2(kb[1]), e4m3x2_hi_to_f16x2(kb[1]));
                mma_f16_16816(s_acc[t0 + 1], a0, e4m3x2_to_f16x2(kb[2]), e4m3x2_hi_to_f16x2(kb[2]));
                mma_f16_16816(s_acc[t0 + 1], a1, e4m3x2_to_f16x2(kb[3]), e4m3x2_hi_to_f16x2(kb[3]));
            }
        }
        if (half == 1) {  // pre-scaled bf16 RoPE tile into the same accumulator
#pragma unroll
            for (int kk = 0; kk < kRopeKSteps; ++kk) {
                unsigned qa[4];
                const int r = (lane % 8) + 8 * ((lane / 8) % 2);
                ldmatrix_x4(qa, qr_warp + r * kQRopeStride + (2 * kk + lane / 16) * 16);
#pragma unroll
                for (int t0 = 0; t0 < kNTiles; t0 += 2) {
                    unsigned kb[4];
                    const int token = 8 * (t0 + lane / 16) + lane % 8;
                    const int chunk = 2 * kk + (lane / 8) % 2;
                    ldmatrix_x4(kb, page + token * kTokenBytes + kRopeOffset + chunk * 16);
                    mma_bf16_16816(s_acc[t0], qa, kb[0], kb[1]);
                    mma_bf16_16816(s_acc[t0 + 1], qa, kb[2], kb[3]);
                }
            }
        }

        // ---- exchange partial logits with the partner warp and sum --------------------
        float4* mine = exchange_s + warp * 8 * 32;
        const float4* theirs = exchange_s + partner * 8 * 32;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t)
            mine[t * 32 + lane] = make_float4(s_acc[t][0], s_acc[t][1], s_acc[t][2], s_acc[t][3]);
        __syncthreads();
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
            const float4 o = theirs[t * 32 + lane];
            s_acc[t][0] += o.x; s_acc[t][1] += o.y; s_acc[t][2] += o.z; s_acc[t][3] += o.w;
        }

        // ---- online softmax with V-scale fusion and block-wise P quantization ---------
        const int first_token = blk * kPageTokens;
        float k_scale[kNTiles][2];
        float bmax_lo = -INFINITY, bmax_hi = -INFINITY;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * t + 2 * c + e;
                const float ks_val = *reinterpret_cast<const float*>(page + col * kTokenBytes + kScaleOffset);
                k_scale[t][e] = ks_val;
                const int token = first_token + col;
                const float x_lo = token < vis_lo ? s_acc[t][e] * (qk_scale_lo * ks_val) : -INFINITY;
                const float x_hi = token < vis_hi ? s_acc[t][2 + e] * (qk_scale_hi * ks_val) : -INFINITY;
                s_acc[t][e] = x_lo;
                s_acc[t][2 + e] = x_hi;
                bmax_lo = fmaxf(bmax_lo, x_lo);
                bmax_hi = fmaxf(bmax_hi, x_hi);
            }
        }
        bmax_lo = quad_max(bmax_lo);
        bmax_hi = quad_max(bmax_hi);
        const float mnew_lo = fmaxf(m_lo, bmax_lo), mnew_hi = fmaxf(m_hi, bmax_hi);
        const bool act_lo = bmax_lo > -INFINITY, act_hi = bmax_hi > -INFINITY;
        // e_j, then et_j = e_j * s_k[j]; reuse s_acc for e and k_scale for et
        float etmax_lo = 0.f, etmax_hi = 0.f, esum_lo = 0.f, esum_hi = 0.f;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float e_lo = act_lo ? fast_exp2(s_acc[t][e] - mnew_lo) : 0.f;
                const float e_hi = act_hi ? fast_exp2(s_acc[t][2 + e] - mnew_hi) : 0.f;
                esum_lo += e_lo;
                esum_hi += e_hi;
                s_acc[t][e] = e_lo * k_scale[t][e];
                s_acc[t][2 + e] = e_hi * k_scale[t][e];
                etmax_lo = fmaxf(etmax_lo, s_acc[t][e]);
                etmax_hi = fmaxf(etmax_hi, s_acc[t][2 + e]);
            }
        }
        etmax_lo = quad_max(etmax_lo);
        etmax_hi = quad_max(etmax_hi);
        const float signew_lo = act_lo ? fmaxf(__fdiv_rn(etmax_lo, kE4m3Max), kPScaleFloor) : sig_lo;
        const float signew_hi = act_hi ? fmaxf(__fdiv_rn(etmax_hi, kE4m3Max), kPScaleFloor) : sig_hi;
        const float gamma_lo = !act_lo ? 1.f : (m_lo == -INFINITY ? 0.f : fast_exp2(m_lo - mnew_lo) * __fdiv_rn(sig_lo, signew_lo));
        const float gamma_hi = !act_hi ? 1.f : (m_hi == -INFINITY ? 0.f : fast_exp2(m_hi - mnew_hi) * __fdiv_rn(sig_hi, signew_hi));
        l_lo = gamma_lo * l_lo + (act_lo ? __fdiv_rn(esum_lo, signew_lo) : 0.f);
        l_hi = gamma_hi * l_hi + (act_hi ? __fdiv_rn(esum_hi, signew_hi) : 0.f);
        if (act_lo) { m_lo = mnew_lo; sig_lo = signew_lo; }
        if (act_hi) { m_hi = mnew_hi; sig_hi = signew_hi; }
#pragma unroll
        for (int i = 0; i < kOutTilesPerWarp; ++i) {
            o_acc[i][0] *= gamma_lo; o_acc[i][1] *= gamma_lo;
            o_acc[i][2] *= gamma_hi; o_acc[i][3] *= gamma_hi;
        }
        // P = e4m3(et / sigma) as the f16 A operand: tiles (2j, 2j+1) form k-step j
        unsigned pa[kNTiles / 2][4];
#pragma unroll
        for (int j = 0; j < kNTiles / 2; ++j) {
            pa[j][0] = f32x2_to_e4m3_as_f16x2(__fdiv_rn(s_acc[2 * j][0], sig_lo), __fdiv_rn(s_acc[2 * j][1], sig_lo));
            pa[j][1] = f32x2_to_e4m3_as_f16x2(__fdiv_rn(s_acc[2 * j][2], sig_hi), __fdiv_rn(s_acc[2 * j][3], sig_hi));
            pa[j][2] = f32x2_to_e4m3_as_f16x2(__fdiv_rn(s_acc[2 * j + 1][0], sig_lo), __fdiv_rn(s_acc[2 * j + 1][1], sig_lo));
            pa[j][3] = f32x2_to_e4m3_as_f16x2(__fdiv_rn(s_acc[2 * j + 1][2], sig_hi), __fdiv_rn(s_acc[2 * j + 1][3], sig_hi));
        }

        // ---- PV: O += P (16 x 64) . V (64 x 256 of this half) --------------------------
        const unsigned char* v_base = page + half * 256;
#pragma unroll
        for (int j = 0; j < kNTiles / 2; ++j) {
#pragma unroll
            for (int q = 0; q < kOutTilesPerWarp / 2; q += 2) {
                unsigned vb[4];  // (tokens 0-7, chunk q), (tokens 8-15, chunk q), same for q+1
                const int token = 16 * j + 8 * ((lane / 8) % 2) + lane % 8;
                const int chunk = q + lane / 16;
                ldmatrix_x4_trans(vb, v_base + token * kTokenBytes + chunk * 16);
                const unsigned sel = 0x3120;  // bytes -> (even dim: tok 2c, 2c+1 | odd dim: ...)
                const unsigned v0 = prmt(vb[0], 0, sel), v1 = prmt(vb[1], 0, sel);
                const unsigned v2 = prmt(vb[2], 0, sel), v3 = prmt(vb[3], 0, sel);
                mma_f16_16816(o_acc[2 * q], pa[j], e4m3x2_to_f16x2(v0), e4m3x2_to_f16x2(v1));
                mma_f16_16816(o_acc[2 * q + 1], pa[j], e4m3x2_hi_to_f16x2(v0), e4m3x2_hi_to_f16x2(v1));
                mma_f16_16816(o_acc[2 * q + 2], pa[j], e4m3x2_to_f16x2(v2), e4m3x2_to_f16x2(v3));
                mma_f16_16816(o_acc[2 * q + 3], pa[j], e4m3x2_hi_to_f16x2(v2), e4m3x2_hi_to_f16x2(v3));
            }
        }
    }
    cp_async_wait<0>();

    // ---- epilogue: out = O / L, lse = m + log(sigma * L) ---------------------------------
    const float lsum_lo = quad_sum(l_lo), lsum_hi = quad_sum(l_hi);
    const bool to_partial = work.partial >= 0;
    const bool has_lo = m_lo > -INFINITY, has_hi = m_hi > -INFINITY;
    const float inv_lo = has_lo ? 1.f / lsum_lo : 0.f, inv_hi = has_hi ? 1.f / lsum_hi : 0.f;
    const long part_rows = static_cast<long>(work.partial) * rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? row_lo : row_hi;
        if (row >= rows) continue;
        const float inv = r == 0 ? inv_lo : inv_hi;
        const long base = to_partial ? (part_rows + row) * kDimV : (row_base + row) * kDimV;
#pragma unroll
        for (int q = 0; q < kOutTilesPerWarp / 2; ++q) {
            const int dim = half * 256 + 16 * q + 4 * c;
            store_out4(p.out, p.partial_out, base + dim, to_partial,
                       o_acc[2 * q][2 * r] * inv, o_acc[2 * q + 1][2 * r] * inv,
                       o_acc[2 * q][2 * r + 1] * inv, o_acc[2 * q + 1][2 * r + 1] * inv);
        }
        if (half == 0 && c == 0) {
            const bool has = r == 0 ? has_lo : has_hi;
            const float m = r == 0 ? m_lo : m_hi, sig = r == 0 ? sig_lo : sig_hi;
            const float lsum = r == 0 ? lsum_lo : lsum_hi;
            const float value = has ? m * kLn2 + logf(sig * lsum) : (to_partial ? -INFINITY : INFINITY);
            if (to_partial) p.partial_lse[part_rows + row] = value;
            else p.lse[lse_index(req, row, p.shape)] = value;
        }
    }
}
