// Diagnostic, not a product kernel: what a hand-over between the two CTAs of a thread-block
// cluster costs on sm_90 (scripts/cluster_handover.py).
//
// Why: the FP8 decode kernel's 64-row tile is bound by each consumer warpgroup's chain with O
// holding 128 registers a thread (docs/DESIGN.md, "What limits the wgmma kernel's speed"). One
// way out splits O across the two SMs of a cluster, pages alternating between them, each page's
// P (4 KB of E4M3 at 64 rows) and row state crossing to the other SM in distributed shared
// memory once per page. Whether that hand-over can stay off the chain depends on its latency,
// which this kernel measures: two CTAs of one cluster pass a payload back and forth.
//
// MODE 0: `rounds` cluster barriers (barrier.cluster arrive.release / wait.acquire) per CTA.
// MODE 1: ping-pong. The sender's 128 threads store PAYLOAD_BYTES into the partner's inbox
//         (st.shared::cluster.v4), meet at a CTA barrier, and one thread arrives on the
//         partner's mbarrier (release at cluster scope); the partner's threads wait on it
//         (acquire at cluster scope), check every word, and send back. A round is two
//         one-way hand-overs. Words that arrive wrong are counted in `errors`.
// Thread 0 of each cluster's rank-0 CTA writes the round loop's clock64 cycles to
// cycles[cluster].
#include "common/ptx.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef PAYLOAD_BYTES
#define PAYLOAD_BYTES 4096
#endif

namespace diag {

constexpr int kThreads = 128;
constexpr int kVecBytes = 16;
constexpr int kPayloadVecs = PAYLOAD_BYTES / kVecBytes;
constexpr int kInboxVecs = kPayloadVecs > 0 ? kPayloadVecs : 1;
constexpr int kSendBarrier = 1;  // named barrier of the sender's threads (0 is __syncthreads)
static_assert(PAYLOAD_BYTES % kVecBytes == 0, "the payload is whole 16-byte vectors");

struct Smem {
    uint4 inbox[kInboxVecs];
    unsigned long long arrived;  // the partner's sends, one arrival each
};

__device__ __forceinline__ uint4 word_of(int round, int vec, int sender) {
    return make_uint4(static_cast<unsigned>(round), static_cast<unsigned>(vec), static_cast<unsigned>(sender),
                      static_cast<unsigned>(round * 7919 + vec));
}

__device__ __forceinline__ void st_shared_cluster_v4(unsigned addr, uint4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
#endif
}

// One arrival on an mbarrier in another CTA of the cluster; this thread's earlier writes (and
// those ordered before them by a CTA barrier) are visible to the thread that observes it.
__device__ __forceinline__ void remote_arrive_release(unsigned remote_bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote_bar) : "memory");
#endif
}

__device__ __forceinline__ void wait_parity_acquire_cluster(void* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n .reg .pred done;\n"
        "wait_%=:\n"
        " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra wait_%=;\n}\n" ::"r"(snapmla::smem_addr(bar)),
        "r"(parity)
        : "memory");
#endif
}

}  // namespace diag

extern "C" __global__ void __launch_bounds__(diag::kThreads, 1)
snapmla_diag_cluster_handover(int rounds, long long* cycles, unsigned* errors) {
    using namespace diag;
    using namespace snapmla;
    __shared__ Smem s;
    const int tid = static_cast<int>(threadIdx.x);
    const int rank = cluster_rank(), partner = rank ^ 1;
    if (tid == 0) {
        mbarrier_init(&s.arrived, 1);
        fence_mbarrier_init();
    }
    cluster_sync();  // both CTAs' barriers exist before either arrives remotely
    const unsigned remote_inbox = map_shared_rank(smem_addr(s.inbox), partner);
    const unsigned remote_bar = map_shared_rank(smem_addr(&s.arrived), partner);
    unsigned wrong = 0;
    auto send = [&](int round) {
        if constexpr (kPayloadVecs > 0)
            for (int v = tid; v < kPayloadVecs; v += kThreads)
                st_shared_cluster_v4(remote_inbox + v * kVecBytes, word_of(round, v, rank));
        named_barrier_sync(kSendBarrier, kThreads);
        if (tid == 0) remote_arrive_release(remote_bar);
    };
    auto receive = [&](int round) {
        wait_parity_acquire_cluster(&s.arrived, static_cast<unsigned>(round & 1));
        if constexpr (kPayloadVecs > 0)
            for (int v = tid; v < kPayloadVecs; v += kThreads) {
                const uint4 got = s.inbox[v], want = word_of(round, v, partner);
                wrong += got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w;
            }
    };
    const long long start = clock64();
    for (int round = 0; round < rounds; ++round) {
#if MODE == 0
        cluster_sync();
#else
        if (rank == 0) {
            send(round);
            receive(round);
        } else {
            receive(round);
            send(round);
        }
#endif
    }
    const long long stop = clock64();
    if (wrong) atomicAdd(errors, wrong);
    if (tid == 0 && rank == 0) cycles[blockIdx.x / 2] = stop - start;
    cluster_sync();  // neither CTA exits while its partner may still store into it
}
