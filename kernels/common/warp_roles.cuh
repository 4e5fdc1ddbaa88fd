// The CTA skeleton both wgmma decode kernels share: two consumer warpgroups and one producer
// warpgroup (one lane issues the TMA loads), the register file moved from the producer to the
// consumers with setmaxnreg, full / empty mbarriers between them. One place for the register
// arithmetic and the role dispatch, so that the kernels cannot drift apart on them.
#pragma once

#include "decode_common.cuh"  // WorkItem (kernels/)

namespace snapmla {
namespace roles {

constexpr int kConsumerWarps = 8;
constexpr int kConsumerThreads = 32 * kConsumerWarps;
constexpr int kWgThreads = 128;
constexpr int kThreads = kConsumerThreads + kWgThreads;  // + the producer warpgroup
constexpr int kRegFile = 65536;
constexpr int kRegGranule = 8;
constexpr int kMaxRegs = 240;  // setmaxnreg's ceiling that still leaves the producer its share
constexpr int kProducerRegs = 24;

// Registers per thread at launch: ptxas' limit for kThreads x min_ctas CTAs per SM.
__host__ __device__ constexpr int launch_regs(int min_ctas) { return kRegFile / (min_ctas * kThreads) / kRegGranule * kRegGranule; }
// What the consumers may take after setmaxnreg: .inc only draws on what the producer's .dec
// freed in the same CTA (asking for more blocks forever), so at most
// launch + 128 (launch - kProducerRegs) / 256, rounded down to 8, capped at kMaxRegs.
__host__ __device__ constexpr int consumer_regs(int min_ctas) {
    const int launch = launch_regs(min_ctas);
    const int free = (launch + kWgThreads * (launch - kProducerRegs) / kConsumerThreads) / kRegGranule * kRegGranule;
    return free > kMaxRegs ? kMaxRegs : free;
}
__host__ __device__ constexpr bool split_fits(int min_ctas) {
    return kConsumerThreads * (consumer_regs(min_ctas) - launch_regs(min_ctas)) <=
           kWgThreads * (launch_regs(min_ctas) - kProducerRegs);
}

// `count` full barriers (one arrival: the producer's expect-tx) and as many empty barriers
// (`empty_arrivals` consumer warps each), visible to the async proxy before anyone waits.
__device__ __forceinline__ void init_pipeline_barriers(unsigned long long* full, unsigned long long* empty,
                                                       int count, int empty_arrivals) {
    if (threadIdx.x == 0) {
        for (int b = 0; b < count; ++b) {
            mbarrier_init(&full[b], 1);
            mbarrier_init(&empty[b], empty_arrivals);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
}

// The register split and the roles over this CTA's work item: the producer warpgroup gives
// its registers back and one lane runs `produce(block_table_row, first_block, num_blocks)`; the
// consumers take them and run `consume(first_block, num_blocks, seqlen, request)`. Each role
// reads the work item after the split, so that nothing computed before setmaxnreg stays live
// across it.
template <int kConsumerRegs, class Params, class Produce, class Consume>
__device__ __forceinline__ void run_work_item(const Params& p, Produce produce, Consume consume) {
    if (threadIdx.x >= kConsumerThreads) {
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x == kConsumerThreads) {
            const WorkItem work = p.work[blockIdx.y];
            produce(p.block_table + static_cast<long>(work.request) * p.block_table_stride, work.block_begin,
                    work.block_end - work.block_begin);
        }
        return;
    }
    setmaxnreg_inc<kConsumerRegs>();
    const WorkItem work = p.work[blockIdx.y];
    const int req = work.request;
    consume(work.block_begin, work.block_end - work.block_begin, p.cache_seqlens[req], req);
}

}  // namespace roles
}  // namespace snapmla
