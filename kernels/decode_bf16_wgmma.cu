// BF16 split-KV decode on Hopper warpgroup MMA (HGMMA) and TMA: the baseline the FP8 kernel's
// speed-ups are quoted against (issue 7: "a weak baseline makes every ratio a lie").
//
// CTA = two consumer warpgroups + one producer warpgroup; it owns 64 query rows (s_q and heads
// flattened, padding rows zero) of one work item (request, KV blocks [begin, end)). The rows are
// wgmma's M = 64 in both GEMMs, so a row's 64 logits of a page sit in the 4 threads of a quad.
//   QK:  S[64 rows x 64 tokens] = Q[64 x 576] . K[64 x 576]^T, 36 HGMMA m64n64k16, both
//        operands K-major from shared memory (Q: nine 128-byte-swizzled 64 x 64 tiles loaded
//        once; K: the page's nine tiles as TMA writes them).
//   PV:  O[64 rows x 256 dims] += P[64 x 64 tokens] . V[64 tokens x 256 dims] per warpgroup
//        (warpgroup wg owns dims [256 wg, 256 wg + 256)), 4 HGMMA m64n256k16. V is the page's
//        content read in place as an MN-major B operand (bf16 wgmma's transpose flag): no
//        transposed copy. P is the A operand from registers (the S accumulator converts to the
//        bf16 A fragment in place) for the warpgroup that computed it, from shared memory for
//        the other.
// Schedule (alternate pages, as the FP8 kernel's WG_MODE 4): warpgroup wg computes QK and the
// softmax of blocks wg, wg + 2, ..., and PV of every block for its dims. A turn of warpgroup wg
// at block it: wait for the other warpgroup's hand-over of block it - 1 (P, the row state m and
// gamma) and issue PV(it - 1) with that P from shared memory; QK(it) behind it (page it went
// into the slot page it - 2 left at the end of this warpgroup's last turn: PV(it - 1) gives its
// load time, HANDOVER_FIRST; measured 1.07-1.17x); softmax(it) in registers; store P(it) and
// the new row state, hand them over; PV(it) from
// registers. Blocks enter O in strictly increasing order, each after O is rescaled by its
// gamma = exp2(m_before - m_after). One P buffer suffices: P(it) is stored after this
// warpgroup's PV(it - 1), the only reader of P(it - 1), has completed; the other warpgroup
// reads P(it) before it stores P(it + 1).
// Shared memory: Q 72 KB + two 72 KB pages + P 8 KB (the 227 KB limit allows two stages). With
// so few pages in flight, a page's parts are loaded and released separately, each as soon as
// its last reader is done: the RoPE tile after the owner's QK, each warpgroup's 256 V dims
// after that warpgroup's PV (which follows the owner's QK); the next page's QK takes them in
// the same order.
// Unused cache rows of a request's last page may hold anything (NaN bytes): S is masked by a
// select, and the page's V rows past the valid tokens are zeroed in shared memory before any PV
// reads them (P is 0 there, but 0 x NaN is NaN inside the tensor core).
#include "common/warp_roles.cuh"
#include "decode_common.cuh"

#ifndef ROW_GROUPS
#define ROW_GROUPS 4  // query rows per CTA / 16: the rows are wgmma's M = 64
#endif
#ifndef STAGES
#define STAGES 2  // pages in flight per CTA
#endif
#ifndef COLUMN_ITEMS
#define COLUMN_ITEMS 0  // 1: a CTA runs the column of work items its list row starts (see WorkItem)
#endif
#ifndef CLUSTER_FOLD
#define CLUSTER_FOLD 0  // 1: a request's splits run as one cluster and merge through shared memory
#endif
#ifndef MIN_CTAS_PER_SM
#define MIN_CTAS_PER_SM 1
#endif
// 1: a turn takes the other warpgroup's hand-over and issues PV(it - 1) before QK(it), so that
// the load of page it (into the slot page it - 2 just left) has PV(it - 1) to hide behind; 0:
// QK(it) first and PV(it - 1) under the softmax (the first version)
#ifndef HANDOVER_FIRST
#define HANDOVER_FIRST 1
#endif

namespace snapmla {
namespace bf16wg {

constexpr bool kColumnItems = COLUMN_ITEMS;
constexpr bool kClusterFold = CLUSTER_FOLD != 0;
constexpr int kRows = 16 * ROW_GROUPS;
// CTA roles and the register split: common/warp_roles.cuh
using roles::kConsumerThreads;
using roles::kThreads;
using roles::kWgThreads;
constexpr int kConsumerRegs = roles::consumer_regs(MIN_CTAS_PER_SM);
constexpr int kElemBytes = 2;
constexpr int kBox = 128;                              // TMA box width in bytes (= swizzle span)
constexpr int kBoxElems = kBox / kElemBytes;           // 64 dims per tile
constexpr int kTiles = D_QK / kBoxElems;               // 9 tiles per token row
constexpr int kVTiles = kDimV / kBoxElems;             // 8 content (V) tiles
constexpr int kTileBytes = kPageTokens * kBox;         // 8192: one 64 x 128 B box
constexpr int kPageBytes = kTiles * kTileBytes;        // 73728
constexpr int kQTileBytes = kRows * kBox;
constexpr int kQBytes = kTiles * kQTileBytes;
constexpr int kSwizzleAtom = 8 * kBox;                 // 1024: 8 rows of 128 B
constexpr int kKStep = 16;                             // bf16 elements per wgmma k-step
constexpr int kKStepBytes = kKStep * kElemBytes;       // 32
constexpr int kKStepsPerTile = kBox / kKStepBytes;     // 4
constexpr int kPvKSteps = kPageTokens / kKStep;        // 4
constexpr int kWgDims = kDimV / 2;                     // 256 output dims per warpgroup
constexpr int kWgVTiles = kWgDims / kBoxElems;         // 4
constexpr int kSAcc = kPageTokens / 2;                 // S floats per thread (m64n64)
constexpr int kOAcc = kWgDims / 2;                     // O floats per thread (m64n256)
constexpr int kPBytes = kRows * kBox;                  // P[64 rows x 64 tokens] bf16, one tile
constexpr int kRowsPerThread = 2;                      // rows 16 w + g and 16 w + g + 8
// a page's parts, each with its own full / empty barrier: the RoPE tile (read by the owner's
// QK only), then the V dims of warpgroup 0 and of warpgroup 1 (each also read by the QK)
constexpr int kParts = 3;
constexpr int kPartRope = 0;
__host__ __device__ constexpr int part_first_tile(int part) { return part == kPartRope ? kVTiles : (part - 1) * kWgVTiles; }
__host__ __device__ constexpr int part_tiles(int part) { return part == kPartRope ? 1 : kWgVTiles; }
constexpr int kPartWarps = 4;  // a part is released by one warpgroup's 4 warps
// named barriers (0 = __syncthreads): consumers; hand-over to warpgroup wg; warpgroup wg alone
constexpr int kBarConsumers = 1, kBarHand0 = 2, kBarWg0 = 4;

// shared memory map (offsets from a 1024-aligned base); the L sums reuse the P tile at the end
constexpr int kOffQ = 0;
constexpr int kOffStages = kOffQ + kQBytes;
constexpr int kOffP = kOffStages + STAGES * kPageBytes;
constexpr int kOffRowState = kOffP + kPBytes;          // per row: m, gamma of the last block
constexpr int kOffBars = kOffRowState + kRows * 8;
constexpr int kSmemBytes = kOffBars + 2 * STAGES * kParts * 8;
constexpr int kSmemAlign = 1024;
constexpr int kMaxSmemPerCta = 232448;

static_assert(kRows == 64, "the rows are wgmma's M = 64: ROW_GROUPS is 4");
static_assert(!CLUSTER_FOLD || !COLUMN_ITEMS, "a cluster holds one request's splits, one item per CTA");
static_assert(!kClusterFold || cluster_partial_bytes(kRows) <= STAGES * kPageBytes, "a cluster split's rows fit in the stages");
static_assert(kQTileBytes == kTileBytes, "Q and K tiles share k-step offsets");
static_assert(STAGES >= 2, "the pipeline needs two stages");
static_assert(kSmemBytes + kSmemAlign <= kMaxSmemPerCta, "STAGES pages of 72 KB exceed shared memory");
static_assert(2 * kRows * 4 <= kPBytes, "the L sums fit in the P tile");
static_assert(fold_scratch_floats(kRows) * 4 <= kQBytes, "the folded merge's weights fit in Q's tiles");
static_assert(roles::split_fits(MIN_CTAS_PER_SM), "consumers may only take the registers the producer gave back");
#ifdef SNAPMLA_EXPECT_SMEM  // the host's launch size (ops/decode_config.py bf16_wgmma_smem_bytes)
static_assert(kSmemBytes + kSmemAlign == SNAPMLA_EXPECT_SMEM, "host shared-memory formula is out of date");
#endif

struct Params {
    const __nv_bfloat16* q;     // [b, s_q, h_q, 576]
    const unsigned char* tmap;  // CUtensorMap: 64 rows x 128 B boxes, 128-byte swizzle
    const int* block_table;
    const int* cache_seqlens;
    const WorkItem* work;
    int items_per_column;
    __nv_bfloat16* out;
    float* lse;
    float* partial_out;
    float* partial_lse;
    int block_table_stride;
    float softmax_scale_log2;
    DecodeShape shape;
    SplitFold fold;  // arrivals nullptr: the combine kernel merges the splits
};

// Producer: one lane streams the pages of [block_begin, block_end) through the stages.
// `base`: the CTA's pages before this work item (a multiple of STAGES: see roles::run_column),
// whose stages the first pages of this item wait for as well.
__device__ __forceinline__ void produce(const Params& p, unsigned char* smem, unsigned long long* full,
                                        unsigned long long* empty, const int* table, int block_begin,
                                        int num_blocks, int base) {
    prefetch_tensor_map(p.tmap);
    for (int it = 0; it < num_blocks; ++it) {
        const int stage = it % STAGES;
        const int row = table[block_begin + it] * kPageTokens;
        unsigned char* dst = smem + kOffStages + stage * kPageBytes;
        // the part the owner's QK frees first goes first: the RoPE tile, the owner's V dims, the
        // other warpgroup's
        const int owner = it & 1;
        const int order[kParts] = {kPartRope, 1 + owner, 2 - owner};
#pragma unroll
        for (int k = 0; k < kParts; ++k) {
            const int part = order[k], bar = stage * kParts + part;
            if (base + it >= STAGES) mbarrier_wait_parity(&empty[bar], (((base + it) / STAGES) - 1) & 1);
            mbarrier_arrive_expect_tx(&full[bar], part_tiles(part) * kTileBytes);
            for (int t = part_first_tile(part); t < part_first_tile(part) + part_tiles(part); ++t)
                tma_load_2d(dst + t * kTileBytes, p.tmap, t * kBox, row, &full[bar]);
        }
    }
}

// Q rows of this CTA into nine 128-byte-swizzled K-major tiles; padding rows are zero.
__device__ __forceinline__ void load_q(unsigned char* q_s, const Params& p, long row_base, int row0,
                                       int rows, int tid) {
    constexpr int kChunksPerTile = kBox / VEC_BYTES;           // 8
    constexpr int kChunksPerRow = kTiles * kChunksPerTile;     // 72
    const unsigned char* q = reinterpret_cast<const unsigned char*>(p.q);
    for (int i = tid; i < kRows * kChunksPerRow; i += kConsumerThreads) {
        const int r = i / kChunksPerRow, k = i % kChunksPerRow;
        const bool valid = row0 + r < rows;
        const long grow = row_base + (valid ? row0 + r : 0);
        const int tile = k / kChunksPerTile, byte = (k % kChunksPerTile) * VEC_BYTES;
        cp_async_16(q_s + tile * kQTileBytes + swz128(r, byte), q + grow * (D_QK * kElemBytes) + tile * kBox + byte,
                    valid);
    }
    cp_async_commit();
    cp_async_wait<0>();
}

__device__ __forceinline__ void consume(const Params& p, unsigned char* smem, unsigned long long* full,
                                        unsigned long long* empty, int item, int block_begin,
                                        int num_blocks, int seqlen, int rows, int row0, long row_base,
                                        int req, int phase) {
    const int tid = static_cast<int>(threadIdx.x) + (kColumnItems ? loop_zero() : 0);
    // warp-uniform as far as ptxas knows (a branch on wg around wgmmas must not serialize them)
    const int wg = __shfl_sync(FULL_MASK, tid / kWgThreads, 0);
    const int w = (tid / 32) % 4, lane = tid % 32, g = lane / 4, c = lane % 4;
    unsigned char* q_s = smem + kOffQ;
    unsigned char* p_s = smem + kOffP;
    float2* rowstate_s = reinterpret_cast<float2*>(smem + kOffRowState);
    if (tid < kRows) rowstate_s[tid] = make_float2(-INFINITY, 1.f);
    load_q(q_s, p, row_base, row0, rows, tid);
    fence_proxy_async_shared();  // Q was written by cp.async (generic proxy); wgmma reads it
    named_barrier_sync(kBarConsumers, kConsumerThreads);

    int row_of[kRowsPerThread], vis[kRowsPerThread];
#pragma unroll
    for (int h = 0; h < kRowsPerThread; ++h) {
        row_of[h] = 16 * w + g + 8 * h;
        vis[h] = visible_keys(row0 + row_of[h], rows, seqlen, p.shape);
    }
    const float scale = p.softmax_scale_log2;
    float l_run[kRowsPerThread] = {0.f, 0.f};  // this thread's share of L over its own blocks
    float m_run[kRowsPerThread] = {-INFINITY, -INFINITY};
    float o[kOAcc];
#pragma unroll
    for (int i = 0; i < kOAcc; ++i) o[i] = 0.f;

    const unsigned long long q_desc = make_smem_desc(q_s, kSwizzle128B, kSwizzleAtom);
    auto page_of = [&](int it) { return smem + kOffStages + (it % STAGES) * kPageBytes; };
    auto valid_of = [&](int it) { return min(kPageTokens, seqlen - (block_begin + it) * kPageTokens); };

    // O = gamma O, then O += P V(it) for this warpgroup's dims; the page goes back to the producer
    auto rescale_o = [&](const float (&gamma)[kRowsPerThread]) {
#pragma unroll
        for (int i = 0; i < kOAcc; ++i) o[i] *= gamma[(i / 2) % 2];
    };
    auto v_desc = [&](int it, int ks) {
        // B = V[16 tokens x 256 dims]: 64-dim tiles kWgVTiles apart by kTileBytes, 8-token groups
        // 1024 B apart; k-step ks starts 16 tokens (2 KB) further
        return make_smem_desc_mn(page_of(it) + wg * kWgVTiles * kTileBytes + ks * kKStep * kBox, kTileBytes,
                                 kSwizzleAtom);
    };
    // this warpgroup is done with part `part` of block it's page (its empty barrier counts the
    // 4 warps of the one warpgroup that releases it)
    auto release = [&](int it, int part) {
        if (lane == 0) mbarrier_arrive(&empty[(it % STAGES) * kParts + part]);
    };
    auto wait_part = [&](int it, int part) {
        // the item's round it / STAGES after its first, of parity `phase` (roles::run_column)
        mbarrier_wait_parity(&full[(it % STAGES) * kParts + part], ((it / STAGES) ^ phase) & 1);
    };
    const int own_part = 1 + wg, other_part = 2 - wg;

    for (int it = wg; it <= num_blocks; it += 2) {
        const bool mine = it < num_blocks;
        float s[kSAcc];
        // QK(it), zeroing V past a partial page's valid tokens; its wgmmas are waited for by the
        // caller
        auto qk_page = [&]() {
            // ---- QK(it), the page's parts in their load order: RoPE, own V dims, other V dims ----
            unsigned char* page = page_of(it);
            const unsigned long long k_desc = make_smem_desc(page, kSwizzle128B, kSwizzleAtom);
#pragma unroll
            for (int k = 0; k < kParts; ++k) {
                const int part = k == 0 ? kPartRope : k == 1 ? own_part : other_part;
                const int tiles = k == 0 ? 1 : kWgVTiles;  // a literal once unrolled
                const int first = part_first_tile(part);
                wait_part(it, part);
                wgmma_fence();
#pragma unroll
                for (int t = 0; t < tiles; ++t)
#pragma unroll
                    for (int kk = 0; kk < kKStepsPerTile; ++kk) {
                        const int off = ((first + t) * kTileBytes + kk * kKStepBytes) >> 4;  // same for Q and K
                        wgmma_bf16_ss(s, q_desc + off, k_desc + off, k > 0 || t > 0 || kk > 0);
                    }
                wgmma_commit();
            }
            // a request's last page: its unused rows may hold NaN bytes; zero V past the valid
            // tokens before any PV reads them (the other warpgroup's PV follows the hand-over)
            const int valid = valid_of(it);
            if (valid < kPageTokens) {
                const int wtid = tid % kWgThreads;
                const int bytes = (kPageTokens - valid) * kBox;  // swizzle keeps rows whole
                for (int i = wtid * VEC_BYTES; i < kVTiles * bytes; i += kWgThreads * VEC_BYTES) {
                    const int t = i / bytes, off = i % bytes;
                    *reinterpret_cast<uint4*>(page + t * kTileBytes + valid * kBox + off) = make_uint4(0, 0, 0, 0);
                }
            }
        };
        // ---- hand-over of block it - 1 (P, m, gamma) and the issue of PV(it - 1) ---------------
        float gamma_prev[kRowsPerThread] = {1.f, 1.f};
        auto take_handover = [&]() {
            named_barrier_sync(kBarHand0 + wg, kConsumerThreads);
#pragma unroll
            for (int h = 0; h < kRowsPerThread; ++h) {
                const float2 st = rowstate_s[row_of[h]];
                m_run[h] = st.x;
                gamma_prev[h] = st.y;
            }
            // the other warpgroup waited for this page; the completed phase is this warpgroup's
            // proof that the TMA bytes are visible (the part is not refilled before this PV)
            wait_part(it - 1, own_part);
            rescale_o(gamma_prev);
            const unsigned long long p_desc = make_smem_desc(p_s, kSwizzle128B, kSwizzleAtom);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kPvKSteps; ++ks)
                wgmma_bf16_ss_tb(o, p_desc + ((ks * kKStepBytes) >> 4), v_desc(it - 1, ks), 1);
            wgmma_commit();
        };
        // PV(it - 1) done: P(it - 1) read, this warpgroup's V dims of the page free (the wait is
        // unconditional: ptxas does not pair it with the issue under the same condition above,
        // and serializes every wgmma of the kernel otherwise, C7514)
        auto finish_pv_prev = [&]() {
            wgmma_wait<0>();
            fence_accumulators(o);
            if (it > 0) release(it - 1, own_part);
        };
        auto finish_qk = [&]() {
            wgmma_wait<0>();
            fence_accumulators(s);
            release(it, kPartRope);  // the RoPE tile's only reader was this QK
        };
        if constexpr (HANDOVER_FIRST) {
            if (it > 0) take_handover();
            if (mine) qk_page();
            if (mine) finish_qk();  // PV(it - 1) too (the older group)
            finish_pv_prev();
        } else {
            if (mine) {
                qk_page();
                finish_qk();
            }
            if (it > 0) take_handover();
        }
        // ---- softmax of block it (rows = M: thread (w, g, c) holds rows 16w + g + 8h at tokens
        // 8j + 2c + e, s[4j + 2h + e]) ------------------------------------------------------------
        float gamma[kRowsPerThread] = {1.f, 1.f};
        unsigned pfrag[kPvKSteps][4];
        if (mine) {
            const int page_first = (block_begin + it) * kPageTokens;
            const bool whole = page_first + kPageTokens <= min(vis[0], vis[1]);
            float bmax[kRowsPerThread] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int i = 0; i < kSAcc; ++i) {
                const int h = (i / 2) % 2, tok = 8 * (i / 4) + 2 * c + i % 2;
                if (!whole && page_first + tok >= vis[h]) s[i] = -INFINITY;
                bmax[h] = fmaxf(bmax[h], s[i]);
            }
            quad_max2(bmax[0], bmax[1]);
            float mnew[kRowsPerThread], esum[kRowsPerThread] = {0.f, 0.f};
            bool act[kRowsPerThread];
#pragma unroll
            for (int h = 0; h < kRowsPerThread; ++h) {
                act[h] = bmax[h] > -INFINITY;
                mnew[h] = act[h] ? fmaxf(m_run[h], bmax[h] * scale) : m_run[h];
                gamma[h] = !act[h] ? 1.f : (m_run[h] == -INFINITY ? 0.f : fast_exp2(m_run[h] - mnew[h]));
            }
#pragma unroll
            for (int i = 0; i < kSAcc; ++i) {
                const int h = (i / 2) % 2;
                const float e = whole || (act[h] && s[i] > -INFINITY) ? fast_exp2(fmaf(s[i], scale, -mnew[h])) : 0.f;
                esum[h] += e;
                s[i] = e;
            }
#pragma unroll
            for (int h = 0; h < kRowsPerThread; ++h) {
                // this warpgroup's L share last saw block it - 2: rescale by both gammas
                l_run[h] = gamma[h] * gamma_prev[h] * l_run[h] + esum[h];
                m_run[h] = mnew[h];
            }
            // P as the bf16 A fragment of k-step ks (tokens 16 ks ..): the S accumulator's n-tiles
            // 2 ks and 2 ks + 1 in place
#pragma unroll
            for (int ks = 0; ks < kPvKSteps; ++ks) {
                const float* e = s + 8 * ks;
                pfrag[ks][0] = pack_bf16x2(e[0], e[1]);
                pfrag[ks][1] = pack_bf16x2(e[2], e[3]);
                pfrag[ks][2] = pack_bf16x2(e[4], e[5]);
                pfrag[ks][3] = pack_bf16x2(e[6], e[7]);
            }
        }
        if constexpr (!HANDOVER_FIRST) finish_pv_prev();  // PV(it - 1) ran under the softmax
        // ---- hand P(it) and the row state over, then PV(it) from registers -------------------
        if (mine) {
            __syncwarp();  // the quad's other lanes read rowstate_s above
            if (c == 0) {
#pragma unroll
                for (int h = 0; h < kRowsPerThread; ++h) rowstate_s[row_of[h]] = make_float2(m_run[h], gamma[h]);
            }
            // P[row][token]: thread's A fragment words are (row, tokens 16ks + 2c + {0, 1, 8, 9})
#pragma unroll
            for (int ks = 0; ks < kPvKSteps; ++ks)
#pragma unroll
                for (int h = 0; h < kRowsPerThread; ++h) {
                    const int byte = (kKStep * ks + 2 * c) * kElemBytes;
                    *reinterpret_cast<unsigned*>(p_s + swz128(row_of[h], byte)) = pfrag[ks][h];
                    *reinterpret_cast<unsigned*>(p_s + swz128(row_of[h], byte + 8 * kElemBytes)) = pfrag[ks][2 + h];
                }
            fence_proxy_async_shared();  // P and the zeroed V rows (generic stores) are read by wgmma
            named_barrier_arrive(kBarHand0 + (wg ^ 1), kConsumerThreads);
            // the arrive (release) / sync (acquire) pair orders the hand-over; compute-sanitizer's
            // racecheck only sees it when the arriving warps also meet at a barrier (63k false
            // RAW reports on the row state without this one, none with it)
            named_barrier_sync(kBarWg0 + wg, kWgThreads);
            rescale_o(gamma);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kPvKSteps; ++ks) wgmma_bf16_rs_tb(o, pfrag[ks], v_desc(it, ks), 1);
            wgmma_commit();
            wgmma_wait<0>();
            fence_accumulators(o);
            release(it, own_part);
        }
    }

    // ---- L per row: the warpgroup that saw the last block adds the other's share, rescaled by
    // the last block's gamma; both warpgroups finish the loop (every read of P) before the L
    // sums reuse the P tile --------------------------------------------------------------------
    named_barrier_sync(kBarConsumers, kConsumerThreads);
    float* lsum_s = reinterpret_cast<float*>(p_s);  // [2 warpgroups][64 rows]
#pragma unroll
    for (int h = 0; h < kRowsPerThread; ++h) {
        const float lq = quad_sum(l_run[h]);
        if (c == 0) lsum_s[wg * kRows + row_of[h]] = lq;
    }
    named_barrier_sync(kBarConsumers, kConsumerThreads);
    const int last = (num_blocks - 1) & 1;
    float total[kRowsPerThread], rcp[kRowsPerThread];
#pragma unroll
    for (int h = 0; h < kRowsPerThread; ++h) {
        const float2 st = rowstate_s[row_of[h]];  // m and gamma after the last block
        m_run[h] = st.x;
        total[h] = num_blocks == 0 ? 0.f : lsum_s[last * kRows + row_of[h]] + st.y * lsum_s[(last ^ 1) * kRows + row_of[h]];
        rcp[h] = total[h] > 0.f ? 1.f / total[h] : 0.f;
    }

    // ---- epilogue: out = O / L (dims 256 wg + 8j + 2c, + 1), lse = m ln2 + log(L) ---------------
    const int partial = __ldg(&p.work[kColumnItems ? item : static_cast<int>(blockIdx.y)].partial);
    const bool to_partial = partial >= 0;
    const long part_rows = static_cast<long>(partial) * rows;
    // CLUSTER_FOLD: a split's rows go to its own stages (free: both warpgroups passed the barrier
    // after the page loop), merged across the cluster below (decode_fp8_wgmma.cu does the same)
    const bool to_cluster = kClusterFold && to_partial;
    float* cluster_rows = reinterpret_cast<float*>(smem + kOffStages);
    float* const partial_out = kClusterFold ? cluster_rows : p.partial_out;
#pragma unroll
    for (int h = 0; h < kRowsPerThread; ++h) {
        const int row = row0 + row_of[h];
        if (row >= rows) continue;
        const long base = to_partial ? (kClusterFold ? row_of[h] * kClusterRowStride : (part_rows + row) * kDimV)
                                     : (row_base + row) * kDimV;
#pragma unroll
        for (int j = 0; j < kOAcc / 4; ++j) {
            const int dim = wg * kWgDims + 8 * j + 2 * c;
            store_out2(p.out, partial_out, base + dim, to_partial, o[4 * j + 2 * h] * rcp[h],
                       o[4 * j + 2 * h + 1] * rcp[h]);
        }
        if (wg == 0 && c == 0) {
            const float value = m_run[h] > -INFINITY ? m_run[h] * kLn2 + logf(total[h])
                                                     : (to_partial ? -INFINITY : INFINITY);
            if (to_cluster) cluster_rows[kRows * kClusterRowStride + row_of[h]] = value;
            else if (to_partial) p.partial_lse[part_rows + row] = value;
            else p.lse[lse_index(req, row, p.shape)] = value;
        }
    }
    // the cluster merges its splits together; otherwise the last split of the request to get
    // here merges them all (Q's tiles are free now)
    if (to_cluster)
        cluster_fold<kConsumerThreads, kRows>(cluster_rows, cluster_size(), cluster_rank(), req, row0, rows, p.out, p.lse,
                                              p.shape, tid, kBarConsumers, reinterpret_cast<float*>(smem + kOffQ));
    else if (to_partial && num_blocks > 0 && p.fold.arrivals != nullptr)
        fold_split<kConsumerThreads, kRows>(p.fold, req, row0, rows, p.partial_out, p.partial_lse, p.out, p.lse,
                                            p.shape, tid, kBarConsumers, reinterpret_cast<float*>(smem + kOffQ));
}

// smem: smem_raw rounded up to the swizzle atom at the kernel's entry
__device__ __forceinline__ void run(const Params& p, unsigned char* smem, unsigned char* smem_raw) {
    const int rows = p.shape.s_q * p.shape.h_q;
    const int row0 = blockIdx.x * kRows;
    if (row0 >= rows) return;
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + kOffBars);
    unsigned long long* empty = full + STAGES * kParts;
    roles::init_pipeline_barriers(full, empty, STAGES * kParts, kPartWarps);
    auto producer = [&p, smem, full, empty](const int* table, int begin, int n, int base) {
        produce(p, smem, full, empty, table, begin, n, base);
    };
    // a column's items: what the consumers derive from the CTA and shared memory's base is
    // derived again for each item (loop_zero), not carried through the item in registers
    auto consumer = [&p, smem_raw](int item, int begin, int n, int seqlen, int req, int phase) {
        const int zero = loop_zero();
        // roles::aligned_smem written out: through the helper ptxas allocates this kernel
        // differently (SASS checked; the GPU-tested build is this one)
        const unsigned base = smem_addr(smem_raw + zero);
        unsigned char* s = smem_raw + zero + ((kSmemAlign - (base % kSmemAlign)) % kSmemAlign);
        unsigned long long* f = reinterpret_cast<unsigned long long*>(s + kOffBars);
        const int rows = p.shape.s_q * p.shape.h_q + zero;
        consume(p, s, f, f + STAGES * kParts, item, begin, n, seqlen, rows,
                (static_cast<int>(blockIdx.x) + zero) * kRows, static_cast<long>(req) * rows, req, phase);
    };
    auto consumer_one = [&p, smem, full, empty, rows, row0](int item, int begin, int n, int seqlen, int req, int) {
        consume(p, smem, full, empty, item, begin, n, seqlen, rows, row0, static_cast<long>(req) * rows, req, 0);
    };
    const roles::Pipeline pipeline{full, empty, STAGES, kParts, kPartWarps, kBarConsumers};
    if constexpr (kColumnItems)
        roles::run_column<true, kConsumerRegs>(p, pipeline, producer, consumer);
    else
        roles::run_column<false, kConsumerRegs>(p, pipeline, producer, consumer_one);
}

}  // namespace bf16wg
}  // namespace snapmla

extern "C" __global__ void __launch_bounds__(snapmla::bf16wg::kThreads, MIN_CTAS_PER_SM)
snapmla_decode_bf16_wgmma(const __nv_bfloat16* q, const unsigned char* tmap, const int* block_table,
                          const int* cache_seqlens, const snapmla::WorkItem* work_list, int items_per_column,
                          __nv_bfloat16* out, float* lse, float* partial_out, float* partial_lse,
                          int block_table_stride, float softmax_scale_log2, int h_q, int s_q,
                          int causal, const int* num_splits, int* arrivals,
                          int fold_max_splits) {
    extern __shared__ unsigned char smem_raw[];
    snapmla::launch_dependents();  // the combine may launch now; it waits for this grid to finish
    // dynamic shared memory is only 16-byte aligned: round up to the swizzle atom
    const unsigned base = snapmla::smem_addr(smem_raw);
    unsigned char* smem = smem_raw + ((snapmla::bf16wg::kSmemAlign - (base % snapmla::bf16wg::kSmemAlign)) %
                                      snapmla::bf16wg::kSmemAlign);
    const snapmla::bf16wg::Params p{q, tmap, block_table, cache_seqlens, work_list, items_per_column, out, lse, partial_out,
                                    partial_lse, block_table_stride, softmax_scale_log2,
                                    snapmla::DecodeShape{h_q, s_q, causal},
                                    snapmla::SplitFold{num_splits, arrivals, fold_max_splits}};
    snapmla::bf16wg::run(p, smem, smem_raw);
}
