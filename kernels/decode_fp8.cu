// SnapMLA FP8 split-KV decode over the 656-byte paged cache (SPEC sections 2, 3 and 5).
//
// CTA = ROW_GROUPS x 2 x KV_SPLIT warps. A row group is 16 query rows. For each row group,
// warp half 0 owns content dims [0, 256) and output dims [0, 256), half 1 content dims
// [256, 512) plus the RoPE tile and output dims [256, 512); KV_SPLIT token groups of warps share
// each 64-token page (64 / KV_SPLIT tokens each), so that small head counts still keep 8 warps
// busy per page. Per page:
//   1. one thread issues a bulk async copy of the page (contiguous 64 x 656 bytes) into shared
//      memory, STAGES deep, completing on an mbarrier; rows past the sequence end are
//      zero-filled instead, so V never holds poison;
//   2. QK: E4M3 content -> f16 exactly in registers (f16 MMA, float32 accumulate), and half 1
//      adds the pre-scaled bf16 RoPE tile into the same accumulator (pre-scaled domain
//      alignment); the two halves' partial logits are exchanged through shared memory and
//      summed (a + b == b + a: both warps hold identical logits);
//   3. online softmax (log2 domain) with V-scale fusion: the block max and the block max of
//      e * s_k are combined across token groups through shared memory, so m, sigma and gamma
//      are identical in every warp; P = e4m3(e * s_k / sigma);
//   4. PV: V = the same FP8 content, read K-major with ldmatrix.trans on byte pairs plus one
//      byte permute (output dims come out interleaved even/odd; the epilogue restores order).
// Token groups share m and sigma, so their O and L accumulators are in one scale domain and are
// summed at the end. Blocks are visited in strictly increasing order inside a split.
#include "decode_common.cuh"

#ifndef ROW_GROUPS
#define ROW_GROUPS 4  // 16-row groups per CTA: 1, 2 or 4
#endif
#ifndef KV_SPLIT
#define KV_SPLIT 1  // token groups sharing one page: 1, 2 or 4
#endif
#ifndef STAGES
#define STAGES 2  // pages in flight per CTA
#endif
#ifndef MIN_CTAS_PER_SM
#define MIN_CTAS_PER_SM 1
#endif

namespace snapmla {
namespace fp8 {

constexpr int kWarps = 2 * ROW_GROUPS * KV_SPLIT;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockM = kRowsPerGroup * ROW_GROUPS;
constexpr int kTokenBytes = FP8_TOKEN_BYTES;
constexpr int kScaleOffset = SCALE_OFFSET;
constexpr int kRopeOffset = ROPE_OFFSET;
constexpr int kChunk = VEC_BYTES;                             // bytes per 16-byte vector
constexpr int kChunksPerToken = kTokenBytes / kChunk;         // 41
constexpr int kQContentStride = 512 + kChunk;                 // padded: conflict-free ldmatrix
constexpr int kQRopeStride = 128 + kChunk;
constexpr int kPageBytes = kPageTokens * kTokenBytes;         // 41984
constexpr int kTokensPerGroup = kPageTokens / KV_SPLIT;
constexpr int kNTiles = kTokensPerGroup / 8;                  // logit column tiles per warp
constexpr int kKSteps = 512 / 16;
constexpr int kKStepsPerHalf = kKSteps / 2;
constexpr int kRopeKSteps = 64 / 16;
constexpr int kOutTilesPerWarp = (kDimV / 2) / 8;             // 32
constexpr float kE4m3Max = E4M3_MAX;
constexpr float kPScaleFloor = P_SCALE_FLOOR;               // 2^-64

constexpr int kSmemQ = kBlockM * (kQContentStride + kQRopeStride);
constexpr int kSmemPages = STAGES * kPageBytes;
constexpr int kSmemExchange = 2 * kWarps * kNTiles * 32 * 16; // double-buffered float4 per lane
constexpr int kSmemReduce = KV_SPLIT * ROW_GROUPS * kRowsPerGroup * 8;  // (m, max e*s_k) per row
constexpr int kSmemBars = STAGES * 8;
constexpr int kSmemBytes = kSmemQ + kSmemPages + kSmemExchange + kSmemReduce + kSmemBars;
constexpr int kMaxSmemPerCta = 232448;                        // 227 KB opt-in limit on sm_90
constexpr int kFinalScratch = 2 * ROW_GROUPS * 32 * (kOutTilesPerWarp + 1) * 16;
static_assert(STAGES >= 2, "the prefetch needs at least two stages");
static_assert(kWarps <= 8, "more than 8 warps leaves fewer than 255 registers per thread");
static_assert(kSmemBytes <= kMaxSmemPerCta, "STAGES x ROW_GROUPS x KV_SPLIT exceed shared memory");
static_assert(kNTiles % 2 == 0, "each token group needs whole 16-token k-steps");
static_assert(KV_SPLIT == 1 || kFinalScratch <= kSmemPages, "token-group reduction needs page space");
static_assert(kSmemQ % 128 == 0, "pages must stay 128-byte aligned");

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

// Thread 0 issues the bulk copy of a page's valid rows; rows past the sequence end are zeroed
// by `zero_tail` when the page is consumed (stale or poison bytes must not reach the PV MMA).
__device__ __forceinline__ void fetch_page(unsigned char* dst, unsigned long long* bar,
                                           const unsigned char* k_cache, int page, int first_token,
                                           int seqlen) {
    if (threadIdx.x == 0) {
        const unsigned bytes = min(kPageTokens, seqlen - first_token) * kTokenBytes;
        fence_proxy_async_shared();
        mbarrier_arrive_expect_tx(bar, bytes);
        bulk_copy_g2s(dst, k_cache + static_cast<long>(page) * kPageBytes, bytes, bar);
    }
}

__device__ __forceinline__ void zero_tail(unsigned char* page, int valid) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int c = valid * kChunksPerToken + threadIdx.x; c < kPageTokens * kChunksPerToken; c += kThreads)
        *reinterpret_cast<uint4*>(page + c * kChunk) = zero;
}

__device__ __forceinline__ void load_q(unsigned char* q_content_s, unsigned char* q_rope_s,
                                       const Params& p, long row_base, int row0, int rows) {
    constexpr int kContentChunks = 512 / kChunk, kRopeChunks = 128 / kChunk;
    constexpr int kRowChunks = kContentChunks + kRopeChunks;
    for (int c = threadIdx.x; c < kBlockM * kRowChunks; c += kThreads) {
        const int r = c / kRowChunks, k = c % kRowChunks;
        const bool valid = row0 + r < rows;
        const long grow = row_base + (valid ? row0 + r : 0);
        if (k < kContentChunks) {
            cp_async_16(q_content_s + r * kQContentStride + k * kChunk,
                        p.q_content + grow * 512 + k * kChunk, valid);
        } else {
            const int kr = k - kContentChunks;
            cp_async_16(q_rope_s + r * kQRopeStride + kr * kChunk,
                        reinterpret_cast<const unsigned char*>(p.q_rope + grow * 64) + kr * kChunk,
                        valid);
        }
    }
    cp_async_commit();
}

__device__ __forceinline__ void run(const Params& p, unsigned char* smem) {
    unsigned char* q_content_s = smem;
    unsigned char* q_rope_s = q_content_s + kBlockM * kQContentStride;
    unsigned char* pages_s = smem + kSmemQ;
    float4* exchange_s = reinterpret_cast<float4*>(pages_s + kSmemPages);
    float2* reduce_s = reinterpret_cast<float2*>(reinterpret_cast<unsigned char*>(exchange_s) + kSmemExchange);
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(reinterpret_cast<unsigned char*>(reduce_s) + kSmemReduce);

    const WorkItem work = p.work[blockIdx.y];
    const int req = work.request;
    const int rows = p.shape.s_q * p.shape.h_q;
    const int row0 = blockIdx.x * kBlockM;
    if (row0 >= rows) return;
    const int seqlen = p.cache_seqlens[req];
    const long row_base = static_cast<long>(req) * rows;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = warp % ROW_GROUPS;
    const int half = (warp / ROW_GROUPS) % 2;
    const int kvg = warp / (2 * ROW_GROUPS);
    const int partner = (kvg * 2 + (1 - half)) * ROW_GROUPS + group;
    const int tok0 = kvg * kTokensPerGroup;
    const int g = lane / 4, c = lane % 4;
    const int row_lo = row0 + group * kRowsPerGroup + g, row_hi = row_lo + 8;
    const int vis_lo = visible_keys(row_lo, rows, seqlen, p.shape);
    const int vis_hi = visible_keys(row_hi, rows, seqlen, p.shape);
    const int cta_visible = visible_keys(min(row0 + kBlockM, rows) - 1, rows, seqlen, p.shape);
    const int block_begin = work.block_begin;
    const int block_end = min(work.block_end, (cta_visible + kPageTokens - 1) / kPageTokens);
    const int num_blocks = max(block_end - block_begin, 0);

    const float qk_scale_lo = (row_lo < rows ? p.q_scale[row_base + row_lo] : 0.f) * p.softmax_scale_log2;
    const float qk_scale_hi = (row_hi < rows ? p.q_scale[row_base + row_hi] : 0.f) * p.softmax_scale_log2;
    const int* table = p.block_table + static_cast<long>(req) * p.block_table_stride;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbarrier_init(&bars[s], 1);
        fence_proxy_async_shared();
    }
    load_q(q_content_s, q_rope_s, p, row_base, row0, rows);
    __syncthreads();  // barriers initialised
    for (int s = 0; s < STAGES - 1 && s < num_blocks; ++s) {
        const int blk = block_begin + s;
        fetch_page(pages_s + s * kPageBytes, &bars[s], p.k_cache, table[blk], blk * kPageTokens, seqlen);
    }
    cp_async_wait<0>();
    __syncthreads();  // Q visible to every warp

    float o_acc[kOutTilesPerWarp][4];
#pragma unroll
    for (int i = 0; i < kOutTilesPerWarp; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY;  // running max, log2 domain
    float sig_lo = 1.f, sig_hi = 1.f;          // current P scale
    float l_lo = 0.f, l_hi = 0.f;              // per-thread partial of L

    const unsigned char* q_warp = q_content_s + group * kRowsPerGroup * kQContentStride;
    const unsigned char* qr_warp = q_rope_s + group * kRowsPerGroup * kQRopeStride;

    for (int it = 0; it < num_blocks; ++it) {
        const int blk = block_begin + it;
        const int stage = it % STAGES;
        mbarrier_wait_parity(&bars[stage], (it / STAGES) & 1);
        unsigned char* page = pages_s + stage * kPageBytes;
        if (blk * kPageTokens + kPageTokens > seqlen) {  // the request's last, partial page
            zero_tail(page, seqlen - blk * kPageTokens);
            __syncthreads();
        }

        // ---- QK: partial logits of this warp's half over its token group -------------------
        float s_acc[kNTiles][4];
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) s_acc[t][0] = s_acc[t][1] = s_acc[t][2] = s_acc[t][3] = 0.f;
#pragma unroll
        for (int kp = 0; kp < kKStepsPerHalf; kp += 2) {
            const int ks = half * kKStepsPerHalf + kp;
            unsigned qa[4];
            ldmatrix_x4(qa, q_warp + ((lane % 8) + 8 * ((lane / 8) % 2)) * kQContentStride + (ks + lane / 16) * kChunk);
            const unsigned a0[4] = {e4m3x2_to_f16x2(qa[0]), e4m3x2_to_f16x2(qa[1]),
                                    e4m3x2_hi_to_f16x2(qa[0]), e4m3x2_hi_to_f16x2(qa[1])};
            const unsigned a1[4] = {e4m3x2_to_f16x2(qa[2]), e4m3x2_to_f16x2(qa[3]),
                                    e4m3x2_hi_to_f16x2(qa[2]), e4m3x2_hi_to_f16x2(qa[3])};
#pragma unroll
            for (int t0 = 0; t0 < kNTiles; t0 += 2) {
                unsigned kb[4];  // (tile t0, ks), (t0, ks+1), (t0+1, ks), (t0+1, ks+1)
                const int token = tok0 + 8 * (t0 + lane / 16) + lane % 8;
                ldmatrix_x4(kb, page + token * kTokenBytes + (ks + (lane / 8) % 2) * kChunk);
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
                ldmatrix_x4(qa, qr_warp + ((lane % 8) + 8 * ((lane / 8) % 2)) * kQRopeStride + (2 * kk + lane / 16) * kChunk);
#pragma unroll
                for (int t0 = 0; t0 < kNTiles; t0 += 2) {
                    unsigned kb[4];
                    const int token = tok0 + 8 * (t0 + lane / 16) + lane % 8;
                    ldmatrix_x4(kb, page + token * kTokenBytes + kRopeOffset + (2 * kk + (lane / 8) % 2) * kChunk);
                    mma_bf16_16816(s_acc[t0], qa, kb[0], kb[1]);
                    mma_bf16_16816(s_acc[t0 + 1], qa, kb[2], kb[3]);
                }
            }
        }

        // ---- exchange partial logits with the partner half (double-buffered) --------------
        float4* xbuf = exchange_s + (it & 1) * kWarps * kNTiles * 32;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t)
            xbuf[(warp * kNTiles + t) * 32 + lane] = make_float4(s_acc[t][0], s_acc[t][1], s_acc[t][2], s_acc[t][3]);
        __syncthreads();  // also: every warp is done with page it-1, whose stage is refilled next
        if (it + STAGES - 1 < num_blocks) {
            const int pre = it + STAGES - 1;
            const int pblk = block_begin + pre;
            fetch_page(pages_s + (pre % STAGES) * kPageBytes, &bars[pre % STAGES], p.k_cache,
                       table[pblk], pblk * kPageTokens, seqlen);
        }
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
            const float4 o = xbuf[(partner * kNTiles + t) * 32 + lane];
            s_acc[t][0] += o.x; s_acc[t][1] += o.y; s_acc[t][2] += o.z; s_acc[t][3] += o.w;
        }

        // ---- logits, masks and the block max of this token group --------------------------
        const int first_token = blk * kPageTokens + tok0;
        float k_scale[kNTiles][2];
        float mloc_lo = -INFINITY, mloc_hi = -INFINITY;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * t + 2 * c + e;
                const float ks_val = *reinterpret_cast<const float*>(page + (tok0 + col) * kTokenBytes + kScaleOffset);
                k_scale[t][e] = ks_val;
                const int token = first_token + col;
                s_acc[t][e] = token < vis_lo ? s_acc[t][e] * (qk_scale_lo * ks_val) : -INFINITY;
                s_acc[t][2 + e] = token < vis_hi ? s_acc[t][2 + e] * (qk_scale_hi * ks_val) : -INFINITY;
                mloc_lo = fmaxf(mloc_lo, s_acc[t][e]);
                mloc_hi = fmaxf(mloc_hi, s_acc[t][2 + e]);
            }
        }
        mloc_lo = quad_max(mloc_lo);
        mloc_hi = quad_max(mloc_hi);
        // e relative to the local max; et = e * s_k and its local max
        float etl_lo = 0.f, etl_hi = 0.f, esum_lo = 0.f, esum_hi = 0.f;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float e_lo = mloc_lo > -INFINITY ? fast_exp2(s_acc[t][e] - mloc_lo) : 0.f;
                const float e_hi = mloc_hi > -INFINITY ? fast_exp2(s_acc[t][2 + e] - mloc_hi) : 0.f;
                s_acc[t][e] = e_lo;
                s_acc[t][2 + e] = e_hi;
                esum_lo += e_lo;
                esum_hi += e_hi;
                etl_lo = fmaxf(etl_lo, e_lo * k_scale[t][e]);
                etl_hi = fmaxf(etl_hi, e_hi * k_scale[t][e]);
            }
        }
        etl_lo = quad_max(etl_lo);
        etl_hi = quad_max(etl_hi);

        // ---- combine the token groups: block max and block max of e * s_k -----------------
        float bmax_lo = mloc_lo, bmax_hi = mloc_hi;
        float mnew_lo, mnew_hi, etmax_lo, etmax_hi, f_lo = 1.f, f_hi = 1.f;
        if constexpr (KV_SPLIT > 1) {
            float2* rbuf = reduce_s + (kvg * ROW_GROUPS + group) * kRowsPerGroup;
            if (half == 0 && c == 0) {
                rbuf[g] = make_float2(mloc_lo, etl_lo);
                rbuf[g + 8] = make_float2(mloc_hi, etl_hi);
            }
            __syncthreads();
            float2 parts_lo[KV_SPLIT], parts_hi[KV_SPLIT];
#pragma unroll
            for (int k = 0; k < KV_SPLIT; ++k) {
                parts_lo[k] = reduce_s[(k * ROW_GROUPS + group) * kRowsPerGroup + g];
                parts_hi[k] = reduce_s[(k * ROW_GROUPS + group) * kRowsPerGroup + g + 8];
                bmax_lo = fmaxf(bmax_lo, parts_lo[k].x);
                bmax_hi = fmaxf(bmax_hi, parts_hi[k].x);
            }
            mnew_lo = fmaxf(m_lo, bmax_lo);
            mnew_hi = fmaxf(m_hi, bmax_hi);
            etmax_lo = 0.f;
            etmax_hi = 0.f;
#pragma unroll
            for (int k = 0; k < KV_SPLIT; ++k) {
                if (parts_lo[k].x > -INFINITY) etmax_lo = fmaxf(etmax_lo, fast_exp2(parts_lo[k].x - mnew_lo) * parts_lo[k].y);
                if (parts_hi[k].x > -INFINITY) etmax_hi = fmaxf(etmax_hi, fast_exp2(parts_hi[k].x - mnew_hi) * parts_hi[k].y);
            }
            f_lo = mloc_lo > -INFINITY ? fast_exp2(mloc_lo - mnew_lo) : 0.f;
            f_hi = mloc_hi > -INFINITY ? fast_exp2(mloc_hi - mnew_hi) : 0.f;
        } else {
            mnew_lo = fmaxf(m_lo, bmax_lo);
            mnew_hi = fmaxf(m_hi, bmax_hi);
            if (mloc_lo > -INFINITY) f_lo = fast_exp2(mloc_lo - mnew_lo);
            if (mloc_hi > -INFINITY) f_hi = fast_exp2(mloc_hi - mnew_hi);
            etmax_lo = etl_lo * f_lo;
            etmax_hi = etl_hi * f_hi;
        }
        const bool act_lo = bmax_lo > -INFINITY, act_hi = bmax_hi > -INFINITY;
        const float signew_lo = act_lo ? fmaxf(__fdiv_rn(etmax_lo, kE4m3Max), kPScaleFloor) : sig_lo;
        const float signew_hi = act_hi ? fmaxf(__fdiv_rn(etmax_hi, kE4m3Max), kPScaleFloor) : sig_hi;
        const float gamma_lo = !act_lo ? 1.f : (m_lo == -INFINITY ? 0.f : fast_exp2(m_lo - mnew_lo) * __fdiv_rn(sig_lo, signew_lo));
        const float gamma_hi = !act_hi ? 1.f : (m_hi == -INFINITY ? 0.f : fast_exp2(m_hi - mnew_hi) * __fdiv_rn(sig_hi, signew_hi));
        const float inv_lo = __frcp_rn(signew_lo), inv_hi = __frcp_rn(signew_hi);
        l_lo = gamma_lo * l_lo + (act_lo ? div_rn_fast(esum_lo * f_lo, signew_lo, inv_lo) : 0.f);
        l_hi = gamma_hi * l_hi + (act_hi ? div_rn_fast(esum_hi * f_hi, signew_hi, inv_hi) : 0.f);
        if (act_lo) { m_lo = mnew_lo; sig_lo = signew_lo; }
        if (act_hi) { m_hi = mnew_hi; sig_hi = signew_hi; }
#pragma unroll
        for (int i = 0; i < kOutTilesPerWarp; ++i) {
            o_acc[i][0] *= gamma_lo; o_acc[i][1] *= gamma_lo;
            o_acc[i][2] *= gamma_hi; o_acc[i][3] *= gamma_hi;
        }
        // P = e4m3(e * s_k / sigma) as the f16 A operand: tiles (2j, 2j+1) form k-step j
        unsigned pa[kNTiles / 2][4];
#pragma unroll
        for (int j = 0; j < kNTiles / 2; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int t = 2 * j + h;
                const float et0 = s_acc[t][0] * f_lo * k_scale[t][0], et1 = s_acc[t][1] * f_lo * k_scale[t][1];
                const float et2 = s_acc[t][2] * f_hi * k_scale[t][0], et3 = s_acc[t][3] * f_hi * k_scale[t][1];
                pa[j][2 * h] = f32x2_to_e4m3_as_f16x2(div_rn_fast(et0, sig_lo, inv_lo), div_rn_fast(et1, sig_lo, inv_lo));
                pa[j][2 * h + 1] = f32x2_to_e4m3_as_f16x2(div_rn_fast(et2, sig_hi, inv_hi), div_rn_fast(et3, sig_hi, inv_hi));
            }
        }

        // ---- PV: O += P (16 x tokens) . V (tokens x 256 of this half) ----------------------
        const unsigned char* v_base = page + tok0 * kTokenBytes + half * 256;
#pragma unroll
        for (int j = 0; j < kNTiles / 2; ++j) {
#pragma unroll
            for (int q = 0; q < kOutTilesPerWarp / 2; q += 2) {
                unsigned vb[4];  // (tokens 0-7, chunk q), (tokens 8-15, chunk q), same for q+1
                const int token = 16 * j + 8 * ((lane / 8) % 2) + lane % 8;
                ldmatrix_x4_trans(vb, v_base + token * kTokenBytes + (q + lane / 16) * kChunk);
                constexpr unsigned kSplitDims = 0x3120;  // (even dim: tok 2c, 2c+1 | odd dim: ...)
                const unsigned v0 = prmt(vb[0], 0, kSplitDims), v1 = prmt(vb[1], 0, kSplitDims);
                const unsigned v2 = prmt(vb[2], 0, kSplitDims), v3 = prmt(vb[3], 0, kSplitDims);
                mma_f16_16816(o_acc[2 * q], pa[j], e4m3x2_to_f16x2(v0), e4m3x2_to_f16x2(v1));
                mma_f16_16816(o_acc[2 * q + 1], pa[j], e4m3x2_hi_to_f16x2(v0), e4m3x2_hi_to_f16x2(v1));
                mma_f16_16816(o_acc[2 * q + 2], pa[j], e4m3x2_to_f16x2(v2), e4m3x2_to_f16x2(v3));
                mma_f16_16816(o_acc[2 * q + 3], pa[j], e4m3x2_hi_to_f16x2(v2), e4m3x2_hi_to_f16x2(v3));
            }
        }
    }

    // ---- sum the token groups' O and L (same m, same sigma: one scale domain) --------------
    float lsum_lo = quad_sum(l_lo), lsum_hi = quad_sum(l_hi);
    if constexpr (KV_SPLIT > 1) {
        float4* scratch = reinterpret_cast<float4*>(pages_s);
        const int slot = (half * ROW_GROUPS + group) * 32 * (kOutTilesPerWarp + 1);
        for (int k = 1; k < KV_SPLIT; ++k) {
            __syncthreads();  // pages (or the previous round) no longer read
            if (kvg == k) {
#pragma unroll
                for (int i = 0; i < kOutTilesPerWarp; ++i)
                    scratch[slot + i * 32 + lane] = make_float4(o_acc[i][0], o_acc[i][1], o_acc[i][2], o_acc[i][3]);
                scratch[slot + kOutTilesPerWarp * 32 + lane] = make_float4(lsum_lo, lsum_hi, 0.f, 0.f);
            }
            __syncthreads();
            if (kvg == 0) {
#pragma unroll
                for (int i = 0; i < kOutTilesPerWarp; ++i) {
                    const float4 o = scratch[slot + i * 32 + lane];
                    o_acc[i][0] += o.x; o_acc[i][1] += o.y; o_acc[i][2] += o.z; o_acc[i][3] += o.w;
                }
                const float4 l = scratch[slot + kOutTilesPerWarp * 32 + lane];
                lsum_lo += l.x;
                lsum_hi += l.y;
            }
        }
        if (kvg != 0) return;
    }

    // ---- epilogue: out = O / L, lse = m + log(sigma * L) -------------------------------------
    const bool to_partial = work.partial >= 0;
    const bool has_lo = m_lo > -INFINITY, has_hi = m_hi > -INFINITY;
    const float rcp_lo = has_lo ? 1.f / lsum_lo : 0.f, rcp_hi = has_hi ? 1.f / lsum_hi : 0.f;
    const long part_rows = static_cast<long>(work.partial) * rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? row_lo : row_hi;
        if (row >= rows) continue;
        const float inv = r == 0 ? rcp_lo : rcp_hi;
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

}  // namespace fp8
}  // namespace snapmla

// Arguments are passed one by one (CuPy launches take scalars and pointers, not structs).
extern "C" __global__ void __launch_bounds__(snapmla::fp8::kThreads, MIN_CTAS_PER_SM)
snapmla_decode_fp8(const unsigned char* q_content, const float* q_scale,
                   const __nv_bfloat16* q_rope, const unsigned char* k_cache,
                   const int* block_table, const int* cache_seqlens,
                   const snapmla::WorkItem* work_list, int /*items_per_column: one item per CTA*/,
                   __nv_bfloat16* out, float* lse, float* partial_out, float* partial_lse,
                   int block_table_stride, float softmax_scale_log2, int h_q, int s_q, int causal) {
    extern __shared__ __align__(128) unsigned char smem[];
    snapmla::launch_dependents();  // the combine may launch now; it waits for this grid to finish
    const snapmla::fp8::Params p{q_content, q_scale, q_rope, k_cache, block_table, cache_seqlens,
                                 work_list, out, lse, partial_out, partial_lse, block_table_stride,
                                 softmax_scale_log2, snapmla::DecodeShape{h_q, s_q, causal}};
    snapmla::fp8::run(p, smem);
}
