// BF16 split-KV decode over the bf16 paged cache [num_blocks, 64, 1, 576]: the baseline every
// speed-up is quoted against when FlashMLA itself is not installed.
//
// Same structure as decode_fp8.cu (row groups of 16 query rows, two warps per group splitting
// the QK reduction and the 512-wide output, partial logits exchanged through shared memory),
// with bf16 operands straight from shared memory through ldmatrix, a plain online softmax and
// bf16 P. BLOCK_N tokens (half a page by default) per pipeline stage keep the bf16 tiles, which
// are 1.76x larger than FP8 ones, inside the shared-memory budget.
#include "decode_common.cuh"

#ifndef ROW_GROUPS
#define ROW_GROUPS 4
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef BLOCK_N
#define BLOCK_N 32  // tokens per stage; divides the 64-token page
#endif
#ifndef MIN_CTAS_PER_SM
#define MIN_CTAS_PER_SM 1
#endif

namespace snapmla {
namespace bf16 {

constexpr int kWarps = 2 * ROW_GROUPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockM = kRowsPerGroup * ROW_GROUPS;
constexpr int kDimQK = D_QK;
constexpr int kRowBytes = kDimQK * 2;                 // 1152
constexpr int kRowStride = kRowBytes + 16;            // padded: conflict-free ldmatrix rows
constexpr int kChunksPerRow = kRowBytes / 16;         // 72
constexpr int kKSteps = kDimQK / 16;                  // 36
constexpr int kKStepsPerHalf = kKSteps / 2;           // 18
constexpr int kNTiles = BLOCK_N / 8;
constexpr int kOutTilesPerWarp = (kDimV / 2) / 8;     // 32
constexpr int kTileBytes = BLOCK_N * kRowStride;
static_assert(kPageTokens % BLOCK_N == 0, "BLOCK_N must divide the page");
static_assert(kNTiles % 2 == 0, "BLOCK_N must be a multiple of 16");
constexpr int kSmemBytes = kBlockM * kRowStride + STAGES * kTileBytes + kWarps * kNTiles * 32 * 16;
constexpr int kMaxSmemPerCta = 232448;  // 227 KB opt-in limit on sm_90
static_assert(kSmemBytes <= kMaxSmemPerCta, "STAGES x ROW_GROUPS x BLOCK_N exceed shared memory");

__device__ __forceinline__ void load_tile(unsigned char* dst, const unsigned char* k_cache,
                                          int page, int page_row, int first_token, int seqlen) {
    const unsigned char* src = k_cache + (static_cast<long>(page) * kPageTokens + page_row) * kRowBytes;
    for (int c = threadIdx.x; c < BLOCK_N * kChunksPerRow; c += kThreads) {
        const int token = c / kChunksPerRow, chunk = c % kChunksPerRow;
        const bool valid = first_token + token < seqlen;
        const unsigned char* s = src + token * kRowBytes + chunk * 16;
        cp_async_16(dst + token * kRowStride + chunk * 16, valid ? s : src, valid);
    }
}

}  // namespace bf16
}  // namespace snapmla

extern "C" __global__ void __launch_bounds__(snapmla::bf16::kThreads, MIN_CTAS_PER_SM)
snapmla_decode_bf16(const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const int* block_table,
                    const int* cache_seqlens, const snapmla::WorkItem* work_list,
                    int /*items_per_column: one item per CTA*/, __nv_bfloat16* out, float* lse,
                    float* partial_out, float* partial_lse, int block_table_stride,
                    float softmax_scale_log2, int h_q, int s_q, int causal) {
    using namespace snapmla;
    using namespace snapmla::bf16;
    launch_dependents();  // the combine may launch now; it waits for this grid to finish
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* q_s = smem;
    unsigned char* tiles_s = q_s + kBlockM * kRowStride;
    float4* exchange_s = reinterpret_cast<float4*>(tiles_s + STAGES * kTileBytes);

    const DecodeShape shape{h_q, s_q, causal};
    const WorkItem work = work_list[blockIdx.y];
    const int req = work.request;
    const int rows = s_q * h_q;
    const int row0 = blockIdx.x * kBlockM;
    if (row0 >= rows) return;
    const int seqlen = cache_seqlens[req];
    const long row_base = static_cast<long>(req) * rows;
    const unsigned char* cache = reinterpret_cast<const unsigned char*>(k_cache);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int half = warp / ROW_GROUPS, group = warp % ROW_GROUPS;
    const int partner = (1 - half) * ROW_GROUPS + group;
    const int g = lane / 4, c = lane % 4;
    const int row_lo = row0 + group * kRowsPerGroup + g, row_hi = row_lo + 8;
    const int vis_lo = visible_keys(row_lo, rows, seqlen, shape);
    const int vis_hi = visible_keys(row_hi, rows, seqlen, shape);
    const int cta_visible = visible_keys(min(row0 + kBlockM, rows) - 1, rows, seqlen, shape);
    const int tile_begin = work.block_begin * (kPageTokens / BLOCK_N);
    const int tile_end = min(work.block_end * (kPageTokens / BLOCK_N), (cta_visible + BLOCK_N - 1) / BLOCK_N);
    const int num_tiles = max(tile_end - tile_begin, 0);
    const int* table = block_table + static_cast<long>(req) * block_table_stride;

    // Q rows (zero past the last row) join the first cp.async group.
    for (int i = threadIdx.x; i < kBlockM * kChunksPerRow; i += kThreads) {
        const int r = i / kChunksPerRow, chunk = i % kChunksPerRow;
        const bool valid = row0 + r < rows;
        const unsigned char* src = reinterpret_cast<const unsigned char*>(q) + (row_base + (valid ? row0 + r : 0)) * kRowBytes;
        cp_async_16(q_s + r * kRowStride + chunk * 16, src + chunk * 16, valid);
    }
    auto issue_tile = [&](int idx) {
        const int tile = tile_begin + idx;
        const int token0 = tile * BLOCK_N;
        load_tile(tiles_s + (idx % STAGES) * kTileBytes, cache, table[token0 / kPageTokens],
                  token0 % kPageTokens, token0, seqlen);
    };
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_tiles) issue_tile(s);
        cp_async_commit();
    }

    float o_acc[kOutTilesPerWarp][4];
#pragma unroll
    for (int i = 0; i < kOutTilesPerWarp; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
    const unsigned char* q_warp = q_s + group * kRowsPerGroup * kRowStride;

    for (int it = 0; it < num_tiles; ++it) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (it + STAGES - 1 < num_tiles) issue_tile(it + STAGES - 1);
        cp_async_commit();
        const unsigned char* tile = tiles_s + (it % STAGES) * kTileBytes;

        float s_acc[kNTiles][4];
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) s_acc[t][0] = s_acc[t][1] = s_acc[t][2] = s_acc[t][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKStepsPerHalf; ++kk) {
            const int ks = half * kKStepsPerHalf + kk;
            unsigned qa[4];
            const int r = (lane % 8) + 8 * ((lane / 8) % 2);
            ldmatrix_x4(qa, q_warp + r * kRowStride + (2 * ks + lane / 16) * 16);
#pragma unroll
            for (int t0 = 0; t0 < kNTiles; t0 += 2) {
                unsigned kb[4];
                const int token = 8 * (t0 + lane / 16) + lane % 8;
                ldmatrix_x4(kb, tile + token * kRowStride + (2 * ks + (lane / 8) % 2) * 16);
                mma_bf16_16816(s_acc[t0], qa, kb[0], kb[1]);
                mma_bf16_16816(s_acc[t0 + 1], qa, kb[2], kb[3]);
            }
        }
        float4* mine = exchange_s + warp * kNTiles * 32;
        const float4* theirs = exchange_s + partner * kNTiles * 32;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t)
            mine[t * 32 + lane] = make_float4(s_acc[t][0], s_acc[t][1], s_acc[t][2], s_acc[t][3]);
        __syncthreads();
        const int first_token = (tile_begin + it) * BLOCK_N;
        float bmax_lo = -INFINITY, bmax_hi = -INFINITY;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
            const float4 o = theirs[t * 32 + lane];
            const float sum[4] = {s_acc[t][0] + o.x, s_acc[t][1] + o.y, s_acc[t][2] + o.z, s_acc[t][3] + o.w};
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int token = first_token + 8 * t + 2 * c + e;
                s_acc[t][e] = token < vis_lo ? sum[e] * softmax_scale_log2 : -INFINITY;
                s_acc[t][2 + e] = token < vis_hi ? sum[2 + e] * softmax_scale_log2 : -INFINITY;
                bmax_lo = fmaxf(bmax_lo, s_acc[t][e]);
                bmax_hi = fmaxf(bmax_hi, s_acc[t][2 + e]);
            }
        }
        const float mnew_lo = fmaxf(m_lo, quad_max(bmax_lo)), mnew_hi = fmaxf(m_hi, quad_max(bmax_hi));
        const float base_lo = mnew_lo == -INFINITY ? 0.f : mnew_lo;
        const float base_hi = mnew_hi == -INFINITY ? 0.f : mnew_hi;
        const float alpha_lo = fast_exp2(m_lo - base_lo), alpha_hi = fast_exp2(m_hi - base_hi);
        m_lo = mnew_lo;
        m_hi = mnew_hi;
        float esum_lo = 0.f, esum_hi = 0.f;
        unsigned pa[kNTiles / 2][4];
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
            const float e0 = fast_exp2(s_acc[t][0] - base_lo), e1 = fast_exp2(s_acc[t][1] - base_lo);
            const float e2 = fast_exp2(s_acc[t][2] - base_hi), e3 = fast_exp2(s_acc[t][3] - base_hi);
            esum_lo += e0 + e1;
            esum_hi += e2 + e3;
            pa[t / 2][(t % 2) * 2] = pack_bf16x2(e0, e1);
            pa[t / 2][(t % 2) * 2 + 1] = pack_bf16x2(e2, e3);
        }
        l_lo = alpha_lo * l_lo + esum_lo;
        l_hi = alpha_hi * l_hi + esum_hi;
#pragma unroll
        for (int i = 0; i < kOutTilesPerWarp; ++i) {
            o_acc[i][0] *= alpha_lo; o_acc[i][1] *= alpha_lo;
            o_acc[i][2] *= alpha_hi; o_acc[i][3] *= alpha_hi;
        }
        const unsigned char* v_base = tile + half * (kDimV / 2) * 2;
#pragma unroll
        for (int j = 0; j < kNTiles / 2; ++j) {
#pragma unroll
            for (int q2 = 0; q2 < kOutTilesPerWarp; q2 += 2) {
                unsigned vb[4];  // (tokens 0-7, dims q2), (8-15, q2), (0-7, q2+1), (8-15, q2+1)
                const int token = 16 * j + 8 * ((lane / 8) % 2) + lane % 8;
                ldmatrix_x4_trans(vb, v_base + token * kRowStride + (q2 + lane / 16) * 16);
                mma_bf16_16816(o_acc[q2], pa[j], vb[0], vb[1]);
                mma_bf16_16816(o_acc[q2 + 1], pa[j], vb[2], vb[3]);
            }
        }
    }
    cp_async_wait<0>();

    const float lsum_lo = quad_sum(l_lo), lsum_hi = quad_sum(l_hi);
    const bool to_partial = work.partial >= 0;
    const long part_rows = static_cast<long>(work.partial) * rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? row_lo : row_hi;
        if (row >= rows) continue;
        const float m = r == 0 ? m_lo : m_hi, lsum = r == 0 ? lsum_lo : lsum_hi;
        const bool has = m > -INFINITY;
        const float inv = has ? 1.f / lsum : 0.f;
        const long base = to_partial ? (part_rows + row) * kDimV : (row_base + row) * kDimV;
#pragma unroll
        for (int q2 = 0; q2 < kOutTilesPerWarp; q2 += 2) {
            // tile q2 holds dims 8*q2 + 2c, +1; tile q2+1 holds the next 8 dims
            const int dim = half * (kDimV / 2) + 8 * q2 + 2 * c;
            if (to_partial) {
                *reinterpret_cast<float2*>(partial_out + base + dim) = make_float2(o_acc[q2][2 * r] * inv, o_acc[q2][2 * r + 1] * inv);
                *reinterpret_cast<float2*>(partial_out + base + dim + 8) = make_float2(o_acc[q2 + 1][2 * r] * inv, o_acc[q2 + 1][2 * r + 1] * inv);
            } else {
                *reinterpret_cast<unsigned*>(out + base + dim) = pack_bf16x2(o_acc[q2][2 * r] * inv, o_acc[q2][2 * r + 1] * inv);
                *reinterpret_cast<unsigned*>(out + base + dim + 8) = pack_bf16x2(o_acc[q2 + 1][2 * r] * inv, o_acc[q2 + 1][2 * r + 1] * inv);
            }
        }
        if (half == 0 && c == 0) {
            const float value = has ? m * kLn2 + logf(lsum) : (to_partial ? -INFINITY : INFINITY);
            if (to_partial) partial_lse[part_rows + row] = value;
            else lse[lse_index(req, row, shape)] = value;
        }
    }
}
