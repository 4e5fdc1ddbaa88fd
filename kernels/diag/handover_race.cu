// Diagnostic, not a product kernel: the synchronization skeleton of the FP8 wgmma decode
// kernel's alternate-pages mode (WG_MODE 3) with no tensor work, for compute-sanitizer racecheck.
//
// Why: racecheck reports, intermittently, a hazard on the mode-3 epilogue's L partials (written
// before `bar.sync kBarConsumers, 256`, read after it by the same 256 consumer threads). This
// kernel keeps exactly the barrier pattern around them: the producer warpgroup that gives its
// registers away (setmaxnreg) and hands pages over on full / empty mbarriers, the two consumer
// warpgroups that own alternate pages and pass each page's row state and P tile to the other one
// with `bar.arrive` / `bar.sync` on the other's hand-over barrier, then the epilogue's consumer
// barriers. Every shared-memory access is ordered by a barrier both sides take; a hazard report
// on this kernel is a report about the tool, not about a race (scripts/racecheck_handover.py).
//
// Switches (-D): PRODUCER 1 = the mbarrier handshake runs (0: the producer warps only exit),
// REGS 1 = setmaxnreg moves registers as in the decode kernel, EPI_BAR = the epilogue's barrier id.
#include "common/ptx.cuh"

#ifndef PRODUCER
#define PRODUCER 1
#endif
#ifndef REGS
#define REGS 1
#endif
#ifndef EPI_BAR
#define EPI_BAR 3
#endif

namespace diag {

constexpr int kWgThreads = 128, kConsumerWarps = 8, kConsumerThreads = 32 * kConsumerWarps;
constexpr int kThreads = kConsumerThreads + kWgThreads;
constexpr int kRows = 32;      // the 32-row CTA of mode 3
constexpr int kStages = 4;     // pages in flight
constexpr int kPBuffers = 4;   // P tiles and gammas, by page (as the decode kernel)
constexpr int kPWords = kRows * 16;  // one 32-bit word per (row, 4 tokens) of a 64-token page
constexpr int kBarWg0 = 1, kBarPass0 = 4;
constexpr int kProducerRegs = 24, kConsumerRegs = 240;

struct Smem {
    unsigned p[kPBuffers][kPWords];
    float gamma[kPBuffers][kRows];
    float4 rowstate[kRows];
    float lsum[2 * 4 * kRows];
    unsigned long long full[kStages], empty[kStages];
};

}  // namespace diag

extern "C" __global__ void __launch_bounds__(diag::kThreads, 1)
snapmla_diag_handover(const int* num_blocks_of, float* out) {
    using namespace diag;
    using namespace snapmla;
    __shared__ Smem s;
    const int tid = threadIdx.x, num_blocks = num_blocks_of[blockIdx.x];
    if (tid == 0) {
        for (int b = 0; b < kStages; ++b) {
            mbarrier_init(&s.full[b], 1);
            mbarrier_init(&s.empty[b], kConsumerWarps);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    if (tid >= kConsumerThreads) {  // the producer warpgroup
#if REGS
        setmaxnreg_dec<kProducerRegs>();
#endif
#if PRODUCER
        if (tid == kConsumerThreads)
            for (int it = 0; it < num_blocks; ++it) {
                if (it >= kStages) mbarrier_wait_parity(&s.empty[it % kStages], ((it / kStages) - 1) & 1);
                mbarrier_arrive(&s.full[it % kStages]);
            }
#endif
        return;
    }
#if REGS
    setmaxnreg_inc<kConsumerRegs>();
#endif
    const int wg = tid / kWgThreads, wtid = tid % kWgThreads, lane = tid % 32, w = wtid / 32;
    const int g = lane / 4, c = lane % 4;
    if (tid < kRows) s.rowstate[tid] = make_float4(-1.f, 1.f, 1.f, 0.f);
    named_barrier_sync(EPI_BAR, kConsumerThreads);

    float l_run = 0.f;
    auto release = [&](int it) {
        if (PRODUCER) mbarrier_wait_parity(&s.full[it % kStages], (it / kStages) & 1);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&s.empty[it % kStages]);
    };
    // PV of page it: every thread reads its words of the page's P tile and the row's gamma
    auto pv = [&](int it) {
        const unsigned* p = s.p[it % kPBuffers];
        float acc = 0.f;
        for (int k = wtid; k < kPWords; k += kWgThreads) acc += static_cast<float>(p[k] & 0xff);
        l_run = l_run * s.gamma[it % kPBuffers][wtid % kRows] + acc;
        release(it);
    };
    for (int it = wg; it <= num_blocks; it += 2) {
        const bool mine = it < num_blocks;
        if (it > 0) named_barrier_sync(kBarPass0 + wg, kConsumerThreads);  // page it - 1 handed over
        if (mine) {  // the softmax of page it: the other warpgroup's row state in, this one's out
            if (wtid < kRows) {
                const float4 st = s.rowstate[wtid];
                const float gamma = st.y * 0.5f + static_cast<float>(it);
                s.rowstate[wtid] = make_float4(st.x + 1.f, gamma, st.z, 0.f);
                s.gamma[it % kPBuffers][wtid] = gamma;
            }
            for (int k = wtid; k < kPWords; k += kWgThreads) s.p[it % kPBuffers][k] = static_cast<unsigned>(it * 131 + k);
            named_barrier_arrive(kBarPass0 + (wg ^ 1), kConsumerThreads);
            named_barrier_sync(kBarWg0 + wg, kWgThreads);
        }
        if (it > 0) pv(it - 1);
        if (mine) pv(it);
    }
    // the epilogue of the decode kernel: L partials per warp, shared by both warpgroups
    named_barrier_sync(EPI_BAR, kConsumerThreads);
    float lw = l_run;
    for (int offset = 4; offset < 32; offset *= 2) lw += __shfl_xor_sync(FULL_MASK, lw, offset);
    // lanes g == 0 write their rows' partials, as the decode kernel's `kOwnRows` loop does
    if (g == 0)
        for (int i = 0; i < 8; ++i) s.lsum[(wg * 4 + w) * kRows + 8 * (i / 2) + 2 * c + (i % 2)] = lw + i;
    named_barrier_sync(EPI_BAR, kConsumerThreads);
    float total = 0.f;
    for (int k = 0; k < 8; ++k) total += s.lsum[k * kRows + wtid % kRows];
    out[blockIdx.x * kConsumerThreads + tid] = total;
}
