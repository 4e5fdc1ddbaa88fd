// SnapMLA FP8 split-KV decode on Hopper warpgroup MMA (QGMMA / HGMMA) and TMA (SPEC 2, 3, 5).
//
// CTA = two consumer warpgroups + one producer warpgroup; it owns kRows = 16 * ROW_GROUPS query rows
// (s_q and heads flattened) of one work item (request, KV blocks [begin, end)).
//
// The GEMMs run transposed ("swap AB") so that the token dimension is wgmma's M = 64 and the
// query rows are N (8 .. 64): a 16-row decode pays for 16 rows, not for a 64-row tile.
//   QK:  S^T[64 tokens x rows] = K[64 x 576] . Q[rows x 576]^T. A = the page's K from shared
//        memory, B = Q from shared memory; both K-major, as FP8 wgmma needs. Eight E4M3 content
//        k-steps (QGMMA m64nNk32) and four bf16 RoPE k-steps (HGMMA m64nNk16) run into one
//        float32 accumulator: the RoPE halves are pre-scaled by 1/scale (pre-scaled domain
//        alignment), so content and RoPE sum before the per-row / per-token scales.
//        Consumer warpgroup wg computes rows [wg * kRows/2, (wg + 1) * kRows/2) (WG_MODE 3 / 4:
//        all rows of every other page).
//   PV:  O^T[512 dims x rows] += V^T[dims x 64 tokens] . P^T. V is the same E4M3 content; its
//        K-major (token-contiguous) A fragments are built in registers from the swizzled page
//        with ldmatrix.trans on byte pairs + byte permutes, so no transposed copy is stored.
//        The token order inside each 16-token group is permuted (the order of a reduction's
//        terms), and P^T is written to shared memory in the same permuted order.
//        WG_MODE = 0: warpgroup wg owns output dims [256 wg, 256 wg + 256) for all kRows
//        rows, so both warpgroups meet once per page to share P^T and gamma.
//        WG_MODE = 1: warpgroup wg owns all 512 dims of its own rows; the warpgroups never
//        wait for each other (twice the V^T fragment building, PV at N = kRows / 2).
//        WG_MODE = 2: as 1, and the warpgroups take turns on the tensor cores (ping-pong), so
//        that one's softmax runs while the other's GEMMs do.
//        WG_MODE = 3 (alternate pages): warpgroup wg computes QK and the softmax of the pages
//        it = wg, wg + 2, ... for all kRows rows (QK at N = kRows reads each K page once), and
//        PV of every page for its 256 output dims, as in mode 0. The running row state (m,
//        sigma) passes between the warpgroups through shared memory once per page, so one
//        warpgroup's softmax runs while the other's QK and PV keep the tensor cores busy, and
//        blocks still enter O in strictly increasing order.
//        WG_MODE = 4 (alternate pages, rows = M; 64 rows only): as 3, but QK runs unswapped,
//        S[64 rows x 64 tokens] = Q . K^T (A = Q, B = the page's K, both from shared memory),
//        so that each row's 64 logits sit in the 4 threads of one quad: the block statistics
//        are two quad shuffles, with no shared-memory exchange and no barrier inside the
//        softmax. P^T goes to shared memory in PV's permuted token order straight from the
//        accumulator (each thread's tokens 16h + {2c, 2c+1, 2c+8, 2c+9} are the 4 bytes at
//        16h + 4c); PV and O are those of mode 3.
//        WG_MODE = 6 (rows = M throughout; 64 rows only): mode 4's QK and softmax, and PV
//        unswapped as well, O[64 rows x 256 dims] += P . V with A = P and B = V^T both from
//        shared memory. FP8 wgmma wants B K-major (token-contiguous), so the page's owner
//        transposes its content in place while its QK runs (shared memory -> registers ->
//        shared memory, the paper's V-tile transposition, overlapped with the QK GEMM): QK
//        takes the RoPE tile first, and as each of its chunks completes, the owner's warps
//        write the next content tile's V^T over the tile that chunk read, in P's permuted token
//        order, zeroing the bytes of tokens past the page's end. PV then builds no fragments,
//        holds no A registers and only two rows' gammas, so its 64-dim chunks pipeline
//        through two accumulators.
// Pages arrive by TMA: four 64 x 128-byte content boxes and one RoPE box with 128-byte swizzle
// (cache-line-aligned tiles) plus a 64 x 16-byte box holding the scales; STAGES deep, full /
// empty mbarriers between the producer warpgroup (one lane issues, setmaxnreg gives its
// registers to the consumers) and the 8 consumer warps. With ROPE_RING (alternate pages), the
// RoPE box and the scales go to a ring of their own, released by the page's owner once its QK
// and softmax have read them, so that a stage holds only the four content boxes (PV's V) and
// one more stage fits next to a 32-row Q.
// Softmax per 64-token block (SPEC 5): block max and block max of e * s_k are combined across
// the 4 warps of the warpgroup through shared memory (WG_MODE 4: inside a quad), so m, sigma
// and gamma are exact functions of the block; P = e4m3(e * s_k / sigma) per (row, block); blocks
// are accumulated in strictly increasing order; with WG_MODE 0, gamma and P pass to the other
// warpgroup through shared memory.
// The macro defaults below are the host's (ops/decode_config.py DecodeConfig), which always
// passes every one of them.
#include "common/convert.cuh"
#include "common/warp_roles.cuh"
#include "decode_common.cuh"

#ifndef ROW_GROUPS
#define ROW_GROUPS 4  // query rows per CTA / 16: 1, 2 or 4
#endif
#ifndef STAGES
#define STAGES 4  // pages in flight per CTA
#endif
#ifndef QK_PROMOTE
#define QK_PROMOTE 1  // 1: each 128-dim QK chunk in a fresh accumulator, chunks summed in float32
#endif
#ifndef PV_PROMOTE
#define PV_PROMOTE 1  // 1: each page's PV in a fresh accumulator, added to O in float32
#endif
#ifndef WG_MODE
#define WG_MODE 0  // warpgroup layout / schedule, see above: 0 dims split, 1 own rows, 2 ping-pong,
                   // 3 alternate pages, 4 alternate pages with rows = M in QK, 6 rows = M in
                   // QK and PV (V^T transposed in shared memory)
#endif
#ifndef MIN_CTAS_PER_SM
#define MIN_CTAS_PER_SM 1
#endif
// 1: alternate pages below 64 rows runs a turn's two PVs as one pair (pv_pair in consume());
// 0 keeps them apart (an A/B switch for the benchmarks, not a DecodeConfig field)
#ifndef PV_PAIRS
#define PV_PAIRS 1
#endif
// 1: alternate pages (WG_MODE 3) up to 32 rows derives each row's new state in every warp (lane n:
// row n) instead of one thread per row between two warpgroup barriers; 0 keeps the one thread
// per row (an A/B switch for the benchmarks, not a DecodeConfig field)
#ifndef WARP_ROW_STATE
#define WARP_ROW_STATE 1
#endif
// 1: the swapped-layout softmax (modes 0-3) reduces a group of rows' warp statistics by
// transposition (each shuffle level halves the rows a lane holds: 7 shuffles for 8 rows instead
// of 24); 0: one three-shuffle reduction per row (an A/B switch, not a DecodeConfig field)
#ifndef TRANSPOSED_STATS
#define TRANSPOSED_STATS 1
#endif
// 1: a CTA runs the column of work items its list row starts (the planner's balanced columns,
// several requests' pieces per CTA); 0: its row's item only (DecodeConfig.column_items; the
// 64-row layouts spill in the column loop)
#ifndef COLUMN_ITEMS
#define COLUMN_ITEMS 0
#endif
// Promoted QK: how many chunk accumulators are in flight (2: chunk c + 1 runs while chunk c is
// added; 3: chunks c + 1 and c + 2), where the swapped layouts pipeline QK (an A/B switch for
// the benchmarks, not a DecodeConfig field). The sums keep their order: the same bits.
#ifndef QK_DEPTH
#define QK_DEPTH 3
#endif
// Paired PVs: 1 builds m-tile mt + 2's V^T fragments while m-tiles mt and mt + 1 run (three
// fragment sets); 0 builds each m-tile's right before its wgmmas (an A/B switch, not a
// DecodeConfig field; the same wgmmas on the same bytes)
#ifndef PV_FRAG_AHEAD
#define PV_FRAG_AHEAD 1
#endif
// Diagnostic, not a DecodeConfig field (scripts/trace_decode.py sets it): 1 records clock64()
// at the phase boundaries of the alternate-pages loop (WG_MODE 3, 4) of CTA (0, 0) into the
// global snapmla_phase_trace[warpgroup][turn][point], read back from the host.
// ROPE_RING > 0 (alternate pages, WG_MODE 3): a page's RoPE tile and scale box go to a ring of
// ROPE_RING slots of their own, released once the owner's softmax has read them, so that the
// stages hold only the content tiles (32 KB instead of 41 KB) and one more of them fits
#ifndef ROPE_RING
#define ROPE_RING 0
#endif
// 1: rows = M (WG_MODE 4): the owner of a request's partial last page zeroes the page's content
// rows past its end in shared memory during its softmax, so that no PV masks V^T's bytes (the
// 64-row PV otherwise masks every page: a second, unmasked copy of it spilled); 0 masks them (an
// A/B switch for the benchmarks, not a DecodeConfig field; the same float32 operations)
#ifndef TAIL_ZERO
#define TAIL_ZERO 1
#endif
// 1: rows = M gives a whole page's token scale loads and exponentials code of their own, without
// the per-token test against the page's end and the per-logit guard of a partial or causal page
// (ptxas otherwise merges the exponentials of both kinds of page into one predicated pass: three
// instructions a logit more); 0 tests on every page (an A/B switch, not a DecodeConfig field; the
// same operations on every value)
#ifndef ROWS_M_WHOLE
#define ROWS_M_WHOLE 1
#endif
// 1: alternate pages (WG_MODE 3, 4; one item per CTA) addresses each V^T fragment of a page from
// one lane offset taken at the page's PV (an XOR and constants per m-tile and k-step) instead of
// deriving the swizzled address per m-tile; 0 derives it (an A/B switch, not a DecodeConfig field;
// the same bytes)
#ifndef V_OFFSETS
#define V_OFFSETS 1
#endif
#ifndef CLUSTER_FOLD
// 1: the host launches a request's splits as one thread-block cluster (ops/cluster_fold.py) and
// they merge through each other's shared memory (decode_common.cuh cluster_fold); 0: through
// the global partial buffers (the fold or the combine)
#define CLUSTER_FOLD 0
#endif
#ifndef TRACE_PHASES
#define TRACE_PHASES 0
#endif

// Diagnostic (scripts/cta_times.py sets it): 1 records per CTA (blockIdx.y * gridDim.x +
// blockIdx.x, up to kMaxTimedCtas) its SM, its pages and the %globaltimer at the points of
// CtaTimeField into the global snapmla_cta_times[cta][kCtaTimeFields] (zeroed by the script
// before the call): launch skew, imbalance and where a call's fixed cost goes, CTA by CTA.
#ifndef CTA_TIMES
#define CTA_TIMES 0
#endif
// The fields of a CTA's row of snapmla_cta_times (the order scripts/cta_times.py reads):
// consumers start the first item, end the last (after the fold), SM, pages, kernel entry, Q in
// shared memory, the first block's QK done, the page loop of the last item done, its outputs
// stored, the producer's last page issued
enum CtaTimeField { kTimeStart, kTimeEnd, kTimeSm, kTimePages, kTimeEntry, kTimeQ, kTimeFirstQk, kTimeLoopEnd,
                    kTimeStored, kTimeLastLoad, kCtaTimeFields };
#if CTA_TIMES
constexpr int kMaxTimedCtas = 4096;
extern "C" __device__ long long snapmla_cta_times[kMaxTimedCtas * kCtaTimeFields];
#endif
// %globaltimer into this CTA's field when `who` (CTA_TIMES only; nothing otherwise)
__device__ __forceinline__ void mark_cta_time([[maybe_unused]] int field, [[maybe_unused]] bool who) {
#if CTA_TIMES
    const unsigned cta = blockIdx.y * gridDim.x + blockIdx.x;
    if (who && cta < kMaxTimedCtas) snapmla_cta_times[cta * kCtaTimeFields + field] = snapmla::globaltimer_ns();
#endif
}

#if TRACE_PHASES
// [2 warpgroups][kTraceTurns][kTracePoints]: turn start, the page's bytes arrived, QK done, row
// state received, four points inside the softmax (from kSoftmaxPoint0), softmax done, PV of the other
// warpgroup's page done, PV of its own page done; snapmla_phase_ns: %globaltimer at each turn
// start, so that the host can convert cycles to time (the SM clock under load)
extern "C" __device__ long long snapmla_phase_trace[2 * 64 * 11];
extern "C" __device__ long long snapmla_phase_ns[2 * 64];
#endif

namespace snapmla {
namespace fp8wg {
// the softmax's inner points: mode 3: block statistics of the warps, after the first warpgroup
// barrier, row state combined, after the second barrier (kWarpRowState: both after the row
// state); rows = M: block max, block max of e s_k, row state, P^T stored
constexpr int kTraceTurns = 64, kTracePoints = 11, kSoftmaxPoint0 = 4;

constexpr bool kColumnItems = COLUMN_ITEMS;
constexpr bool kOwnRowsPv = WG_MODE == 1 || WG_MODE == 2;
constexpr bool kPingPong = WG_MODE == 2;
constexpr bool kVtSmem = WG_MODE == 6;  // V^T transposed in shared memory, PV with rows = M
constexpr bool kRowsM = WG_MODE == 4 || kVtSmem;
constexpr bool kAltPages = WG_MODE == 3 || kRowsM;
// Rows = M running a column of work items (balanced columns): the column loop's state leaves
// the 64-row PV no room for a page's 16 gammas in registers nor for the V^T fragments' lane
// offsets kept through the page loop (ptxas spilled 48 bytes), so that build loads the gammas
// per m-tile, the first kGammaEarly pairs while the m-tile's wgmmas run (all 8 spill; loaded
// after the wait, they cost the column build 5% a page, measured) and the others where used, and
// derives the lane offsets again per page; the one-item build keeps both (its SASS unchanged).
constexpr bool kRowsMColumns = kRowsM && COLUMN_ITEMS;
constexpr bool kTailZero = TAIL_ZERO && WG_MODE == 4;
constexpr bool kClusterFold = CLUSTER_FOLD != 0;
static_assert(!CLUSTER_FOLD || !COLUMN_ITEMS, "a cluster holds one request's splits, one item per CTA");
// alternate pages, one item per CTA: the V^T fragments' shared-memory addresses from one offset per
// page (the column builds keep their code: rows = M's derives the lane again per page, see
// kRowsMColumns; WG_MODE 6 builds no fragments)
constexpr bool kVOffsets = V_OFFSETS && (WG_MODE == 3 || WG_MODE == 4) && !COLUMN_ITEMS;
constexpr int kGammaEarly = 4;
constexpr int kRows = 16 * ROW_GROUPS;
constexpr int kRowsPerWg = kRows / 2;
constexpr int kQkRows = kAltPages ? kRows : kRowsPerWg;  // N of QK: the rows of a warpgroup's softmax
constexpr int kPvRows = kOwnRowsPv ? kRowsPerWg : kRows;  // N of PV
// CTA roles and the register split: common/warp_roles.cuh
using roles::kConsumerThreads;
using roles::kConsumerWarps;
using roles::kThreads;
using roles::kWgThreads;
constexpr int kConsumerRegs = roles::consumer_regs(MIN_CTAS_PER_SM);
static_assert(roles::split_fits(MIN_CTAS_PER_SM), "consumers may only take the registers the producer gave back");
constexpr int kBox = 128;                              // TMA box width in bytes (= swizzle span)
constexpr int kContentTiles = D_CONTENT / kBox;        // 4
constexpr int kTileBytes = kPageTokens * kBox;         // 8192: one 64 x 128 B box
constexpr int kScaleBoxBytes = kPageTokens * VEC_BYTES;  // 64 x 16 B (scale + pad)
constexpr int kContentBytes = kContentTiles * kTileBytes;  // 32768: V (and K's content)
constexpr int kRopeSlotBytes = kTileBytes + kScaleBoxBytes;   // 9216: K's RoPE tile and the scales
constexpr int kPageBytes = kContentBytes + kRopeSlotBytes;    // 41984: the TMA bytes of a page
constexpr int kRopeRing = ROPE_RING;
constexpr bool kSplitRing = kRopeRing > 0;
constexpr int kStageBytes = kSplitRing ? kContentBytes : kPageBytes;
constexpr int kSwizzleAtom128 = 8 * kBox;              // 1024: 8 rows of 128 B
constexpr int kPRowBytes = kPageTokens;                // P^T row: 64 E4M3 tokens
constexpr int kSwizzleAtom64 = 8 * kPRowBytes;         // 512
constexpr int kQTileBytes = kRows * kBox;
constexpr int kQBytes = (kContentTiles + 1) * kQTileBytes;
constexpr int kPBytes = kRows * kPRowBytes;
constexpr int kFp8KStep = 32;                          // bytes (and tokens) per FP8 k-step
constexpr int kBf16KStepBytes = 32;                    // 16 bf16
constexpr int kKStepsPerBox = kBox / kFp8KStep;        // 4
constexpr int kRopeKSteps = kBox / kBf16KStepBytes;    // 4
constexpr int kPvKSteps = kPageTokens / kFp8KStep;     // 2
constexpr int kWgDims = kOwnRowsPv ? kDimV : kDimV / 2;  // output dims per warpgroup
constexpr int kMTiles = kWgDims / 64;                  // PV m-tiles per warpgroup
constexpr int kSAcc = kQkRows / 2;                     // S^T accumulator floats per thread
constexpr int kOAcc = kPvRows / 2;                     // O^T floats per thread per m-tile
// rows whose softmax state (L partial) a thread keeps: rows = M holds rows 16w + g and + 8
constexpr int kOwnRows = kRowsM ? 2 : kQkRows / 4;
constexpr int kStatRows = kOwnRows < 8 ? kOwnRows : 8;  // rows whose statistics interleave
// Transposed statistics where a thread holds 4 or 8 rows of a softmax of up to 32 rows: 1.0-2.6%
// at 32 rows (same call); with 2 rows (mode 0 at 16 rows) they save one shuffle in six and were
// 0.4% slower, and the 64-row mode-3 kernel (two groups of 8 rows) spills with them.
constexpr int kTransposedMinRows = 4, kTransposedMaxQkRows = 32;
constexpr bool kTransposedStats = TRANSPOSED_STATS && kStatRows >= kTransposedMinRows && kQkRows <= kTransposedMaxQkRows;
constexpr int kAllRows = kPvRows / 4;                  // rows of O^T a thread holds
// Accumulation precision: Hopper's FP8 tensor cores keep fewer bits than float32 when they add
// into an accumulator, so a long chain of wgmmas into one accumulator loses precision (the
// DeepSeek-V3 report promotes to float32 every 128 products). QK_PROMOTE / PV_PROMOTE shorten
// the chains to one 128-dim chunk / one page, at the cost of waits between chunks.
constexpr bool kQkPromote = QK_PROMOTE != 0;
constexpr bool kPvPromote = PV_PROMOTE != 0;
constexpr int kQkChunks = kContentTiles + 1;           // four content tiles + the RoPE tile
// see consume(); the promoted paths wait between chunks, which the prefetch would undo
constexpr bool kPrefetchQk = MIN_CTAS_PER_SM == 1 && !kQkPromote && !kPvPromote && !kPingPong && !kAltPages;
// Promoted QK overlaps chunk c + 1's wgmmas with adding chunk c when two temporary accumulators
// fit (at N = 64 they would spill next to O and the logits, except with rows = M, whose softmax
// keeps 2 rows' state per thread instead of 16).
// WG_MODE 6 waits for each chunk, which carries a step of the V^T transposition (two
// accumulators spill there next to its PV's two).
constexpr int kQkPipelineMaxAcc = 16;
constexpr bool kQkPipelined = kSAcc <= kQkPipelineMaxAcc || WG_MODE == 4;
// (rows = M at N = 64: a third 32-float accumulator spills next to O, 520 bytes)
constexpr int kQkDepth = kQkPipelined && !kRowsM ? QK_DEPTH : 2;
// An in-flight wgmma keeps its register A fragment (4 registers) alive: with two CTAs per SM
// there are not enough registers for all 8 PV wgmmas at once (ptxas would serialize them all).
constexpr bool kPvGroups = MIN_CTAS_PER_SM > 1 && !kPvPromote;
// Promoted PV overlaps m-tile mt + 1's wgmmas with adding m-tile mt when two temporary
// accumulators fit (at 64-row PV, N = 64, they would spill next to O).
constexpr int kPvPipelineMaxAcc = 16;
constexpr bool kPvPipelined = kOAcc <= kPvPipelineMaxAcc;
// Alternate pages runs a turn's PV of the other warpgroup's page and of its own as one pair
// (both pages' wgmmas of an m-tile in one group: half the waits). Up to 32 rows and one CTA per
// SM: the second page's accumulators and fragments do not fit next to a 64-row O, nor in the
// registers of two CTAs per SM (both spill).
constexpr int kPvPairsMaxRows = 32;
constexpr bool kPvPairs =
    PV_PAIRS && WG_MODE == 3 && kRows <= kPvPairsMaxRows && MIN_CTAS_PER_SM == 1 && kPvPromote && kPvPipelined;
// (not in the column loop: its third fragment set spills there with NVRTC 13.0's ptxas, 52 bytes)
constexpr bool kPvFragAhead = PV_FRAG_AHEAD && kPvPairs && !kColumnItems;
static_assert(!(kPvPairs && kPrefetchQk), "pv_pair does not hand over a prefetched QK (pv_page does)");
// Alternate pages (WG_MODE 3) up to 32 rows: every warp derives the new state of all rows of the
// block from the warps' statistics (lane n: row n), so the P^T pass needs no second warpgroup
// barrier and no row info in shared memory; the state is double-buffered by block parity, since
// the other warps still read the state after block it - 1 while warp 0 writes the one after it.
// kWarpRowStateLayout: the layouts it applies to; they keep the double-buffered row state and
// the SFU reciprocal whatever WARP_ROW_STATE says, so that its A/B compares the same operations.
constexpr int kWarpRowStateMaxRows = 32;
constexpr bool kWarpRowStateLayout = WG_MODE == 3 && kQkRows <= kWarpRowStateMaxRows;
constexpr bool kWarpRowState = WARP_ROW_STATE && kWarpRowStateLayout;
// The row step's 1 / sigma: the SFU's reciprocal in those layouts (measured 1.4% at 32 rows
// together with kWarpRowState, where the row step is on every warp's critical path); elsewhere
// the correctly rounded one (the 64-row mode-3 kernel spills 16 bytes with the SFU's)
constexpr bool kRowStepFastRcp = kWarpRowStateLayout;
constexpr float kInvE4m3Max = 1.f / E4M3_MAX;  // sigma = max(e s_k) / 448 as a product
constexpr float kPScaleFloor = P_SCALE_FLOOR;
// named barrier ids (0 = __syncthreads); ping-pong's turns and alternate pages' hand-overs
// never meet in one kernel, so they share ids
constexpr int kBarWg0 = 1, kBarConsumers = 3, kBarTurn0 = 4, kBarPass0 = 4;
// P^T and gamma buffers, by block: alternate pages keeps blocks it - 1 and it in use while the
// other warpgroup writes it + 1
constexpr int kPBuffers = kAltPages ? 4 : 2;
// the barrier between writing P^T and the PV that reads it: only the warpgroup's own rows, or
// both warpgroups' rows
constexpr int kPvBarThreads = kOwnRowsPv ? kWgThreads : kConsumerThreads;

// shared memory map (offsets from a 1024-aligned base)
constexpr int kOffQ = 0;
constexpr int kOffStages = kOffQ + kQBytes;
constexpr int kOffRope = kOffStages + STAGES * kStageBytes;  // ROPE_RING's slots
constexpr int kOffP = kOffRope + kRopeRing * kRopeSlotBytes;
constexpr int kOffGamma = kOffP + kPBuffers * kPBytes;
// the per-warp statistics exchange (stats, rowinfo); rows = M needs none
constexpr int kStatsBytes = kRowsM ? 0 : 2 * 4 * kQkRows * 8;
constexpr int kRowInfoFloats = 8;  // sigma, 1/sigma, gamma, gamma of L, f per warp x 4
constexpr int kRowInfoBytes = kRowsM ? 0 : 2 * kQkRows * kRowInfoFloats * 4;
constexpr int kOffStats = kOffGamma + kPBuffers * kRows * 4;
constexpr int kOffRowInfo = kOffStats + kStatsBytes;
constexpr int kOffLsum = kOffRowInfo + kRowInfoBytes;
constexpr int kOffRowConst = kOffLsum + 2 * 4 * kQkRows * 4;
constexpr int kOffRowState = kOffRowConst + kRows * 8;  // alternate pages: m, sigma, last gamma
// WG_MODE 3 up to 32 rows keeps the row state twice, by block parity (see kWarpRowState); the
// layout does not depend on WARP_ROW_STATE, so that both builds share the host's formula
constexpr int kRowStateBuffers = kWarpRowStateLayout ? 2 : 1;
constexpr int kRowStateBytes = kAltPages ? kRowStateBuffers * kRows * 16 : 0;
constexpr int kOffBars = kOffRowState + kRowStateBytes;
// full and empty barriers per stage, an empty barrier per RoPE slot
constexpr int kSmemBytes = kOffBars + (2 * STAGES + kRopeRing) * 8;
constexpr int kSmemAlign = 1024;                       // swizzle-128B atoms need 1024 B alignment
constexpr int kMaxSmemPerCta = 232448;

static_assert(WG_MODE >= 0 && WG_MODE <= 6 && WG_MODE != 5, "WG_MODE is 0, 1, 2, 3, 4 or 6");
static_assert(!kRowsM || kRows == 64, "rows = M (WG_MODE 4, 6) fills wgmma's M = 64 with 64 rows");
// the RoPE ring: the owner's softmax is the last reader of a page's RoPE tile and scales (alternate
// pages), one item per CTA (the ring's phases start at the item)
static_assert(!kSplitRing || (WG_MODE == 3 && !COLUMN_ITEMS && kRopeSlotBytes % kSwizzleAtom128 == 0),
              "ROPE_RING: alternate pages (WG_MODE 3), one item per CTA");
static_assert(ROW_GROUPS == 1 || ROW_GROUPS == 2 || ROW_GROUPS == 4, "16, 32 or 64 rows per CTA");
static_assert(STAGES >= 2, "the pipeline needs two stages");
static_assert(kSmemBytes + kSmemAlign <= kMaxSmemPerCta, "STAGES x rows exceed shared memory");
static_assert(kQTileBytes % kSwizzleAtom128 == 0 && kStageBytes % kSwizzleAtom128 == 0, "swizzle atoms");
static_assert(kOffP % kSwizzleAtom64 == 0 && kPBytes % kSwizzleAtom64 == 0, "P^T swizzle atoms");
static_assert(kRowsPerWg % 8 == 0, "wgmma N is a multiple of 8");
static_assert(kQkRows <= kWgThreads, "one thread per row keeps the row's running state");
static_assert(fold_scratch_floats(kRows) * 4 <= kQBytes, "the folded merge's weights fit in Q's tiles");
static_assert(!kClusterFold || cluster_partial_bytes(kRows) <= STAGES * kStageBytes, "a cluster split's rows fit in the stages");
#ifdef SNAPMLA_EXPECT_SMEM  // the host's launch size (ops/decode_config.py wgmma_smem_bytes)
static_assert(kSmemBytes + kSmemAlign == SNAPMLA_EXPECT_SMEM, "host shared-memory formula is out of date");
#endif

struct Params {
    const unsigned char* q_content;  // [b, s_q, h_q, 512] e4m3
    const float* q_scale;            // [b, s_q, h_q]
    const __nv_bfloat16* q_rope;     // [b, s_q, h_q, 64] pre-scaled
    const unsigned char* tmaps;      // two CUtensorMaps: 128-byte swizzled boxes, scale boxes
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

constexpr int kTensorMapBytes = 128;

// Same for a [rows x 64 B] tile with 64-byte swizzle (chunk bits 4-5 XOR address bits 7-8).
__device__ __forceinline__ int swz64(int row, int byte) {
    return row * kPRowBytes + ((((byte >> 4) ^ (row >> 1)) & 3) << 4) + (byte & 15);
}

// The byte permutes that turn ldmatrix.trans's four b16 matrices into a V^T fragment (below).
__device__ __forceinline__ void v_fragment_permute(const unsigned (&r)[4], unsigned (&frag)[4]) {
    constexpr unsigned kEvenDim = 0x6420, kOddDim = 0x7531;
    frag[0] = prmt(r[0], r[1], kEvenDim);
    frag[1] = prmt(r[0], r[1], kOddDim);
    frag[2] = prmt(r[2], r[3], kEvenDim);
    frag[3] = prmt(r[2], r[3], kOddDim);
}
// The V^T A-fragment (m64k32 register layout) of a page's dims [dim, dim + 16) and tokens
// [32 ks, 32 ks + 32), built from its 128-byte-swizzled content tiles with one ldmatrix.trans on
// byte pairs and four byte permutes: registers 0 / 1 hold dims dim + 2g / dim + 2g + 1 at the
// k-step's bytes 4c .. 4c + 3, registers 2 / 3 the same at bytes 16 + 4c ..; byte 16h + 4c + i
// holds token 16h + {2c, 2c + 1, 2c + 8, 2c + 9}[i] (P's permuted token order).
__device__ __forceinline__ void v_fragment(const unsigned char* page, int dim, int ks, int lane, unsigned (&frag)[4]) {
    const int ld_token = 8 * (lane / 8) + (lane % 8);  // ldmatrix row address of this lane
    unsigned r[4];
    ldmatrix_x4_trans(r, page + (dim / kBox) * kTileBytes + swz128(kFp8KStep * ks + ld_token, dim % kBox));
    v_fragment_permute(r, frag);
}
// The same fragment from a lane's row offset computed once for all m-tiles and k-steps of a page
// (V_OFFSETS): v_fragment's address is page + v_fragment_offset(dim0 + 16 w, lane), then
// + (dim - dim0) / 128 tiles and + 32 ks token rows, XOR 64 where dim % 128 >= 64 (dim0 % 128 ==
// 0, w < 4): the k-step moves whole swizzle atoms, and bit 6 is the 16-byte chunk's bit 2.
__device__ __forceinline__ int v_fragment_offset(int dim, int lane) {
    const int ld_token = 8 * (lane / 8) + (lane % 8);
    return (dim / kBox) * kTileBytes + swz128(ld_token, dim % kBox);
}
// m-tile mt (64 dims), k-step ks of `page` from the lane's offset of m-tile 0, k-step 0
__device__ __forceinline__ void v_fragment_from(const unsigned char* page, int v_off, int mt, int ks,
                                                unsigned (&frag)[4]) {
    constexpr int kMTileBytes = 64;  // an m-tile's dims start at byte 0 (even mt) or 64 (odd) of a box
    unsigned r[4];
    ldmatrix_x4_trans(r, page + (mt * kMTileBytes / kBox) * kTileBytes + kFp8KStep * ks * kBox +
                             (v_off ^ (mt * kMTileBytes % kBox)));
    v_fragment_permute(r, frag);
}
// V_OFFSETS' lane offset of a PV's page for this warp's dims from `dim0` (the PV's first dim + 16 w);
// 0 (unused) without it
__device__ __forceinline__ int page_v_offset(int dim0, int lane) { return kVOffsets ? v_fragment_offset(dim0, lane) : 0; }
// The V^T fragment of m-tile mt, k-step ks for this warp's dims from `dim0`: from the page's lane
// offset `v_off` (kVOffsets), else with the swizzled address derived for lane `lane`
__device__ __forceinline__ void v_fragment_at(const unsigned char* page, int v_off, int dim0, int mt, int ks, int lane,
                                              unsigned (&frag)[4]) {
    if constexpr (kVOffsets) v_fragment_from(page, v_off, mt, ks, frag);
    else v_fragment(page, dim0 + mt * 64, ks, lane, frag);
}
// The bytes of V^T fragment registers 2h, 2h + 1 (k-step ks) whose tokens are below `valid`.
__device__ __forceinline__ unsigned v_token_mask(int ks, int h, int c, int valid) {
    const int left = valid - (kFp8KStep * ks + 16 * h + 2 * c);  // tokens from the first one on
    return (left > 0 ? 0x000000ffu : 0u) | (left > 1 ? 0x0000ff00u : 0u) | (left > 8 ? 0x00ff0000u : 0u) |
           (left > 9 ? 0xff000000u : 0u);
}

// TAIL_ZERO: thread `wtid` of the page owner's warpgroup's share of zeroing the content rows of
// tokens [valid, 64) (unused cache rows may hold NaN patterns; P is 0 there, but 0 x NaN is NaN).
// A token's row of a 128-byte-swizzled box is its 128 bytes whatever the swizzle, so the rows
// past the end are the tile's last (64 - valid) x 128 bytes.
__device__ __forceinline__ void zero_tail_rows(unsigned char* page, int valid, int wtid) {
    constexpr int kChunk = 16;  // bytes per store
    const int tail_bytes = (kPageTokens - valid) * kBox;
#pragma unroll
    for (int tile = 0; tile < kContentTiles; ++tile)
        for (int b = kChunk * wtid; b < tail_bytes; b += kChunk * kWgThreads)
            *reinterpret_cast<uint4*>(page + tile * kTileBytes + valid * kBox + b) = make_uint4(0, 0, 0, 0);
}

// WG_MODE 6: where the V^T of content tile t lives after the transposition: in tile t - 1's
// place (tile 0's in the RoPE tile's), so each tile is read completely before it is overwritten.
__device__ __forceinline__ int vt_slot(int tile) { return (tile + kContentTiles) % (kContentTiles + 1); }

// WG_MODE 6: warp w's share of the in-place transposition of one content tile (128 dims x 64
// tokens at shared address `src`) into V^T rows of 64 bytes (64-byte swizzle) at `dst`: the
// four fragments of 16 dims x 32 tokens at k-step w % 2 and dims 16 (2k + w / 2), k = 0..3,
// all four loads in flight, each fragment stored with one stmatrix (the V^T fragment's register
// layout is ldmatrix's: registers 0-3 are the matrices of dims 2r / 2r + 1 at the k-step's
// bytes 0-15 / 16-31). Inside each group of 16 dims the rows hold the even dims first, then the
// odd ones (row r: dim 2r, row 8 + r: dim 2r + 1), so that each stored 8 x 16-byte matrix
// covers all eight 16-byte bank groups (with dims in order, rows 2r of the 64-byte-swizzled
// tile pair up on four: two-way conflicts); PV's output columns come out in that order.
// `masked`: AND registers 2h, 2h + 1 with mask[h]: the bytes of tokens past the page's end are
// zeroed (unused cache rows may hold NaN patterns; P is 0 there, but 0 x NaN is NaN).
__device__ __forceinline__ void transpose_tile(unsigned src, unsigned dst, int w, int lane, bool masked,
                                               const unsigned (&mask)[2]) {
    constexpr int kFragments = 4;  // per warp and tile: 8 dim groups x 2 k-steps over 4 warps
    constexpr int kDimGroupBytes = 16 * kPRowBytes;  // 16 V^T rows
    const int ks = w & 1, half = w >> 1, r = lane % 8, m = lane / 8;
    // this lane's ldmatrix row: token 32 ks + lane of the 128-byte-swizzled tile, whose 16-byte
    // chunk dg is stored at dg ^ (lane % 8); the row address has bits 4-6 clear, so XOR them in
    // (dg = 2k + half: XORing 2k and half is adding them)
    const unsigned ld_row = ((src + (ks * kFp8KStep + lane) * kBox) | ((lane & 7) << 4)) ^ (half << 4);
    // this lane's stmatrix row: row r + 8 (m & 1) of the 16 (dim 2r + (m & 1)), bytes 16 (m / 2)
    // of the k-step, in 64-byte rows whose 16-byte chunk the swizzle XORs with (row / 2) % 4
    const unsigned st_row = dst + half * kDimGroupBytes + (r + 8 * (m & 1)) * kPRowBytes +
                            ((((2 * ks + (m >> 1)) ^ (r >> 1)) & 3) << 4);
    unsigned v[kFragments][4];
#pragma unroll
    for (int k = 0; k < kFragments; ++k) ldmatrix_x4_trans(v[k], ld_row ^ ((2 * k) << 4));
#pragma unroll
    for (int k = 0; k < kFragments; ++k) {
        unsigned frag[4];
        v_fragment_permute(v[k], frag);
        if (masked) {
#pragma unroll
            for (int i = 0; i < 4; ++i) frag[i] &= mask[i / 2];
        }
        stmatrix_x4(st_row + 2 * k * kDimGroupBytes, frag);
    }
}

// Byte offset of block `it`'s RoPE tile from its stage (the page's content tiles): right behind them,
// or in the RoPE ring's slot (always past the stages)
__device__ __forceinline__ int rope_tile_offset(int it) {
    if constexpr (!kSplitRing) return kContentBytes;
    return kOffRope + (it % kRopeRing) * kRopeSlotBytes - (kOffStages + (it % STAGES) * kStageBytes);
}

// Producer: one elected lane streams the pages of [block_begin, block_end) through the stages.
// `base`: the CTA's pages before this work item (a multiple of STAGES: see roles::run_column),
// whose stages the first pages of this item wait for as well.
__device__ __forceinline__ void produce(const Params& p, unsigned char* smem, unsigned long long* full,
                                        unsigned long long* empty, const int* table, int block_begin,
                                        int num_blocks, int base) {
    const unsigned char* map_tiles = p.tmaps;
    const unsigned char* map_scale = p.tmaps + kTensorMapBytes;
    prefetch_tensor_map(map_tiles);
    prefetch_tensor_map(map_scale);
    unsigned long long* rope_empty = empty + STAGES;
    for (int it = 0; it < num_blocks; ++it) {
        const int stage = it % STAGES;
        if (base + it >= STAGES) mbarrier_wait_parity(&empty[stage], (((base + it) / STAGES) - 1) & 1);
        if (kSplitRing && it >= kRopeRing)
            mbarrier_wait_parity(&rope_empty[it % kRopeRing], ((it / kRopeRing) - 1) & 1);
        const int row = table[block_begin + it] * kPageTokens;
        unsigned char* dst = smem + kOffStages + stage * kStageBytes;
        unsigned char* rope_dst = dst + rope_tile_offset(it);
        mbarrier_arrive_expect_tx(&full[stage], kPageBytes);
#pragma unroll
        for (int t = 0; t < kContentTiles; ++t)
            tma_load_2d(dst + t * kTileBytes, map_tiles, t * kBox, row, &full[stage]);
        tma_load_2d(rope_dst, map_tiles, ROPE_OFFSET, row, &full[stage]);
        tma_load_2d(rope_dst + kTileBytes, map_scale, SCALE_OFFSET, row, &full[stage]);
    }
    mark_cta_time(kTimeLastLoad, num_blocks > 0);
}

// Q rows of this CTA into 128-byte-swizzled K-major tiles (4 content tiles + 1 RoPE tile);
// padding rows are zero.
__device__ __forceinline__ void load_q(unsigned char* q_s, const Params& p, long row_base, int row0,
                                       int rows, int tid) {
    constexpr int kChunksPerRow = (D_CONTENT + ROPE_BYTES) / VEC_BYTES;  // 40
    for (int i = tid; i < kRows * kChunksPerRow; i += kConsumerThreads) {
        const int r = i / kChunksPerRow, k = i % kChunksPerRow;
        const bool valid = row0 + r < rows;
        const long grow = row_base + (valid ? row0 + r : 0);
        const int tile = k / (kBox / VEC_BYTES), byte = (k % (kBox / VEC_BYTES)) * VEC_BYTES;
        const unsigned char* src = tile < kContentTiles
                                       ? p.q_content + grow * D_CONTENT + tile * kBox + byte
                                       : reinterpret_cast<const unsigned char*>(p.q_rope + grow * D_ROPE) + byte;
        cp_async_16(q_s + tile * kQTileBytes + swz128(r, byte), src, valid);
    }
    cp_async_commit();
    cp_async_wait<0>();
}

__device__ __forceinline__ float warp_col_max(float v) {  // over the 8 lanes of equal lane % 4
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 4));
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 8));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 16));
}
// The maxima of kRowsIn rows (one value each per lane) over the 8 lanes of equal lane % 4, by
// transposition: at each shuffle level (lane bits 4, 3, 2) a lane keeps half of its rows and
// sends the other half to its partner, so kRowsIn = 8 takes 4 + 2 + 1 shuffles where one
// reduction per row takes 24. Lane 4g + c returns the maximum of row g / (8 / kRowsIn) (its
// writer: g % (8 / kRowsIn) == 0). Exact: max does not round, so the order does not matter.
template <int kRowsIn>
__device__ __forceinline__ float transposed_col_max(const float (&in)[kRowsIn], int lane) {
    static_assert(kRowsIn == 1 || kRowsIn == 2 || kRowsIn == 4 || kRowsIn == 8, "1, 2, 4 or 8 rows");
    float v[kRowsIn];
#pragma unroll
    for (int k = 0; k < kRowsIn; ++k) v[k] = in[k];
#pragma unroll
    for (int level = 0; level < 3; ++level) {
        const int mask = 16 >> level;
        const int held = kRowsIn >> level;  // rows a lane holds before this level
        if (held >= 2) {
            const bool upper = lane & mask;  // keeps the upper half of its rows
#pragma unroll
            for (int k = 0; k < held / 2; ++k) {
                const float send = upper ? v[k] : v[k + held / 2];
                const float keep = upper ? v[k + held / 2] : v[k];
                v[k] = fmaxf(keep, __shfl_xor_sync(FULL_MASK, send, mask));
            }
        } else {
            v[0] = fmaxf(v[0], __shfl_xor_sync(FULL_MASK, v[0], mask));
        }
    }
    return v[0];
}
__device__ __forceinline__ float warp_col_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 4);
    v += __shfl_xor_sync(FULL_MASK, v, 8);
    return v + __shfl_xor_sync(FULL_MASK, v, 16);
}

// The wgmmas of one QK chunk (chunk < 4: a 128-dim E4M3 content tile, 4 QGMMA k-steps; chunk 4:
// the bf16 RoPE tile, 4 HGMMA k-steps, at `rope_bytes` from the page) into `acc`: S^T = K . Q^T
// (rows = M: S = Q . K^T); `fresh` overwrites instead of accumulating.
template <int kAcc>
__device__ __forceinline__ void qk_chunk(float (&acc)[kAcc], unsigned long long k_desc,
                                         unsigned long long q_desc_base, int chunk, bool fresh,
                                         int rope_bytes = kContentBytes) {
    // (A, B) descriptors of one k-step at byte offsets into the K page and the Q tiles
    auto operands = [&](int k_bytes, int q_bytes) {
        const unsigned long long k = k_desc + (k_bytes >> 4), q = q_desc_base + (q_bytes >> 4);
        return kRowsM ? make_ulonglong2(q, k) : make_ulonglong2(k, q);
    };
    if (chunk < kContentTiles) {
#pragma unroll
        for (int kk = 0; kk < kKStepsPerBox; ++kk) {
            const ulonglong2 ab = operands(chunk * kTileBytes + kk * kFp8KStep, chunk * kQTileBytes + kk * kFp8KStep);
            wgmma_fp8_ss(acc, ab.x, ab.y, !(fresh && kk == 0));
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < kRopeKSteps; ++kk) {
            const ulonglong2 ab = operands(rope_bytes + kk * kBf16KStepBytes,
                                           kContentTiles * kQTileBytes + kk * kBf16KStepBytes);
            wgmma_bf16_ss(acc, ab.x, ab.y, !(fresh && kk == 0));
        }
    }
}

// The consumers' view of the full barriers: block `it` of the work item is in stage it % STAGES,
// in the round of the stages (it / STAGES) after the item's first, whose parity is `phase` (a
// CTA's later items start where the earlier ones left the pipeline: roles::run_column).
struct FullBarriers {
    unsigned long long* bars;
    int phase;
    __device__ __forceinline__ void wait(int it) const {
        mbarrier_wait_parity(&bars[it % STAGES], ((it / STAGES) ^ phase) & 1);
    }
};

// Wait until block `it`'s page has landed; the descriptor of its K tiles.
__device__ __forceinline__ unsigned long long page_k_desc(unsigned char* smem, const FullBarriers& full, int it) {
    full.wait(it);
    return make_smem_desc(smem + kOffStages + (it % STAGES) * kStageBytes, kSwizzle128B, kSwizzleAtom128);
}

// Issue (no wait) S^T = K . Q^T for block `it` into `acc`: all chunks in one accumulator.
template <int kAcc>
__device__ __forceinline__ void issue_qk(float (&acc)[kAcc], unsigned char* smem, const FullBarriers& full,
                                         int it, unsigned long long q_desc_base) {
    const unsigned long long k_desc = page_k_desc(smem, full, it);
    const int rope_bytes = rope_tile_offset(it);
    wgmma_fence();
#pragma unroll
    for (int chunk = 0; chunk < kQkChunks; ++chunk) qk_chunk(acc, k_desc, q_desc_base, chunk, chunk == 0, rope_bytes);
    wgmma_commit();
}

// WG_MODE 6: QK takes the RoPE tile first, so that the page's tiles die in the order the V^T
// transposition overwrites them (RoPE tile, content tiles 0, 1, 2: see vt_slot); the other
// modes keep the content tiles first. Position `i` of the order -> qk_chunk's chunk.
__device__ __forceinline__ constexpr int qk_chunk_at(int i) { return kVtSmem ? (i + kContentTiles) % kQkChunks : i; }

// `kSteps` wgmma groups through kDepth accumulators in turn: steps i + 1 .. i + kDepth - 1 are
// issued before step i is waited for and handed to `take(i, acc)` (float32 promotion of QK
// chunks or PV chunks). `issue(i, acc)` fences, issues and commits step i's wgmmas into `acc`;
// an accumulator may be one array or a set of them (`float[kSets][kCount]`: the paired PVs' two
// pages).
template <int kSteps, int kDepth, class Acc, class Issue, class Take>
__device__ __forceinline__ void accumulator_pipeline(Acc (&acc)[kDepth], Issue issue, Take take) {
    static_assert(kDepth >= 2 && kDepth <= 3, "wgmma_wait below covers two or three groups in flight");
#pragma unroll
    for (int i = 0; i + 1 < kDepth && i < kSteps; ++i) issue(i, acc[i]);
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
        if (i + kDepth - 1 < kSteps) issue(i + kDepth - 1, acc[(i + kDepth - 1) % kDepth]);
        // groups committed after step i's: min(kDepth - 1, kSteps - 1 - i)
        const int later = kSteps - 1 - i < kDepth - 1 ? kSteps - 1 - i : kDepth - 1;
        if (later >= 2) wgmma_wait<2>();
        else if (later == 1) wgmma_wait<1>();
        else wgmma_wait<0>();
        fence_accumulators(acc[i % kDepth]);
        take(i, acc[i % kDepth]);
    }
}

// What WG_MODE 6's QK needs to transpose block `it`'s page while its chunks run: the
// warpgroup's named barrier, the warp, and the V^T masks of a partial page.
struct PageTranspose {
    int wg_barrier;
    int w;
    bool masked;       // the page is a request's last: tokens past its end are zeroed
    unsigned mask[2];  // of this warp's k-step (see transpose_tile)
};

// S^T for block `it` with float32 promotion: each chunk in a fresh accumulator, summed in chunk
// order. With kQkPipelined two accumulators are used in turn so one chunk runs while the
// previous one is added; otherwise chunk 0 goes straight into `s` and each later chunk waits.
// WG_MODE 6 (not pipelined): while chunk i runs, the warpgroup transposes content tile i - 1
// over the tile of chunk i - 1, which is complete: every warp waited for it, and finished
// reading the tile before it (transposition step i - 2), before the warpgroup barrier.
template <int kAcc>
__device__ __forceinline__ void qk_promoted(float (&s)[kAcc], unsigned char* smem, const FullBarriers& full,
                                            int it, unsigned long long q_desc_base, const PageTranspose& vt) {
    const unsigned long long k_desc = page_k_desc(smem, full, it);
    const int rope_bytes = rope_tile_offset(it);
    if constexpr (!kQkPipelined) {
        const unsigned page = smem_addr(smem + kOffStages + (it % STAGES) * kStageBytes);
        wgmma_fence();
        qk_chunk(s, k_desc, q_desc_base, qk_chunk_at(0), true, rope_bytes);
        wgmma_commit();
#pragma unroll
        for (int i = 1; i < kQkChunks; ++i) {
            float acc[kAcc];
            wgmma_fence();
            qk_chunk(acc, k_desc, q_desc_base, qk_chunk_at(i), true, rope_bytes);
            wgmma_commit();
            if constexpr (kVtSmem) {
                const int t = i - 1;  // the content tile this step transposes
                if (i == 1) wgmma_wait<1>();  // the RoPE chunk (the later ones are waited below)
                named_barrier_sync(vt.wg_barrier, kWgThreads);
                transpose_tile(page + t * kTileBytes, page + vt_slot(t) * kTileBytes, vt.w, threadIdx.x % 32,
                               vt.masked, vt.mask);
            }
            wgmma_wait<0>();
            fence_accumulators(s);
            fence_accumulators(acc);
#pragma unroll
            for (int j = 0; j < kAcc; ++j) s[j] += acc[j];
        }
        return;
    }
    float acc[kQkDepth][kAcc];
    accumulator_pipeline<kQkChunks, kQkDepth>(
        acc,
        [&](int chunk, float (&into)[kAcc]) {
            wgmma_fence();
            qk_chunk(into, k_desc, q_desc_base, chunk, true, rope_bytes);
            wgmma_commit();
        },
        [&](int chunk, float (&done)[kAcc]) {
#pragma unroll
            for (int i = 0; i < kAcc; ++i) s[i] = chunk == 0 ? done[i] : s[i] + done[i];
        });
}

__device__ __forceinline__ void consume(const Params& p, unsigned char* smem, const FullBarriers full,
                                        unsigned long long* empty, int item, int block_begin,
                                        int num_blocks, int seqlen, int rows, int row0, long row_base,
                                        int req) {
    const int tid = static_cast<int>(threadIdx.x) + (kColumnItems ? loop_zero() : 0);
    // alternate pages branches on wg around wgmmas: a shuffle from lane 0 makes it warp-uniform
    // as far as ptxas knows, so that it does not serialize them (C7519); the other modes keep
    // the plain division (the shuffle costs the unpromoted kernel a spill)
    const int wg = kAltPages ? __shfl_sync(FULL_MASK, tid / kWgThreads, 0) : tid / kWgThreads;
    const int w = (tid / 32) % 4;          // warp inside the warpgroup
    const int lane = tid % 32, g = lane / 4, c = lane % 4;
    unsigned char* q_s = smem + kOffQ;
    float* gamma_s = reinterpret_cast<float*>(smem + kOffGamma);
    float2* stats_s = reinterpret_cast<float2*>(smem + kOffStats) + wg * 4 * kQkRows;
    float* lsum_s = reinterpret_cast<float*>(smem + kOffLsum);
    float* rowinfo_s = reinterpret_cast<float*>(smem + kOffRowInfo) + wg * kQkRows * kRowInfoFloats;
    float4* rowstate_s = reinterpret_cast<float4*>(smem + kOffRowState);  // alternate pages only
    const int wtid = tid % kWgThreads;  // threads wtid < kQkRows keep one row's running state
#if CTA_TIMES
    long long* cta_times = snapmla_cta_times + (blockIdx.y * gridDim.x + blockIdx.x) * kCtaTimeFields;
    const bool timed = tid == 0 && blockIdx.y * gridDim.x + blockIdx.x < kMaxTimedCtas;
    const int first_item = kColumnItems ? static_cast<int>(blockIdx.y) * p.items_per_column : blockIdx.y;
    if (timed) {  // a column: its first item's start, all its items' pages
        if (item == first_item) cta_times[kTimeStart] = globaltimer_ns();
        cta_times[kTimeSm] = sm_id();
        cta_times[kTimePages] += num_blocks;
    }
    const bool timed_first = timed && item == first_item;
#else
    constexpr bool timed = false, timed_first = false;
#endif
    const int qk_row0 = kAltPages ? 0 : wg * kRowsPerWg;  // first CTA row of this warpgroup's QK (N)
    const int pv_row0 = kOwnRowsPv ? wg * kRowsPerWg : 0;  // first CTA row of this warpgroup's PV (N)
    const int pv_dim0 = kOwnRowsPv ? 0 : wg * kWgDims;     // first output dim of its PV (M)

    // per-row constants in shared memory (registers go to the accumulators): the logit scale
    // q_scale * softmax_scale * log2(e) and the number of visible keys
    float2* rowconst_s = reinterpret_cast<float2*>(smem + kOffRowConst);
    if (tid < kRows) {
        const int row = row0 + tid;
        rowconst_s[tid] = make_float2(row < rows ? p.q_scale[row_base + row] * p.softmax_scale_log2 : 0.f,
                                      __int_as_float(visible_keys(row, rows, seqlen, p.shape)));
        if constexpr (kAltPages) {
#pragma unroll
            for (int b = 0; b < kRowStateBuffers; ++b) rowstate_s[b * kRows + tid] = make_float4(-INFINITY, 1.f, 1.f, 0.f);
        }
    }
    load_q(q_s, p, row_base, row0, rows, tid);
    fence_proxy_async_shared();  // Q was written by cp.async (generic proxy); wgmma reads it
    named_barrier_sync(kBarConsumers, kConsumerThreads);
    mark_cta_time(kTimeQ, timed_first);

    // rows of this warpgroup's softmax state held by this thread: local n = qk_row0 + 8j + 2c + e
    float l_run[kOwnRows];
    // running max / P scale of row qk_row0 + wtid (alternate pages: in rowstate_s instead)
    float row_m = -INFINITY, row_sig = 1.f;
#pragma unroll
    for (int i = 0; i < kOwnRows; ++i) l_run[i] = 0.f;
    float o_acc[kMTiles][kOAcc];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int i = 0; i < kOAcc; ++i) o_acc[mt][i] = 0.f;

    const unsigned long long q_desc_base =
        make_smem_desc(q_s + qk_row0 * kBox, kSwizzle128B, kSwizzleAtom128);
    const int tok_a = 16 * w + g, tok_b = tok_a + 8;  // this thread's S^T rows (tokens)
    // keys every real row of the CTA sees (the causal mask hides up to s_q - 1 of them)
    const int min_visible = p.shape.causal ? seqlen - p.shape.s_q + 1 : seqlen;

    // kPrefetchQk: QK of block it+1 is issued before the softmax of block it, so the tensor
    // cores work while the CUDA cores do the softmax; s_cur holds block it's logits, s_next
    // block it+1's. Two CTAs per SM overlap each other instead (and lack the registers).
    float s_cur[kSAcc], s_next[kSAcc];
    if constexpr (kPrefetchQk) {
        issue_qk(s_cur, smem, full, 0, q_desc_base);
        wgmma_wait<0>();
        fence_accumulators(s_cur);
    }

    // Where block it lives: its stage's page, its valid tokens, and its P^T / gamma buffers
    // (kPBuffers deep, by block; the softmax writes them, the PV reads them).
    auto page_of = [&](int it) { return smem + kOffStages + (it % STAGES) * kStageBytes; };
    // block it's RoPE tile and scale box: behind its content tiles, or in the RoPE ring
    auto rope_of = [&](int it) { return page_of(it) + rope_tile_offset(it); };
    unsigned long long* rope_empty = empty + STAGES;
    auto valid_of = [&](int it) { return min(kPageTokens, seqlen - (block_begin + it) * kPageTokens); };
    auto p_tile_of = [&](int it) { return smem + kOffP + (it % kPBuffers) * kPBytes; };
    auto gamma_of = [&](int it) { return gamma_s + (it % kPBuffers) * kRows; };
    // the alternate-pages row state after block it (it = -1: the initial state)
    auto rowstate_at = [&](int it) { return rowstate_s + (kRowStateBuffers > 1 ? (it & 1) * kRows : 0); };
    auto trace = [&](int it, int point) {  // TRACE_PHASES only (see the top of the file)
#if TRACE_PHASES
        if (blockIdx.x == 0 && blockIdx.y == 0 && wtid == 0 && it / 2 < kTraceTurns) {
            snapmla_phase_trace[(wg * kTraceTurns + it / 2) * kTracePoints + point] = clock64();
            if (point == 0) snapmla_phase_ns[wg * kTraceTurns + it / 2] = globaltimer_ns();
        }
#endif
    };

    // QK of block it: s_cur holds its logits (kPrefetchQk: issues block it + 1's into s_next).
    auto qk_step = [&](int it) {
        if constexpr (kPrefetchQk) {
            if (it + 1 < num_blocks) issue_qk(s_next, smem, full, it + 1, q_desc_base);
        } else if constexpr (kQkPromote) {
            PageTranspose vt{kBarWg0 + wg, w, false, {~0u, ~0u}};
            if constexpr (kVtSmem) {
                const int valid = valid_of(it);
                vt.masked = valid < kPageTokens;
                vt.mask[0] = v_token_mask(w & 1, 0, c, valid);
                vt.mask[1] = v_token_mask(w & 1, 1, c, valid);
            }
            qk_promoted(s_cur, smem, full, it, q_desc_base, vt);
        } else {
            issue_qk(s_cur, smem, full, it, q_desc_base);
            wgmma_wait<0>();
            fence_accumulators(s_cur);
        }
    };
    // P^T, gamma (and the row state) of a block are written: make them visible to the PV wgmmas
    auto publish_p = [&]() {
        fence_proxy_async_shared();  // P^T (generic stores) is read by wgmma (async proxy)
        if constexpr (kAltPages) {  // hand P^T, gamma and the row state to the other warpgroup
            named_barrier_arrive(kBarPass0 + (wg ^ 1), kConsumerThreads);
            named_barrier_sync(kBarWg0 + wg, kWgThreads);
        } else {
            named_barrier_sync(kOwnRowsPv ? kBarWg0 + wg : kBarConsumers, kPvBarThreads);
        }
    };
    // Softmax of block it with rows = M (WG_MODE 4, SPEC 5 as written): thread (w, g, c) holds
    // rows 16w + g + 8h (h = 0, 1) at tokens 8j + 2c + e (s_cur[4j + 2h + e]), so a row's block
    // max and block max of e * s_k are quad reductions and every thread of the quad derives the
    // row's m, sigma and gamma itself; the state of the row after block it - 1 comes from the
    // other warpgroup through rowstate_s.
    auto softmax_rows_m = [&](int it) {
        float (&s_acc)[kSAcc] = s_cur;
        const unsigned char* scales = rope_of(it) + kTileBytes;
        const int page_first = (block_begin + it) * kPageTokens;
        const int valid = valid_of(it);
        unsigned char* p_s = p_tile_of(it);
        float* gamma_buf = gamma_of(it);
        constexpr int kTokens = kSAcc / 2;  // tokens of this thread: 8j + 2c + e
        float ks[kTokens];                  // their scales s_k, 0 past the valid tokens
        auto token_of = [&](int t) { return 8 * (t / 2) + 2 * c + t % 2; };
        auto scale_of = [&](int t) { return *reinterpret_cast<const float*>(scales + token_of(t) * VEC_BYTES); };
        if (!ROWS_M_WHOLE || valid < kPageTokens) {  // (unused cache rows may hold NaN scales)
#pragma unroll
            for (int t = 0; t < kTokens; ++t) ks[t] = token_of(t) < valid ? scale_of(t) : 0.f;
        } else {
#pragma unroll
            for (int t = 0; t < kTokens; ++t) ks[t] = scale_of(t);
        }
        // The thread's two rows go side by side, so that their dependency chains (shuffles,
        // divisions) interleave: the softmax is latency-bound (too few warps per scheduler).
        constexpr int kRowsPerThread = 2;
        float4 st[kRowsPerThread];  // m, sigma, gamma of the block before
        float2 rc[kRowsPerThread];  // logit scale, visible keys
        int row_of[kRowsPerThread];
#pragma unroll
        for (int h = 0; h < kRowsPerThread; ++h) {
            row_of[h] = 16 * w + g + 8 * h;
            st[h] = rowstate_s[row_of[h]];
            rc[h] = rowconst_s[row_of[h]];
        }
        auto logit = [&](int h, int t) -> float& { return s_acc[4 * (t / 2) + 2 * h + t % 2]; };
        // a page both rows see whole (every page but a request's last, or a causal row's) skips
        // the masks
        const int vis_min = min(__float_as_int(rc[0].y), __float_as_int(rc[1].y));
        const bool whole = page_first + kPageTokens <= vis_min;
        // x turns into y = x s_k (the row's logit scale, positive, is applied to the block max
        // and inside the exponent's FMA: one multiply per logit fewer)
        float bmax[kRowsPerThread] = {-INFINITY, -INFINITY};
        if (whole) {
#pragma unroll
            for (int t = 0; t < kTokens; ++t)
#pragma unroll
                for (int h = 0; h < kRowsPerThread; ++h) {
                    float& x = logit(h, t);
                    x *= ks[t];
                    bmax[h] = fmaxf(bmax[h], x);
                }
        } else {
#pragma unroll
            for (int t = 0; t < kTokens; ++t)
#pragma unroll
                for (int h = 0; h < kRowsPerThread; ++h) {
                    float& x = logit(h, t);
                    const bool seen = page_first + 8 * (t / 2) + 2 * c + t % 2 < __float_as_int(rc[h].y);
                    x = seen ? x * ks[t] : -INFINITY;
                    bmax[h] = fmaxf(bmax[h], x);
                }
        }
        quad_max2(bmax[0], bmax[1]);
        trace(it, kSoftmaxPoint0);
        bool act[kRowsPerThread];
        float mnew[kRowsPerThread], esum[kRowsPerThread] = {0.f, 0.f}, etmax[kRowsPerThread] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < kRowsPerThread; ++h) {
            act[h] = bmax[h] > -INFINITY;
            mnew[h] = act[h] ? fmaxf(st[h].x, bmax[h] * rc[h].x) : st[h].x;
        }
        // x turns into e * s_k, e = exp2(y l - m_new); `guarded`: a literal at both call sites, so
        // that a whole page's pass carries no per-logit test (ROWS_M_WHOLE)
        auto exp_pass = [&](const bool guarded) {
#pragma unroll
            for (int t = 0; t < kTokens; ++t)
#pragma unroll
                for (int h = 0; h < kRowsPerThread; ++h) {
                    float& x = logit(h, t);
                    const float e = !guarded || (act[h] && x > -INFINITY) ? fast_exp2(fmaf(x, rc[h].x, -mnew[h])) : 0.f;
                    esum[h] += e;
                    x = e * ks[t];
                    etmax[h] = fmaxf(etmax[h], x);
                }
        };
        if (ROWS_M_WHOLE && whole) exp_pass(false);
        else exp_pass(!whole);
        quad_max2(etmax[0], etmax[1]);
        trace(it, kSoftmaxPoint0 + 1);
        // The divisions by 448 and by sigma are multiplications by reciprocals here (each within
        // an ulp of the quotient; the exponentials are approximate anyway): the correctly
        // rounded divisions' fix-up code sat on the softmax's critical path.
        float signew[kRowsPerThread], inv[kRowsPerThread];
#pragma unroll
        for (int h = 0; h < kRowsPerThread; ++h) {
            signew[h] = act[h] ? fmaxf(etmax[h] * kInvE4m3Max, kPScaleFloor) : st[h].y;
            inv[h] = fast_rcp(signew[h]);
            const float gamma = !act[h] ? 1.f
                                        : (st[h].x == -INFINITY ? 0.f : fast_exp2(st[h].x - mnew[h]) * (st[h].y * inv[h]));
            // this warpgroup's L partial last saw block it - 2: rescale by both gammas
            l_run[h] = gamma * st[h].z * l_run[h] + esum[h] * inv[h];
            st[h] = make_float4(mnew[h], signew[h], gamma, 0.f);
        }
        trace(it, kSoftmaxPoint0 + 2);
        __syncwarp();  // the quad's other lanes read rowstate_s above
        if (c == 0) {
#pragma unroll
            for (int h = 0; h < kRowsPerThread; ++h) {
                rowstate_s[row_of[h]] = st[h];
                gamma_buf[row_of[h]] = st[h].z;
            }
        }
        // P^T row n: bytes 16 q + 4c + {0, 1, 2, 3} hold tokens 16 q + {2c, 2c+1, 2c+8, 2c+9};
        // P = e s_k / sigma as e s_k times the rounded reciprocal (within an ulp of the
        // quotient before the E4M3 rounding; exp2 is approximate anyway)
#pragma unroll
        for (int q = 0; q < kTokens / 4; ++q)
#pragma unroll
            for (int h = 0; h < kRowsPerThread; ++h) {
                auto p_of = [&](int t) { return logit(h, t) * inv[h]; };
                const unsigned packed = f32x4_to_e4m3x4(p_of(4 * q), p_of(4 * q + 1), p_of(4 * q + 2), p_of(4 * q + 3));
                *reinterpret_cast<unsigned*>(p_s + swz64(row_of[h], 16 * q + 4 * c)) = packed;
            }
        trace(it, kSoftmaxPoint0 + 3);
        // publish_p's proxy fence and barriers order these stores before both warpgroups' PV of
        // the page and before the stage's next TMA write
        if (kTailZero && valid < kPageTokens) zero_tail_rows(page_of(it), valid, wtid);
        publish_p();
    };
    // Softmax of block it (SPEC 5): logits, masks, block statistics, P^T into shared memory.
    auto softmax_step = [&](int it) {
        float (&s_acc)[kSAcc] = s_cur;

        // ---- logits, masks, warp-local block statistics --------------------------------------
        const int page_first = (block_begin + it) * kPageTokens;
        const int valid = valid_of(it);
        const unsigned char* scales = rope_of(it) + kTileBytes;
        const float ks_a = tok_a < valid ? *reinterpret_cast<const float*>(scales + tok_a * VEC_BYTES) : 0.f;
        const float ks_b = tok_b < valid ? *reinterpret_cast<const float*>(scales + tok_b * VEC_BYTES) : 0.f;
        // s_acc turns into e = exp2(logit - warp max) in place. The rows go in groups of
        // kStatRows whose shuffle chains interleave (the softmax is latency-bound: a store per
        // row inside the loop serializes them, measured 30% slower), each group's (warp max,
        // warp max of e * s_k) stored after it, so that 64-row softmaxes stay in registers.
        // A page every real row sees whole (CTA-uniform; padding rows have a zero logit scale)
        // skips the masks and the exp guards (below 64 rows: the second copy of the loop costs
        // the 64-row layouts a spill; rows = M has its own).
        // (whole_page is a literal at both call sites, so each inlined copy folds it; the device's
        // NVRTC rejects generic lambdas, so it is not a template parameter)
        // The rows' (warp max, warp max of e * s_k): one reduction per row, interleaved row by
        // row, into mw / etw (stored below by lanes g = 0); kTransposedStats: reduced by
        // transposition (transposed_col_max) and stored here by the lanes that hold each row,
        // the warp maxima broadcast back for the exponentials.
        // row i's logits times its logit scale and the tokens' s_k, in place; masked to -inf past
        // the row's visible keys
        auto scale_logits = [&](int i, const bool whole_page, float& sa, float& sb) {
            const float2 rc = rowconst_s[qk_row0 + 8 * (i / 2) + 2 * c + (i % 2)];
            const int vis = __float_as_int(rc.y);
            if (whole_page) {
                sa *= rc.x * ks_a;
                sb *= rc.x * ks_b;
            } else {
                sa = page_first + tok_a < vis ? sa * (rc.x * ks_a) : -INFINITY;
                sb = page_first + tok_b < vis ? sb * (rc.x * ks_b) : -INFINITY;
            }
        };
        auto stats_group = [&](int i0, const bool whole_page, float (&mw)[kStatRows], float (&etw)[kStatRows]) {
            constexpr int kLanesPerRow = 8 / kStatRows;  // transposed: lanes g that hold one row
            float own_max = 0.f;
            if constexpr (kTransposedStats) {
#pragma unroll
                for (int r = 0; r < kStatRows; ++r) {
                    const int i = i0 + r, j = i / 2, e = i % 2;
                    float& sa = s_acc[4 * j + e];
                    float& sb = s_acc[4 * j + 2 + e];
                    scale_logits(i, whole_page, sa, sb);
                    etw[r] = fmaxf(sa, sb);  // (the row's maxima, before the transposition)
                }
                own_max = transposed_col_max(etw, lane);
#pragma unroll
                for (int r = 0; r < kStatRows; ++r) mw[r] = __shfl_sync(FULL_MASK, own_max, 4 * kLanesPerRow * r + c);
            }
#pragma unroll
            for (int r = 0; r < kStatRows; ++r) {
                const int i = i0 + r, j = i / 2, e = i % 2;
                float& sa = s_acc[4 * j + e];
                float& sb = s_acc[4 * j + 2 + e];
                if constexpr (!kTransposedStats) {
                    scale_logits(i, whole_page, sa, sb);
                    mw[r] = warp_col_max(fmaxf(sa, sb));
                }
                const float ea = whole_page || (mw[r] > -INFINITY && sa > -INFINITY) ? fast_exp2(sa - mw[r]) : 0.f;
                const float eb = whole_page || (mw[r] > -INFINITY && sb > -INFINITY) ? fast_exp2(sb - mw[r]) : 0.f;
                sa = ea;
                sb = eb;
                etw[r] = kTransposedStats ? fmaxf(ea * ks_a, eb * ks_b) : warp_col_max(fmaxf(ea * ks_a, eb * ks_b));
            }
            if constexpr (kTransposedStats) {
                const float own_et = transposed_col_max(etw, lane);
                const int i = i0 + g / kLanesPerRow;
                if (g % kLanesPerRow == 0) stats_s[w * kQkRows + 8 * (i / 2) + 2 * c + (i % 2)] = make_float2(own_max, own_et);
            }
        };
        constexpr bool kWholePath = kRows < 64;
        const bool whole = kWholePath && page_first + kPageTokens <= min_visible;
#pragma unroll
        for (int i0 = 0; i0 < kOwnRows; i0 += kStatRows) {
            float mw[kStatRows], etw[kStatRows];
            if constexpr (kWholePath) {
                if (whole) stats_group(i0, true, mw, etw);
                else stats_group(i0, false, mw, etw);
            } else {
                stats_group(i0, false, mw, etw);
            }
            if (!kTransposedStats && g == 0) {
#pragma unroll
                for (int r = 0; r < kStatRows; ++r) {
                    const int i = i0 + r;
                    stats_s[w * kQkRows + 8 * (i / 2) + 2 * c + (i % 2)] = make_float2(mw[r], etw[r]);
                }
            }
        }
        trace(it, kSoftmaxPoint0);
        named_barrier_sync(kBarWg0 + wg, kWgThreads);
        // the RoPE ring: QK and the scales' loads (used above) are the slot's last readers
        if (kSplitRing && lane == 0) mbarrier_arrive(&rope_empty[it % kRopeRing]);
        trace(it, kSoftmaxPoint0 + 1);

        // ---- block statistics, once per row: m, sigma, gamma and each warp's rescale factor --
        unsigned char* p_s = p_tile_of(it);
        float* gamma_buf = gamma_of(it);
        // Row n's step over block it from its state `st` after block it - 1 (m, sigma, and the
        // gamma of block it - 1: this warpgroup's L partials last saw block it - 2) and the four
        // warps' (max, max of e s_k); f_w: warp w's rescale factor exp2(max_w - m_new).
        struct RowStep {
            float m, sig, inv, gamma, gamma_l;
        };
        auto row_step = [&](const float4 st, int n, float (&fk)[4]) {
            float2 parts[4];
            float bmax = -INFINITY;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                parts[k] = stats_s[k * kQkRows + n];
                bmax = fmaxf(bmax, parts[k].x);
            }
            const float mnew = fmaxf(st.x, bmax);
            float etmax = 0.f;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                fk[k] = parts[k].x > -INFINITY ? fast_exp2(parts[k].x - mnew) : 0.f;
                etmax = fmaxf(etmax, fk[k] * parts[k].y);
            }
            const bool act = bmax > -INFINITY;
            // reciprocals instead of correctly rounded divisions; up to 32 rows of mode 3 the
            // SFU's, as in the rows = M softmax (see kRowStepFastRcp)
            const float signew = act ? fmaxf(etmax * kInvE4m3Max, kPScaleFloor) : st.y;
            const float inv = kRowStepFastRcp ? fast_rcp(signew) : __frcp_rn(signew);
            const float gamma = !act ? 1.f : (st.x == -INFINITY ? 0.f : fast_exp2(st.x - mnew) * (st.y * inv));
            return RowStep{act ? mnew : st.x, act ? signew : st.y, inv, gamma, kAltPages ? gamma * st.z : gamma};
        };
        // kWarpRowState: this thread's rows 8j + 2c + e, f_w / sigma and L's rescale (the other
        // path reads them from the row info where they are used: 64 rows' worth would spill)
        constexpr int kFactorRows = kWarpRowState ? kOwnRows : 1;
        float f_inv_of[kFactorRows], gamma_l_of[kFactorRows];
        if constexpr (kWarpRowState) {
            // lane n derives row n in every warp (lanes past kQkRows repeat a row); warp 0 keeps
            // the state, the others take their rows' values by shuffles
            const int n = lane % kQkRows;
            float fk[4];
            const RowStep r = row_step(rowstate_at(it - 1)[n], n, fk);
            if (w == 0 && lane < kQkRows) {
                rowstate_at(it)[n] = make_float4(r.m, r.sig, r.gamma, 0.f);
                gamma_buf[n] = r.gamma;
            }
            // warp w's own factor fk[w], recomputed from its statistics (the same operations):
            // an array indexed by the warp would go to local memory
            const float own_max = stats_s[w * kQkRows + n].x;
            const float f_inv = (own_max > -INFINITY ? fast_exp2(own_max - r.m) : 0.f) * r.inv;
            trace(it, kSoftmaxPoint0 + 2);
            trace(it, kSoftmaxPoint0 + 3);
#pragma unroll
            for (int i = 0; i < kOwnRows; ++i) {
                const int src = 8 * (i / 2) + 2 * c + (i % 2);
                f_inv_of[i] = __shfl_sync(FULL_MASK, f_inv, src);
                gamma_l_of[i] = __shfl_sync(FULL_MASK, r.gamma_l, src);
            }
        } else {
            if (wtid < kQkRows) {
                // alternate pages: the row state after block it - 1 (the other warpgroup's)
                const float4 st = kAltPages ? rowstate_at(it - 1)[wtid] : make_float4(row_m, row_sig, 1.f, 0.f);
                float fk[4];
                const RowStep r = row_step(st, wtid, fk);
                row_m = r.m;
                row_sig = r.sig;
                if constexpr (kAltPages) rowstate_at(it)[wtid] = make_float4(row_m, row_sig, r.gamma, 0.f);
                float4* info = reinterpret_cast<float4*>(rowinfo_s + wtid * kRowInfoFloats);
                info[0] = make_float4(r.sig, r.inv, r.gamma, r.gamma_l);
                info[1] = make_float4(fk[0], fk[1], fk[2], fk[3]);
                gamma_buf[qk_row0 + wtid] = r.gamma;
            }
            trace(it, kSoftmaxPoint0 + 2);
            named_barrier_sync(kBarWg0 + wg, kWgThreads);
            trace(it, kSoftmaxPoint0 + 3);
        }
        // (f_w / sigma, L's rescale) of the thread's row i
        auto row_factors = [&](int i) {
            if constexpr (kWarpRowState) {
                return make_float2(f_inv_of[i], gamma_l_of[i]);
            } else {
                const float* info = rowinfo_s + (8 * (i / 2) + 2 * c + (i % 2)) * kRowInfoFloats;
                return make_float2(info[4 + w] * info[1], info[3]);
            }
        };

        // ---- P = e4m3(e s_k f / sigma) into P^T[row][token'], L partials ---------------------
        // Lanes g and g^1 hold tokens k and k+1 of the permuted token order; each pair packs 4
        // consecutive bytes of one row (even g: row 8j+2c, odd g: row 8j+2c+1).
#pragma unroll
        for (int j = 0; j < kOwnRows / 2; ++j) {
            float pv[2][2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = 2 * j + e;
                const float2 factors = row_factors(i);
                const float f_inv = factors.x;
                const float esum = s_acc[4 * j + e] + s_acc[4 * j + 2 + e];  // this thread's e of the row
                l_run[i] = factors.y * l_run[i] + esum * f_inv;
                pv[e][0] = s_acc[4 * j + e] * ks_a * f_inv;
                pv[e][1] = s_acc[4 * j + 2 + e] * ks_b * f_inv;
            }
            const unsigned mine = f32x4_to_e4m3x4(pv[0][0], pv[1][0], pv[0][1], pv[1][1]);
            const unsigned other = __shfl_xor_sync(FULL_MASK, mine, 4);
            constexpr unsigned kEvenRow = 0x6240, kOddRow = 0x3715;
            const unsigned packed = (g & 1) ? prmt(mine, other, kOddRow) : prmt(mine, other, kEvenRow);
            const int n = qk_row0 + 8 * j + 2 * c + (g & 1);
            const int byte = 16 * w + 4 * (g >> 1);
            *reinterpret_cast<unsigned*>(p_s + swz64(n, byte)) = packed;
        }
        publish_p();
    };
    // PV of block it, then the page goes back to the producer. `masked`: the page is partial
    // (a request's last), so V^T's bytes past `valid` are masked (unused cache rows may hold
    // NaN patterns; P is 0 there, but 0 x NaN is NaN); a literal at both call sites of pv_page,
    // so a whole page's PV carries no mask instructions.
    // `seen`: this warpgroup waited for the page's bytes already (its own QK of the page).
    auto pv_page = [&](int it, const bool masked, const bool seen) {
        // alternate pages: the other warpgroup waited for this page; the completed phase is
        // this warpgroup's proof that the TMA bytes are visible (the page cannot be refilled
        // before this PV releases it)
        if (kAltPages && !seen) full.wait(it);
        unsigned char* page = page_of(it);
        const int valid = valid_of(it);
        const unsigned char* p_s = p_tile_of(it);
        const float* gamma_buf = gamma_of(it);
        // ---- PV: O^T[dims x rows] = gamma O^T + V^T . P^T ------------------------------------
        // gamma of rows 8j + 2c and 8j + 2c + 1 of this warpgroup's PV: loaded once per page,
        // except with alternate pages, which reads it where it is used (in registers for all
        // m-tiles it spills next to a 64-row O and a 64-row softmax's L partials)
        float2 gam[kPvRows / 8];
        auto gamma_load = [&](int j) {
            return *reinterpret_cast<const float2*>(gamma_buf + pv_row0 + 8 * j + 2 * c);
        };
        constexpr bool kGammaInRegs = !kAltPages || (kRowsM && !kRowsMColumns);
        if constexpr (kGammaInRegs) {
#pragma unroll
            for (int j = 0; j < kPvRows / 8; ++j) gam[j] = gamma_load(j);
        }
        auto gamma_pair = [&](int j) {
            return kGammaInRegs || (kRowsMColumns && j < kGammaEarly) ? gam[j] : gamma_load(j);
        };
        if constexpr (!kPvPromote) {  // the tensor cores add P V to the rescaled O
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int j = 0; j < kPvRows / 8; ++j) {
                    const float2 gp = gamma_pair(j);
                    o_acc[mt][4 * j + 0] *= gp.x;
                    o_acc[mt][4 * j + 1] *= gp.y;
                    o_acc[mt][4 * j + 2] *= gp.x;
                    o_acc[mt][4 * j + 3] *= gp.y;
                }
        }
        // tokens of this thread's A bytes: {2c, 2c+1, 8+2c, 9+2c} (+16, +32); mask past `valid`
        unsigned vmask[kPvKSteps][2];
#pragma unroll
        for (int ks = 0; ks < kPvKSteps; ++ks)
#pragma unroll
            for (int h = 0; h < 2; ++h) vmask[ks][h] = !masked ? ~0u : v_token_mask(ks, h, c, valid);
        const unsigned long long p_desc = make_smem_desc(p_s + pv_row0 * kPRowBytes, kSwizzle64B, kSwizzleAtom64);
        // V^T A fragment of this warp's 16 dims of m-tile mt, tokens [32 ks, 32 ks + 32)
        const int v_lane = kRowsMColumns ? lane + loop_zero() : lane;
        // (kVOffsets) this thread's ldmatrix offset in m-tile 0 at k-step 0; m-tile mt's is it
        // XOR 64 for odd mt, plus mt / 2 content tiles, plus 32 token rows per k-step
        const int v_off = page_v_offset(pv_dim0 + 16 * w, lane);
        auto v_fragment_of = [&](int mt, int ks, unsigned (&frag)[4]) {
            v_fragment_at(page, v_off, pv_dim0 + 16 * w, mt, ks, v_lane, frag);
            if (masked) {
#pragma unroll
                for (int i = 0; i < 4; ++i) frag[i] &= vmask[ks][i / 2];
            }
        };
        if constexpr (kPvPromote) {  // each m-tile's P V in a fresh accumulator, O = gamma O + it
            // with kPvPipelined, two accumulators in turn: m-tile mt + 1 runs on the tensor cores
            // while mt is added
            float t[kPvPipelined ? 2 : 1][kOAcc];
            auto issue_pv = [&](int mt, float (&acc)[kOAcc]) {
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < kPvKSteps; ++ks) {
                    unsigned a[4];
                    v_fragment_of(mt, ks, a);
                    wgmma_fp8_rs(acc, a, p_desc + ((kFp8KStep * ks) >> 4), ks > 0);
                }
                wgmma_commit();
            };
            // without the second accumulator, m-tile mt + 1's V^T fragments are built while mt's
            // wgmmas run (two fragment sets: an in-flight wgmma keeps its registers)
            unsigned frags[2][kPvKSteps][4];
            auto build_frags = [&](int mt) {
#pragma unroll
                for (int ks = 0; ks < kPvKSteps; ++ks) v_fragment_of(mt, ks, frags[mt % 2][ks]);
            };
            if constexpr (kPvPipelined) issue_pv(0, t[0]);
            else build_frags(0);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                if constexpr (!kPvPipelined) {
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < kPvKSteps; ++ks)
                        wgmma_fp8_rs(t[0], frags[mt % 2][ks], p_desc + ((kFp8KStep * ks) >> 4), ks > 0);
                    wgmma_commit();
                    if (mt + 1 < kMTiles) build_frags(mt + 1);
                    if constexpr (kRowsMColumns) {  // loads in flight during the wgmmas
#pragma unroll
                        for (int j = 0; j < kGammaEarly; ++j) gam[j] = gamma_load(j);
                    }
                    wgmma_wait<0>();
                } else if (mt + 1 < kMTiles) {
                    issue_pv(mt + 1, t[(mt + 1) % 2]);
                    wgmma_wait<1>();
                } else {
                    wgmma_wait<0>();
                }
                float (&done)[kOAcc] = t[kPvPipelined ? mt % 2 : 0];
                fence_accumulators(done);
#pragma unroll
                for (int j = 0; j < kPvRows / 8; ++j) {
                    const float2 gp = gamma_pair(j);
                    o_acc[mt][4 * j + 0] = fmaf(gp.x, o_acc[mt][4 * j + 0], done[4 * j + 0]);
                    o_acc[mt][4 * j + 1] = fmaf(gp.y, o_acc[mt][4 * j + 1], done[4 * j + 1]);
                    o_acc[mt][4 * j + 2] = fmaf(gp.x, o_acc[mt][4 * j + 2], done[4 * j + 2]);
                    o_acc[mt][4 * j + 3] = fmaf(gp.y, o_acc[mt][4 * j + 3], done[4 * j + 3]);
                }
            }
        } else {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) fence_accumulators(o_acc[mt]);
            wgmma_fence();
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
                for (int ks = 0; ks < kPvKSteps; ++ks) {
                    unsigned a[4];
                    v_fragment_of(mt, ks, a);
                    wgmma_fp8_rs(o_acc[mt], a, p_desc + ((kFp8KStep * ks) >> 4));
                }
                if constexpr (kPvGroups) {  // keep at most two m-tiles' A fragments in flight
                    wgmma_commit();
                    if (mt + 1 < kMTiles) wgmma_wait<1>();
                }
            }
            if constexpr (!kPvGroups) wgmma_commit();
        }
        // PV(it) and QK(it+1) complete: the page can be refilled, s_next becomes s_cur
        wgmma_wait<0>();
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) fence_accumulators(o_acc[mt]);
        if (lane == 0) mbarrier_arrive(&empty[it % STAGES]);
        if (kPrefetchQk && it + 1 < num_blocks) {
            fence_accumulators(s_next);
#pragma unroll
            for (int i = 0; i < kSAcc; ++i) s_cur[i] = s_next[i];
        }
    };
    // (the second copy of the PV code costs the 64-row layouts a spill: they mask every page,
    // except rows = M, whose partial pages' tails are zeros: kTailZero)
    auto pv_step = [&](int it, bool seen = false) {
        if (!kTailZero && (kRows == 64 || valid_of(it) < kPageTokens)) pv_page(it, true, seen);
        else pv_page(it, false, seen);
    };
    // kPvPairs, a turn's two PVs: the other warpgroup's page it - 1 and this warpgroup's page
    // it, per m-tile in two fresh accumulators of one wgmma group, then
    // O = gamma(it) (gamma(it - 1) O + V^T P^T(it - 1)) + V^T P^T(it): the float32 operations
    // and their order of two pv_page calls (the same O, bit for bit) with half the waits.
    // `masked`: page it is a request's last (page it - 1, followed by it, never is).
    auto pv_pair = [&](int it, const bool masked) {
        const int other = it - 1;
        full.wait(other);  // see pv_page
        const unsigned char* pages[2] = {page_of(other), page_of(it)};
        unsigned long long p_desc[2];
        float2 gam[2][kPvRows / 8];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            p_desc[k] = make_smem_desc(p_tile_of(it - 1 + k) + pv_row0 * kPRowBytes, kSwizzle64B, kSwizzleAtom64);
#pragma unroll
            for (int j = 0; j < kPvRows / 8; ++j)
                gam[k][j] = *reinterpret_cast<const float2*>(gamma_of(it - 1 + k) + pv_row0 + 8 * j + 2 * c);
        }
        unsigned vmask[kPvKSteps][2];
#pragma unroll
        for (int ks = 0; ks < kPvKSteps; ++ks)
#pragma unroll
            for (int h = 0; h < 2; ++h) vmask[ks][h] = !masked ? ~0u : v_token_mask(ks, h, c, valid_of(it));
        float t[2][2][kOAcc];  // [m-tile in turn][page]
        const int v_off = page_v_offset(pv_dim0 + 16 * w, lane);  // (see pv_page)
        // V^T fragment (page k, k-step ks) of m-tile mt, page it's bytes masked
        auto fragment = [&](int mt, int k, int ks, unsigned (&a)[4]) {
            v_fragment_at(pages[k], v_off, pv_dim0 + 16 * w, mt, ks, lane, a);
            if (masked && k == 1) {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] &= vmask[ks][i / 2];
            }
        };
        auto take = [&](int mt, float (&done)[2][kOAcc]) {
#pragma unroll
            for (int j = 0; j < kPvRows / 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int a = 4 * j + i;
                    const float g0 = i % 2 ? gam[0][j].y : gam[0][j].x, g1 = i % 2 ? gam[1][j].y : gam[1][j].x;
                    o_acc[mt][a] = fmaf(g1, fmaf(g0, o_acc[mt][a], done[0][a]), done[1][a]);
                }
        };
        if constexpr (kPvFragAhead) {
            // m-tile mt + 1's fragments are built right after m-tile mt's wgmmas are issued, i.e.
            // while m-tiles mt - 1 and mt run: three sets, set (mt + 1) % 3 is mt - 2's, whose
            // wgmmas were waited for
            unsigned frag[3][2][kPvKSteps][4];
            auto build = [&](int mt) {
#pragma unroll
                for (int k = 0; k < 2; ++k)
#pragma unroll
                    for (int ks = 0; ks < kPvKSteps; ++ks) fragment(mt, k, ks, frag[mt % 3][k][ks]);
            };
            build(0);
            accumulator_pipeline<kMTiles, 2>(t, [&](int mt, float (&acc)[2][kOAcc]) {
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 2; ++k)
#pragma unroll
                    for (int ks = 0; ks < kPvKSteps; ++ks)
                        wgmma_fp8_rs(acc[k], frag[mt % 3][k][ks], p_desc[k] + ((kFp8KStep * ks) >> 4), ks > 0);
                wgmma_commit();
                if (mt + 1 < kMTiles) build(mt + 1);
            }, take);
        } else {
            // each fragment right before its wgmma
            accumulator_pipeline<kMTiles, 2>(t, [&](int mt, float (&acc)[2][kOAcc]) {
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 2; ++k)
#pragma unroll
                    for (int ks = 0; ks < kPvKSteps; ++ks) {
                        unsigned a[4];
                        fragment(mt, k, ks, a);
                        wgmma_fp8_rs(acc[k], a, p_desc[k] + ((kFp8KStep * ks) >> 4), ks > 0);
                    }
                wgmma_commit();
            }, take);
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) fence_accumulators(o_acc[mt]);
        if (lane == 0) {
            mbarrier_arrive(&empty[other % STAGES]);
            mbarrier_arrive(&empty[it % STAGES]);
        }
    };
    // WG_MODE 6, PV of block it for this warpgroup's 256 dims: O[rows x dims] = gamma O + P . V,
    // A = P (the block's P tile), B = V^T (the transposed page), both K-major from shared
    // memory; each 64-dim chunk in a fresh accumulator, two in turn, so that chunk nc + 1 runs
    // on the tensor cores while chunk nc is added in float32. Thread (w, g, c) holds rows
    // 16w + g + 8h at dims 8j + 2c + e of each chunk (o_acc[nc][4j + 2h + e]).
    // The owner wrote V^T during its QK, before the softmax that published P (fence and
    // barriers in publish_p); the other warpgroup met that hand-over before this PV.
    auto pv_rows_m = [&](int it) {
        const int stage = it % STAGES;
        const unsigned char* page = page_of(it);
        const float* gamma_buf = gamma_of(it);
        const float gam[2] = {gamma_buf[16 * w + g], gamma_buf[16 * w + g + 8]};
        const unsigned long long a_desc = make_smem_desc(p_tile_of(it), kSwizzle64B, kSwizzleAtom64);
        auto issue = [&](int nc, float (&acc)[kOAcc]) {
            const int dim = pv_dim0 + 64 * nc;
            const unsigned long long b_desc =
                make_smem_desc(page + vt_slot(dim / kBox) * kTileBytes + (dim % kBox) * kPRowBytes, kSwizzle64B,
                               kSwizzleAtom64);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kPvKSteps; ++ks)
                wgmma_fp8_ss(acc, a_desc + ((kFp8KStep * ks) >> 4), b_desc + ((kFp8KStep * ks) >> 4), ks > 0);
            wgmma_commit();
        };
        float t[2][kOAcc];
        accumulator_pipeline<kMTiles, 2>(t, issue, [&](int nc, float (&done)[kOAcc]) {
#pragma unroll
            for (int i = 0; i < kOAcc; ++i) o_acc[nc][i] = fmaf(gam[(i / 2) % 2], o_acc[nc][i], done[i]);
        });
        if (lane == 0) mbarrier_arrive(&empty[stage]);
    };

    if constexpr (kPingPong) {
        // The warpgroups take turns on the tensor cores: a turn is PV of the previous block and
        // QK of this one; the softmax runs outside the turn, while the other warpgroup has it.
        // Warpgroup wg waits on barrier kBarTurn0 + wg (its 128 threads + the other's 128
        // arrivals); warpgroup 1 lets warpgroup 0 start. Arrivals match waits exactly: warpgroup
        // 1 skips its last one.
        if (wg == 1 && num_blocks > 0) named_barrier_arrive(kBarTurn0, kConsumerThreads);
        for (int it = 0; it < num_blocks; ++it) {
            named_barrier_sync(kBarTurn0 + wg, kConsumerThreads);
            if (it > 0) pv_step(it - 1);
            qk_step(it);
            mark_cta_time(kTimeFirstQk, timed_first && it == 0);
            if (wg == 0 || it + 1 < num_blocks) named_barrier_arrive(kBarTurn0 + (wg ^ 1), kConsumerThreads);
            softmax_step(it);
        }
        if (num_blocks > 0) pv_step(num_blocks - 1);
    } else if constexpr (kAltPages) {
        // Warpgroup wg owns blocks wg, wg + 2, ...; at its turn `it` it runs QK(it), waits for
        // the other warpgroup's block it - 1 (P^T, gamma, row state), runs the softmax of it
        // (handing it over), then PV(it - 1) and PV(it) for its dims. Each block's hand-over is
        // arrived at once by its owner and waited for once by the other, at the turn after it.
        for (int it = wg; it <= num_blocks; it += 2) {
            const bool mine = it < num_blocks;
            trace(it, 0);
#if TRACE_PHASES  // the time spent waiting for the page's bytes, apart from QK (whose wait then passes)
            if (mine) full.wait(it);
#endif
            trace(it, 1);
            if (mine) qk_step(it);
            trace(it, 2);
            mark_cta_time(kTimeFirstQk, timed_first && it == 0);
            if (it > 0) named_barrier_sync(kBarPass0 + wg, kConsumerThreads);
            trace(it, 3);
            if constexpr (kRowsM) {
                if (mine) softmax_rows_m(it);
            } else {
                if (mine) softmax_step(it);
            }
            trace(it, 8);
            if constexpr (kVtSmem) {
                if (it > 0) pv_rows_m(it - 1);
                trace(it, 9);
                if (mine) pv_rows_m(it);
            } else if constexpr (kPvPairs) {
                if (it > 0 && mine) {
                    if (valid_of(it) < kPageTokens) pv_pair(it, true);
                    else pv_pair(it, false);
                } else if (it > 0) {
                    pv_step(it - 1);
                } else if (mine) {
                    pv_step(it, true);
                }
                trace(it, 9);
            } else {
                if (it > 0) pv_step(it - 1);
                trace(it, 9);
                if (mine) pv_step(it, true);
            }
            trace(it, 10);
        }
    } else {
        for (int it = 0; it < num_blocks; ++it) {
            qk_step(it);
            mark_cta_time(kTimeFirstQk, timed_first && it == 0);
            softmax_step(it);
            pv_step(it);
        }
    }

    // ---- L per row: thread partials -> warp -> warpgroup; shared with the other warpgroup ----
    // alternate pages: the warpgroups leave the page loop at different times; both finish it
    // (every hand-over and shared-memory read of the loop) before either writes its L partials
    if constexpr (kAltPages) named_barrier_sync(kBarConsumers, kConsumerThreads);
    mark_cta_time(kTimeLoopEnd, timed);
    if constexpr (kRowsM) {  // row 16w + g + 8h: the quad's sum in slot 0, slots 1-3 zero
#pragma unroll
        for (int h = 0; h < kOwnRows; ++h) {
            const float lq = quad_sum(l_run[h]);
            lsum_s[(wg * 4 + c) * kQkRows + 16 * w + g + 8 * h] = c == 0 ? lq : 0.f;
        }
    } else {
#pragma unroll
        for (int i = 0; i < kOwnRows; ++i) {
            const float lw = warp_col_sum(l_run[i]);
            if (g == 0) lsum_s[(wg * 4 + w) * kQkRows + 8 * (i / 2) + 2 * c + (i % 2)] = lw;
        }
    }
    named_barrier_sync(kBarConsumers, kConsumerThreads);
    // L of CTA row n: the sum of its warpgroup's partials; alternate pages: both warpgroups'
    // partials, the one that did not see the last block rescaled by its gamma
    auto row_l_total = [&](int n) {
        auto wg_sum = [&](int owner, int nl) {
            float total = 0.f;
#pragma unroll
            for (int k = 0; k < 4; ++k) total += lsum_s[(owner * 4 + k) * kQkRows + nl];
            return total;
        };
        if constexpr (kAltPages) {
            if (num_blocks == 0) return 0.f;
            const int last = (num_blocks - 1) & 1;
            return wg_sum(last, n) + gamma_of(num_blocks - 1)[n] * wg_sum(last ^ 1, n);
        } else {
            return wg_sum(n / kRowsPerWg, n % kRowsPerWg);
        }
    };
    float rcp[kAllRows];  // the rows of O^T a thread holds (swapped PV; WG_MODE 6 has its own)
#pragma unroll
    for (int a = 0; a < (kVtSmem ? 0 : kAllRows); ++a) {
        const float total = row_l_total(pv_row0 + 8 * (a / 2) + 2 * c + (a % 2));
        rcp[a] = total > 0.f ? 1.f / total : 0.f;
    }

    // ---- epilogue: out = O / L (swapped PV: dims 2g, 2g+1 of each warp's 16), lse = m ln2 + log(sigma L)
    // the work item's partial slot is read here, not kept in a register through the page loop
    // (one item per CTA: its list row is blockIdx.y, which ptxas can read again here)
    const int partial = __ldg(&p.work[kColumnItems ? item : static_cast<int>(blockIdx.y)].partial);
    const bool to_partial = partial >= 0;
    // CLUSTER_FOLD: launched in clusters of a request's splits (ops/cluster_fold.py), a split's
    // rows go to its own shared memory (the stages: every consumer passed the barrier after the
    // page loop, and no load is in flight), merged across the cluster below
    const bool to_cluster = kClusterFold && to_partial;
    float* cluster_rows = reinterpret_cast<float*>(smem + kOffStages);
    float* const partial_out = kClusterFold ? cluster_rows : p.partial_out;
    const long part_rows = static_cast<long>(partial) * rows;
    // out = O / L: rows 16w + g + 8h; column 8j + 2c + e of a 64-dim chunk is dim 4c + 2e of its
    // 16 (j even) or the next dim (j odd): V^T holds each 16 dims even ones first
    if constexpr (kVtSmem) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = 16 * w + g + 8 * h;
            const int row = row0 + n;
            if (row >= rows) continue;
            const float total = row_l_total(n);
            const float rcp_row = total > 0.f ? 1.f / total : 0.f;
            const long base = to_partial ? (kClusterFold ? n * kClusterRowStride : (part_rows + row) * kDimV)
                                          : (row_base + row) * kDimV;
#pragma unroll
            for (int nc = 0; nc < kMTiles; ++nc)
#pragma unroll
                for (int q = 0; q < kOAcc / 8; ++q)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        store_out2(p.out, partial_out, base + pv_dim0 + 64 * nc + 16 * q + 4 * c + 2 * e,
                                   to_partial, o_acc[nc][8 * q + 2 * h + e] * rcp_row,
                                   o_acc[nc][8 * q + 4 + 2 * h + e] * rcp_row);
        }
    } else {
#pragma unroll
        for (int a = 0; a < kAllRows; ++a) {
            const int n = pv_row0 + 8 * (a / 2) + 2 * c + (a % 2);
            const int row = row0 + n;
            if (row >= rows) continue;
            const long base = to_partial ? (kClusterFold ? n * kClusterRowStride : (part_rows + row) * kDimV)
                                          : (row_base + row) * kDimV;
            const int j = a / 2, e = a % 2;
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                const int dim = pv_dim0 + mt * 64 + 16 * w + 2 * g;
                store_out2(p.out, partial_out, base + dim, to_partial, o_acc[mt][4 * j + e] * rcp[a],
                           o_acc[mt][4 * j + 2 + e] * rcp[a]);
            }
        }
    }
    if (wtid < kQkRows && (!kAltPages || wg == 0)) {
        const int n = qk_row0 + wtid;
        const int row = row0 + n;
        if constexpr (kAltPages) {
            const float4 st = rowstate_at(num_blocks - 1)[n];
            row_m = st.x;
            row_sig = st.y;
        }
        if (row < rows) {
            const float total = row_l_total(n);
            const float value = row_m > -INFINITY ? row_m * kLn2 + logf(row_sig * total)
                                                  : (to_partial ? -INFINITY : INFINITY);
            if (to_cluster) cluster_rows[kRows * kClusterRowStride + n] = value;
            else if (to_partial) p.partial_lse[part_rows + row] = value;
            else p.lse[lse_index(req, row, p.shape)] = value;
        }
    }
    mark_cta_time(kTimeStored, timed);
    // the cluster merges its splits together; otherwise the last split of the request to get
    // here merges them all (Q's tiles are free now)
    if (to_cluster) {
        cluster_fold<kConsumerThreads, kRows>(cluster_rows, cluster_size(), cluster_rank(), req, row0, rows, p.out, p.lse,
                                              p.shape, tid, kBarConsumers, reinterpret_cast<float*>(smem + kOffQ));
    } else if (to_partial && num_blocks > 0 && p.fold.arrivals != nullptr)
        fold_split<kConsumerThreads, kRows>(p.fold, req, row0, rows, p.partial_out, p.partial_lse, p.out, p.lse,
                                            p.shape, tid, kBarConsumers, reinterpret_cast<float*>(smem + kOffQ));
    mark_cta_time(kTimeEnd, timed);
}

// smem: roles::aligned_smem<kSmemAlign>(smem_raw), derived once at the kernel's entry
__device__ __forceinline__ void run(const Params& p, unsigned char* smem, unsigned char* smem_raw) {
    const int rows = p.shape.s_q * p.shape.h_q;
    const int row0 = blockIdx.x * kRows;
    if (row0 >= rows) return;
    mark_cta_time(kTimeEntry, threadIdx.x == 0);
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + kOffBars);
    unsigned long long* empty = full + STAGES;
    if (kSplitRing && threadIdx.x == 0) {  // a RoPE slot comes back from its owner's four warps
#pragma unroll
        for (int b = 0; b < kRopeRing; ++b) mbarrier_init(&empty[STAGES + b], kWgThreads / 32);
    }
    roles::init_pipeline_barriers(full, empty, STAGES, kConsumerWarps);  // (fences and syncs those too)
    auto producer = [&p, smem, full, empty](const int* table, int begin, int n, int base) {
        produce(p, smem, full, empty, table, begin, n, base);
    };
    // a column's items: everything the consumers derive from the CTA and shared memory's base
    // is derived again for each item (loop_zero), not carried through the item in registers
    auto consumer = [&p, smem_raw](int item, int begin, int n, int seqlen, int req, int phase) {
        const int zero = loop_zero();
        unsigned char* s = roles::aligned_smem<kSmemAlign>(smem_raw + zero);
        unsigned long long* f = reinterpret_cast<unsigned long long*>(s + kOffBars);
        const int rows = p.shape.s_q * p.shape.h_q + zero;
        consume(p, s, FullBarriers{f, phase}, f + STAGES, item, begin, n, seqlen, rows,
                (static_cast<int>(blockIdx.x) + zero) * kRows, static_cast<long>(req) * rows, req);
    };
    auto consumer_one = [&p, smem, full, empty, rows, row0](int item, int begin, int n, int seqlen, int req, int) {
        consume(p, smem, FullBarriers{full, 0}, empty, item, begin, n, seqlen, rows, row0,
                static_cast<long>(req) * rows, req);
    };
    const roles::Pipeline pipeline{full, empty, STAGES, 1, kConsumerWarps, kBarConsumers};
    if constexpr (kColumnItems)
        roles::run_column<true, kConsumerRegs>(p, pipeline, producer, consumer);
    else
        roles::run_column<false, kConsumerRegs>(p, pipeline, producer, consumer_one);
}

}  // namespace fp8wg
}  // namespace snapmla

extern "C" __global__ void __launch_bounds__(snapmla::fp8wg::kThreads, MIN_CTAS_PER_SM)
snapmla_decode_fp8_wgmma(const unsigned char* q_content, const float* q_scale,
                         const __nv_bfloat16* q_rope, const unsigned char* tmaps,
                         const int* block_table, const int* cache_seqlens,
                         const snapmla::WorkItem* work_list, int items_per_column, __nv_bfloat16* out, float* lse,
                         float* partial_out, float* partial_lse, int block_table_stride,
                         float softmax_scale_log2, int h_q, int s_q, int causal, const int* num_splits,
                         int* arrivals, int fold_max_splits) {
    extern __shared__ unsigned char smem_raw[];
    snapmla::launch_dependents();  // the combine may launch now; it waits for this grid to finish
    // dynamic shared memory is only 16-byte aligned: round up to the swizzle atom (roles::
    // aligned_smem, written out: through the helper here ptxas allocates the 64-row kernel
    // differently and spills 4 bytes)
    const unsigned base = snapmla::smem_addr(smem_raw);
    unsigned char* smem = smem_raw + ((snapmla::fp8wg::kSmemAlign - (base % snapmla::fp8wg::kSmemAlign)) %
                                      snapmla::fp8wg::kSmemAlign);
    const snapmla::fp8wg::Params p{q_content, q_scale, q_rope, tmaps, block_table, cache_seqlens,
                                   work_list, items_per_column, out, lse, partial_out, partial_lse, block_table_stride,
                                   softmax_scale_log2, snapmla::DecodeShape{h_q, s_q, causal},
                                   snapmla::SplitFold{num_splits, arrivals, fold_max_splits}};
    snapmla::fp8wg::run(p, smem, smem_raw);
}
