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

// Dynamic shared memory is only 16-byte aligned: `raw` rounded up to kAlign (the swizzle atom).
template <int kAlign>
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
    const unsigned base = smem_addr(raw);
    return raw + ((kAlign - (base % kAlign)) % kAlign);
}

// The pipeline between the producer lane and the consumers: `stages` rounds of `parts` full and
// empty barriers each (a page in parts), an empty barrier completed by `empty_arrivals` consumer
// warps; `consumer_barrier`: the named barrier of all consumer threads.
struct Pipeline {
    unsigned long long* full;
    unsigned long long* empty;
    int stages;
    int parts;
    int empty_arrivals;
    int consumer_barrier;
};

// The register split and the roles over this CTA's work: the producer warpgroup gives its
// registers back and one lane runs `produce(block_table_row, first_block, num_blocks, base)` per
// item; the consumers take them and run `consume(item, first_block, num_blocks, seqlen, request,
// phase)`. Each role reads the work item after the split, so that nothing computed before
// setmaxnreg stays live across it.
// kColumnItems false: the one item at this CTA's place (base 0, phase 0). True: the items of its
// column, until the column's end or an empty item. The roles then loop apart and never rejoin
// in code (ptxas would have to fit the consumers' code into the producer's register share, and
// spills), and the pipeline runs on from item to item: the producer starts the next item's
// pages while the consumers finish the last ones of this item and its epilogue. Each item starts
// at a pipeline position `base` that is a multiple of the stages (the producer pads an item's
// pages to whole rounds with pages that complete their barriers' phases without bytes, and the
// consumers pass them), so that block `it` of any item is in stage it % stages; `phase` is the
// parity of the round the item starts in. The consumers meet between items (the next item's Q
// and row state overwrite what the last epilogue reads).
template <bool kColumnItems, int kConsumerRegs, class Params, class Produce, class Consume>
__device__ __forceinline__ void run_column(const Params& p, const Pipeline& pipe, Produce produce, Consume consume) {
    auto produce_item = [&](int item, int base) {
        const WorkItem work = p.work[item];
        produce(p.block_table + static_cast<long>(work.request) * p.block_table_stride, work.block_begin,
                work.block_end - work.block_begin, base);
    };
    auto consume_item = [&](int item, int phase) {
        const WorkItem work = p.work[item];
        consume(item, work.block_begin, work.block_end - work.block_begin, p.cache_seqlens[work.request],
                work.request, phase);
    };
    const bool producer = threadIdx.x >= kConsumerThreads;
    if constexpr (!kColumnItems) {
        // an empty place (a padded work list: a column list run an item per CTA, or a fixed-size
        // list for CUDA graphs) has nothing to do: a request without keys has no item at all,
        // and the place's scratch partial slot is nobody's
        if (__ldg(&p.work[blockIdx.y].block_end) <= __ldg(&p.work[blockIdx.y].block_begin)) return;
        if (producer) {
            setmaxnreg_dec<kProducerRegs>();
            if (threadIdx.x == kConsumerThreads) produce_item(blockIdx.y, 0);
            return;
        }
        setmaxnreg_inc<kConsumerRegs>();
        consume_item(blockIdx.y, 0);
    } else {
        // the column's next item after `item`, or -1; both roles read the same list
        auto next_of = [&p](int item) {
            const int column_end = (static_cast<int>(blockIdx.y) + 1) * p.items_per_column;
            return item + 1 < column_end && __ldg(&p.work[item + 1].block_end) > __ldg(&p.work[item + 1].block_begin)
                       ? item + 1 : -1;
        };
        // an item's pages rounded up to whole rounds of the stages
        auto padded = [&p, &pipe](int item) {
            const int blocks = __ldg(&p.work[item].block_end) - __ldg(&p.work[item].block_begin);
            return (blocks + pipe.stages - 1) / pipe.stages * pipe.stages;
        };
        if (producer) {
            setmaxnreg_dec<kProducerRegs>();
            if (threadIdx.x != kConsumerThreads) return;
            for (int item = static_cast<int>(blockIdx.y) * p.items_per_column, base = 0; item >= 0;) {
                // the next item first: one register through the item's pages (the producer has 24)
                const int next = next_of(item);
                produce_item(item, base);
                const int end = base + padded(item);
                base += __ldg(&p.work[item].block_end) - __ldg(&p.work[item].block_begin);
                for (; base < end; ++base) {  // padding pages: their stage's phases, no bytes
                    const int stage = base % pipe.stages;
                    for (int part = 0; part < pipe.parts; ++part) {
                        if (base >= pipe.stages)
                            mbarrier_wait_parity(&pipe.empty[stage * pipe.parts + part], (base / pipe.stages - 1) & 1);
                        mbarrier_arrive(&pipe.full[stage * pipe.parts + part]);
                    }
                }
                item = next;
            }
            return;
        }
        setmaxnreg_inc<kConsumerRegs>();
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        // the item index and phase from lane 0: warp-uniform as far as ptxas knows (a wgmma on a
        // path it thinks divergent is serialized)
        for (int item = static_cast<int>(blockIdx.y) * p.items_per_column, phase = 0; item >= 0;) {
            consume_item(item, phase);
            const int blocks = __ldg(&p.work[item].block_end) - __ldg(&p.work[item].block_begin);
            const int rounds = padded(item) / pipe.stages;
            for (int it = blocks; it < rounds * pipe.stages; ++it) {  // the padding pages
                const int stage = it % pipe.stages;
                for (int part = 0; part < pipe.parts; ++part) {
                    mbarrier_wait_parity(&pipe.full[stage * pipe.parts + part], ((it / pipe.stages) ^ phase) & 1);
                    if (lane == 0 && warp < pipe.empty_arrivals) mbarrier_arrive(&pipe.empty[stage * pipe.parts + part]);
                }
            }
            phase = __shfl_sync(FULL_MASK, (phase + rounds) & 1, 0);
            item = __shfl_sync(FULL_MASK, next_of(item), 0);
            named_barrier_sync(pipe.consumer_barrier, kConsumerThreads);
        }
    }
}

}  // namespace roles
}  // namespace snapmla
