// Diagnostic, not a product kernel: the tensor cores' rate at the decode kernel's own wgmma
// shapes, with nothing else in the loop (scripts/wgmma_rate.py).
//
// Why: the FP8 ceiling of SPEC section 7 is a large GEMM's (m64n256 tiles), while the decode
// kernel's 64-row tiles run m64n64 wgmmas whose operands come from shared memory at twice the
// bytes per FLOP. This kernel measures what those shapes reach on their own, one, two or three
// warpgroups at a time, so that "how far from its roofline is the decode kernel" can be split
// into "how far the shapes allow" and "what the rest of the kernel costs".
//
// Each warpgroup runs its shape in groups of kGroupSteps wgmmas into a fresh accumulator
// (the decode kernel's promotion does the same), two accumulators in turn so that a group is
// in flight while the previous one is waited for (one for the 256-wide shape, whose
// accumulator takes 128 registers), and drains the pipeline every kRoundGroups groups.
// Operands are random finite bytes (zeros run faster).
// Thread 0 of each warpgroup records its clock64 cycles, so the rate per SM clock needs no
// knowledge of the clock.
//
// Switches (-D): NUM_WG = consumer warpgroups (1..3); WG0_SHAPE, WG1_SHAPE, WG2_SHAPE = each
// warpgroup's shape (kShape* below); STREAM 1 = one more warp streams a global buffer into a
// shared-memory ring with bulk copies (as the decode kernel's producer loads its pages) for as
// long as the warpgroups run, so that the table shows what those writes take from the operands.
#include "common/ptx.cuh"

#ifndef NUM_WG
#define NUM_WG 2
#endif
#ifndef STREAM
#define STREAM 0
#endif
#ifndef WG0_SHAPE
#define WG0_SHAPE 1
#endif
#ifndef WG1_SHAPE
#define WG1_SHAPE WG0_SHAPE
#endif
#ifndef WG2_SHAPE
#define WG2_SHAPE WG0_SHAPE
#endif

namespace rate {

using namespace snapmla;

// What each warpgroup runs (the decode kernel's phase each one stands for):
constexpr int kShapeQk = 1;       // FP8 m64n64k32, A and B from shared memory (QK, rows = M)
constexpr int kShapePv = 2;       // FP8 m64n64k32, A from registers, B = a 64-byte-row tile (PV)
constexpr int kShapePvLoad = 3;   // kShapePv plus the ldmatrix.trans that builds each A fragment
constexpr int kShapeRope = 4;     // BF16 m64n64k16 from shared memory (the RoPE tile of QK)
constexpr int kShapeWide = 5;     // FP8 m64n256k32 from shared memory (a large GEMM's shape)

constexpr int kWgThreads = 128;
constexpr int kStreamThreads = STREAM ? 32 : 0;
constexpr int kThreads = NUM_WG * kWgThreads + kStreamThreads;
constexpr int kAtomBytes = 128;        // a 128-byte-swizzled row
constexpr int kAtomGroupBytes = 8 * kAtomBytes;  // stride between 8-row core groups
constexpr int kRows = 64;              // M of every shape; N of the 64-wide ones
constexpr int kWideN = 256;
constexpr int kAtoms = 4;              // 512 bytes of K per row: four 128-byte atoms
constexpr int kTileBytes = kRows * kAtomBytes;        // one 64 x 128-byte atom tile
constexpr int kPRowBytes = 64;         // PV's B rows (64 tokens of FP8, 64-byte swizzle)
constexpr int kPAtomGroupBytes = 8 * kPRowBytes;
constexpr int kFp8KBytes = 32;         // bytes of K per FP8 wgmma (k32); bf16 k16 is 32 bytes too
constexpr int kABytes = kAtoms * kTileBytes;                 // 32 KB: A of the 64-row shapes
constexpr int kBBytes = kAtoms * kWideN * kAtomBytes;        // 128 KB: B up to 256 rows
constexpr int kPBytes = kRows * kPRowBytes;                  // 4 KB: PV's B
constexpr int kStreamSlots = 4;                 // copies in flight (the decode kernel's four stages)
constexpr int kStreamSlotBytes = 10 * 1024;     // 40 KB in flight: about a page per stage
constexpr int kOperandBytes = kABytes + kBBytes + kPBytes;
constexpr int kStreamBytes = STREAM ? kStreamSlots * kStreamSlotBytes : 0;
constexpr int kBarrierBytes = 64;               // the ring's mbarriers and the stop flag
constexpr int kSmemBytes = kOperandBytes + kStreamBytes + kBarrierBytes;
constexpr unsigned kFiniteMask = 0xB7B7B7B7u;  // no e4m3 NaN, bf16 exponents below 127

template <int kShape>
constexpr int kAccFloats = kShape == kShapeWide ? kWideN / 2 : kRows / 2;
template <int kShape>
constexpr int kAccSets = kShape == kShapeWide ? 1 : 2;
// wgmmas per commit group: 256 dims of QK, or four m-tiles of one page's PV; the wide shape,
// which has one accumulator and drains at each group's end, twice that
template <int kShape>
constexpr int kGroupSteps = kShape == kShapeWide ? 16 : 8;
constexpr int kRoundGroups = 8;  // groups between two drains of the wgmma pipeline

// Descriptor of k-step `step` (32 bytes of K) of a K-major 128-byte-swizzled operand whose
// atoms (all rows x 128 bytes) lie `atom_bytes` apart.
__device__ __forceinline__ unsigned long long k_step_desc(const unsigned char* base, int step, int atom_bytes) {
    constexpr int kStepsPerAtom = kAtomBytes / kFp8KBytes;
    return make_smem_desc(base + (step / kStepsPerAtom) * atom_bytes + (step % kStepsPerAtom) * kFp8KBytes,
                          kSwizzle128B, kAtomGroupBytes);
}

// One group: kGroupSteps wgmmas into `acc`, the first one overwriting it. `frag`: one A
// fragment per step (registers an in-flight wgmma reads must not be rewritten).
template <int kShape>
__device__ __forceinline__ void issue_group(float (&acc)[kAccFloats<kShape>], const unsigned char* a,
                                            const unsigned char* b, const unsigned char* p, int lane,
                                            unsigned (&frag)[kGroupSteps<kShape>][4]) {
#pragma unroll
    for (int s = 0; s < kGroupSteps<kShape>; ++s) {
        const int first = s == 0 ? 0 : 1;
        if constexpr (kShape == kShapeQk) {
            wgmma_fp8_ss(acc, k_step_desc(a, s, kTileBytes), k_step_desc(b, s, kTileBytes), first);
        } else if constexpr (kShape == kShapeRope) {
            wgmma_bf16_ss(acc, k_step_desc(a, s, kTileBytes), k_step_desc(b, s, kTileBytes), first);
        } else if constexpr (kShape == kShapeWide) {
            wgmma_fp8_ss(acc, k_step_desc(a, s, kTileBytes), k_step_desc(b, s, kWideN * kAtomBytes), first);
        } else {
            static_assert(kShape == kShapePv || kShape == kShapePvLoad, "unknown shape");
            // PV: B = P^T rows of 64 bytes (two k-steps), A = the V^T fragment in registers
            const unsigned long long desc = make_smem_desc(p + (s % 2) * kFp8KBytes, kSwizzle64B, kPAtomGroupBytes);
            if constexpr (kShape == kShapePvLoad) {
                // the decode kernel builds each fragment with one ldmatrix.trans per warp from
                // the page's 128-byte-swizzled tiles (the permutes are ALU work, left out)
                const int warp = (threadIdx.x / 32) % 4;
                ldmatrix_x4_trans(frag[s], a + (s % kAtoms) * kTileBytes + swz128(kFp8KBytes * (s % 2) + lane, 32 * warp));
            }
            wgmma_fp8_rs(acc, frag[s], desc, first);
        }
    }
    wgmma_commit();
}

template <int kShape>
__device__ __forceinline__ void run_shape(const unsigned char* smem, int groups, int lane, float& checksum) {
    const unsigned char* a = smem;
    const unsigned char* b = smem + kABytes;
    const unsigned char* p = b + kBBytes;
    constexpr int kSets = kAccSets<kShape>, kFloats = kAccFloats<kShape>, kSteps = kGroupSteps<kShape>;
    constexpr int kFragSets = kShape == kShapePvLoad ? kSets : 1;  // loaded ones per set in flight
    float acc[kSets][kFloats];
#pragma unroll
    for (int set = 0; set < kSets; ++set) {
#pragma unroll
        for (int i = 0; i < kFloats; ++i) acc[set][i] = 0.f;
    }
    unsigned frag[kFragSets][kSteps][4];
#pragma unroll
    for (int f = 0; f < kFragSets; ++f) {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
#pragma unroll
            for (int i = 0; i < 4; ++i) frag[f][s][i] = (0x3A3A3A3Au + 0x01010101u * (lane + s + i)) & kFiniteMask;
        }
    }
    // rounds of kRoundGroups groups, the next group issued before the last one is waited for;
    // each round drains (wgmma_wait<0>) so that no wgmma is in flight across the loop's back
    // edge (ptxas serializes the wgmmas otherwise, C7514), as each page of the decode kernel does
    for (int g = 0; g < groups; g += kRoundGroups) {
        wgmma_fence();
        issue_group<kShape>(acc[0], a, b, p, lane, frag[0]);
#pragma unroll
        for (int i = 0; i < kRoundGroups; ++i) {
            if (kSets > 1 && i + 1 < kRoundGroups) {
                wgmma_fence();
                issue_group<kShape>(acc[(i + 1) % kSets], a, b, p, lane, frag[(i + 1) % kFragSets]);
                wgmma_wait<1>();
            } else {
                wgmma_wait<0>();
            }
            fence_accumulators(acc[i % kSets]);
            checksum += acc[i % kSets][0] + acc[i % kSets][kFloats - 1];
            if (kSets == 1 && i + 1 < kRoundGroups) {
                wgmma_fence();
                issue_group<kShape>(acc[0], a, b, p, lane, frag[0]);
            }
        }
    }
}

template <int kShape>
__device__ __forceinline__ void timed(const unsigned char* smem, int groups, int lane, float& checksum,
                                      long long& cycles) {
    const long long start = clock64();
    run_shape<kShape>(smem, groups, lane, checksum);
    cycles = clock64() - start;
}

// The streaming warp: bulk copies of kStreamSlotBytes from this CTA's part of `src` (cycled)
// into the ring until every warpgroup has counted itself done in `stop`, each slot reused once its previous copy has landed; every
// copy drained before it returns. The number of bytes copied.
__device__ __forceinline__ long long stream_until_stopped(unsigned char* ring, unsigned long long* full,
                                                          const volatile int* stop, const unsigned char* src,
                                                          long long src_slots) {
    long long copied = 0;
    if (lane_id() == 0) {
        for (int slot = 0; slot < kStreamSlots; ++slot) mbarrier_init(&full[slot], 1);
        fence_mbarrier_init();
        const long long first = static_cast<long long>(blockIdx.x) * (src_slots / gridDim.x);
        long long c = 0;
        for (; *stop < NUM_WG; ++c) {
            const int slot = static_cast<int>(c % kStreamSlots);
            if (c >= kStreamSlots) mbarrier_wait_parity(&full[slot], ((c / kStreamSlots) - 1) & 1);
            mbarrier_arrive_expect_tx(&full[slot], kStreamSlotBytes);
            bulk_copy_g2s(ring + slot * kStreamSlotBytes, src + ((first + c) % src_slots) * kStreamSlotBytes,
                          kStreamSlotBytes, &full[slot]);
        }
        for (long long d = c > kStreamSlots ? c - kStreamSlots : 0; d < c; ++d)
            mbarrier_wait_parity(&full[d % kStreamSlots], (d / kStreamSlots) & 1);
        copied = c * kStreamSlotBytes;
    }
    return copied;
}

}  // namespace rate

// out_cycles[cta * NUM_WG + wg]: the warpgroup's cycles; out_checksum[cta * threads + tid];
// out_streamed[cta]: the bytes the streaming warp copied (STREAM 1) from `src` (`src_slots`
// slots of kStreamSlotBytes).
extern "C" __global__ void __launch_bounds__(rate::kThreads, 1)
snapmla_diag_wgmma_rate(int groups, unsigned seed, long long* out_cycles, float* out_checksum,
                        const unsigned char* src, long long src_slots, long long* out_streamed) {
    using namespace rate;
    extern __shared__ __align__(1024) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid % 32;
    unsigned* words = reinterpret_cast<unsigned*>(smem);
    for (int i = tid; i < kOperandBytes / 4; i += kThreads) {
        unsigned h = (static_cast<unsigned>(i) + seed) * 0x9E3779B1u;
        h ^= h >> 15;
        h *= 0x85EBCA77u;
        words[i] = (h ^ (h >> 13)) & kFiniteMask;
    }
    int* stop = reinterpret_cast<int*>(smem + kOperandBytes + kStreamBytes + kStreamSlots * 8);
    if (tid == 0) *stop = 0;
    fence_proxy_async_shared();
    __syncthreads();
#if STREAM
    if (tid >= NUM_WG * kWgThreads) {
        const long long copied = stream_until_stopped(
            smem + kOperandBytes, reinterpret_cast<unsigned long long*>(smem + kOperandBytes + kStreamBytes), stop,
            src, src_slots);
        if (lane_id() == 0) out_streamed[blockIdx.x] = copied;
        return;
    }
#endif
    // the warpgroup index from lane 0, so that ptxas sees the branches as warp-uniform and does
    // not serialize the wgmmas (C7519)
    const int wg = __shfl_sync(0xffffffffu, tid / kWgThreads, 0);
    float checksum = 0.f;
    long long cycles = 0;
    if (wg == 0) timed<WG0_SHAPE>(smem, groups, lane, checksum, cycles);
#if NUM_WG > 1
    if (wg == 1) timed<WG1_SHAPE>(smem, groups, lane, checksum, cycles);
#endif
#if NUM_WG > 2
    if (wg == 2) timed<WG2_SHAPE>(smem, groups, lane, checksum, cycles);
#endif
    if (tid % kWgThreads == 0) {
        out_cycles[blockIdx.x * NUM_WG + wg] = cycles;
        atomicAdd(stop, 1);  // the last warpgroup done stops the stream
    }
    out_checksum[blockIdx.x * kThreads + tid] = checksum;
}
