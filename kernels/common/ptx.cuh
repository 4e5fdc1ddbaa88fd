// Small inline-PTX helpers shared by every snapmla kernel.
//
// Global accesses go through these wrappers so that their width is explicit (the SASS check in
// tests/test_kernel_compile.py looks for LDG.E.128) and the read-only inputs use the
// non-coherent path. The wgmma / TMA / mbarrier wrappers of the Hopper decode kernel are at the end.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/types.cuh"

namespace snapmla {

// ---- global loads: read-only (non-coherent) path, streamed data need not stay in L1 ----
// Not `volatile`: the inputs are never written by the same kernel, so the compiler may hoist
// and batch these loads freely (that is where the memory-level parallelism comes from).
__device__ __forceinline__ uint4 ldg_nc_v4(const void* ptr) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
    return v;
}

// 16 bytes through L1 (allocating): for lane maps where two consecutive instructions read the two
// halves of the same 32-byte sectors, so the second one hits the line the first one brought in.
__device__ __forceinline__ uint4 ldg_nc_v4_l1(const void* ptr) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
    return v;
}

__device__ __forceinline__ uint2 ldg_nc_v2(const void* ptr) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(ptr));
    return v;
}

__device__ __forceinline__ u32 ldg_nc_u32(const void* ptr) {
    u32 v;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(ptr));
    return v;
}

__device__ __forceinline__ i32 ldg_nc_i32(const void* ptr) {
    return static_cast<i32>(ldg_nc_u32(ptr));
}

__device__ __forceinline__ i64 ldg_nc_i64(const void* ptr) {
    i64 v;
    asm("ld.global.nc.s64 %0, [%1];" : "=l"(v) : "l"(ptr));
    return v;
}

// ---- global stores ----
__device__ __forceinline__ void stg_v4(void* ptr, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void stg_v2(void* ptr, uint2 v) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(ptr), "r"(v.x), "r"(v.y) : "memory");
}

__device__ __forceinline__ void stg_u32(void* ptr, u32 v) {
    asm volatile("st.global.u32 [%0], %1;" :: "l"(ptr), "r"(v) : "memory");
}

// ---- float max that propagates NaN (max.NaN, sm_80+), so a NaN input gives a NaN scale
// exactly like torch's amax / clamp in the reference quantizer ----
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ float warp_max_nan(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = fmax_nan(v, __shfl_xor_sync(FULL_MASK, v, offset));
    }
    return v;
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & (WARP_SIZE - 1); }

}  // namespace snapmla

// ==== Warp-level tensor-core helpers for the decode kernels ==========================
// Warp-level tensor-core helpers (mma.sync, ldmatrix, cp.async) shared by the decode kernels.
//
// The FP8 path runs E4M3 operands through the f16 m16n8k16 MMA after an exact E4M3 -> f16
// conversion in registers (every E4M3 value, and every product of two, is exact in f16/f32), so
// the arithmetic equals an FP8 x FP8 MMA with float32 accumulation. Hopper has no native FP8
// mma.sync (it lowers to the same f16 path); the wgmma kernel replaces this in a later version.

namespace snapmla {

__device__ __forceinline__ unsigned smem_addr(const void* ptr) {
    return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

// ---- asynchronous global -> shared copies ------------------------------------------------
// 16 bytes; when `valid` is false the destination is zero-filled and global memory is not read.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)),
                 "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- ldmatrix ------------------------------------------------------------------------------
// Four 8x8 b16 matrices per warp (x4), plain or transposed; one instruction each, so stamped out.
#define SNAPMLA_LDMATRIX_X4(name, shape)                                                          \
    __device__ __forceinline__ void name(unsigned (&r)[4], unsigned smem_row_addr) {              \
        asm volatile("ldmatrix.sync.aligned." shape ".shared.b16 {%0,%1,%2,%3}, [%4];\n"          \
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                              \
                     : "r"(smem_row_addr));                                                        \
    }                                                                                             \
    __device__ __forceinline__ void name(unsigned (&r)[4], const void* smem_row) {                \
        name(r, smem_addr(smem_row));                                                             \
    }
SNAPMLA_LDMATRIX_X4(ldmatrix_x4, "m8n8.x4")
SNAPMLA_LDMATRIX_X4(ldmatrix_x4_trans, "m8n8.x4.trans")
#undef SNAPMLA_LDMATRIX_X4

// Four 8x8 b16 matrices to shared memory (sm_90): lane l gives the address of row l % 8 of
// matrix l / 8 (16 contiguous bytes); register i of lane (g, c) holds bytes 4c .. 4c + 3 of
// row g of matrix i, the layout ldmatrix loads.
__device__ __forceinline__ void stmatrix_x4(unsigned smem_row_addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_row_addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// ---- MMA: D[16x8] += A[16x16] * B[16x8], float32 accumulate --------------------------------
// One m16n8k16 per call, f16 or bf16 inputs; stamped out per input type.
#define SNAPMLA_MMA_16816(name, type)                                                              \
    __device__ __forceinline__ void name(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type ".f32 {%0,%1,%2,%3}, "  \
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                     \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                \
    }
SNAPMLA_MMA_16816(mma_f16_16816, "f16")
SNAPMLA_MMA_16816(mma_bf16_16816, "bf16")
#undef SNAPMLA_MMA_16816

// ---- conversions ---------------------------------------------------------------------------
// Two E4M3 bytes (low 16 bits of `pair`) -> f16x2, exact. Byte 0 becomes the low half.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned pair) {
    unsigned out;
    asm("{\n .reg .b16 lo;\n mov.b32 {lo, _}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
        : "=r"(out)
        : "r"(pair));
    return out;
}
// Bytes 2-3 of `quad` -> f16x2.
__device__ __forceinline__ unsigned e4m3x2_hi_to_f16x2(unsigned quad) {
    unsigned out;
    asm("{\n .reg .b16 hi;\n mov.b32 {_, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
        : "=r"(out)
        : "r"(quad));
    return out;
}
// Two float32 -> two E4M3 (round to nearest even, saturating to +-448) -> f16x2 (exact):
// the quantized P operand of the PV MMA. `lo` lands in the low half.
__device__ __forceinline__ unsigned f32x2_to_e4m3_as_f16x2(float lo, float hi) {
    unsigned out;
    asm("{\n .reg .b16 q;\n cvt.rn.satfinite.e4m3x2.f32 q, %2, %1;\n cvt.rn.f16x2.e4m3x2 %0, q;\n}\n"
        : "=r"(out)
        : "f"(lo), "f"(hi));
    return out;
}
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
// Byte permute: result byte i = byte sel_i of {b:a} (a = bytes 0-3, b = bytes 4-7).
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned selector) {
    unsigned out;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
    return out;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// 1 / x from the SFU (rcp.approx: within an ulp or so; flushes denormals)
__device__ __forceinline__ float fast_rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Reductions over the 4 threads of an MMA row quad (lanes 4g .. 4g+3).
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
// Two independent quad maxima with their shuffles interleaved (two rows' chains in flight).
__device__ __forceinline__ void quad_max2(float& a, float& b) {
    const float a1 = __shfl_xor_sync(0xffffffffu, a, 1), b1 = __shfl_xor_sync(0xffffffffu, b, 1);
    a = fmaxf(a, a1);
    b = fmaxf(b, b1);
    const float a2 = __shfl_xor_sync(0xffffffffu, a, 2), b2 = __shfl_xor_sync(0xffffffffu, b, 2);
    a = fmaxf(a, a2);
    b = fmaxf(b, b2);
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

}  // namespace snapmla

// ---- bulk async copies completing on an mbarrier (sm_90) ----------------------------------
namespace snapmla {

__device__ __forceinline__ void mbarrier_init(void* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
// Announce `bytes` of incoming transactions and arrive once.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(void* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbarrier_wait_parity(void* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\n"
        "wait_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
// Order this thread's earlier shared-memory accesses before later async-proxy (bulk copy) ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// One contiguous global -> shared copy of `bytes` (multiple of 16, both ends 16-byte aligned).
__device__ __forceinline__ void bulk_copy_g2s(void* smem_dst, const void* gmem_src, unsigned bytes,
                                              void* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_addr(smem_dst)),
        "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

// a / b correctly rounded for the decode's P quantization (b a normal float, a/b finite):
// reciprocal plus one Newton correction of the quotient, given inv_b = __frcp_rn(b).
__device__ __forceinline__ float div_rn_fast(float a, float b, float inv_b) {
    const float q = a * inv_b;
    const float r = fmaf(-b, q, a);
    return fmaf(r, inv_b, q);
}

}  // namespace snapmla

// ==== Hopper warpgroup MMA (wgmma), TMA and named barriers (sm_90a) =======================
// Operand lists of wgmma are written out per N: inline asm needs a literal operand count.
// Shared-memory operands are described by 64-bit matrix descriptors (make_smem_desc); the
// accumulators stay in registers between wgmma_fence() and wgmma_wait<>(), and
// fence_accumulators() keeps the compiler from moving their reads or writes across the
// asynchronous window.
namespace snapmla {

enum SmemSwizzle : int { kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };

// The 64-bit matrix descriptor: start address, leading and stride byte offsets (16-byte
// units), swizzle mode.
__device__ __forceinline__ unsigned long long pack_smem_desc(const void* smem, int leading_bytes,
                                                             int stride_bytes, int swizzle) {
    const unsigned long long addr = smem_addr(smem);
    return ((addr & 0x3FFFFull) >> 4) | (static_cast<unsigned long long>(leading_bytes >> 4) << 16) |
           (static_cast<unsigned long long>(stride_bytes >> 4) << 32) |
           (static_cast<unsigned long long>(swizzle) << 62);
}
// K-major matrix descriptor: the leading byte offset is unused for swizzled K-major operands
// narrower than the swizzle span (encoded as 1), the stride byte offset is between 8-row core
// groups.
__device__ __forceinline__ unsigned long long make_smem_desc(const void* smem, int swizzle,
                                                             int stride_bytes) {
    constexpr int kUnusedLeadingBytes = 16;
    return pack_smem_desc(smem, kUnusedLeadingBytes, stride_bytes, swizzle);
}

// Byte offset of (row, byte) in a [rows x 128 B] tile with 128-byte swizzle (16-byte chunks
// XOR row mod 8), as TMA writes it and wgmma reads it.
__device__ __forceinline__ int swz128(int row, int byte) {
    constexpr int kRowBytes = 128;
    return row * kRowBytes + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
}

// MN-major matrix descriptor with 128-byte swizzle: `mn_block_bytes` between 64-element (128 B)
// blocks along M / N (leading byte offset), `k_group_bytes` between 8-row groups along K (stride
// byte offset).
__device__ __forceinline__ unsigned long long make_smem_desc_mn(const void* smem, int mn_block_bytes,
                                                                int k_group_bytes) {
    return pack_smem_desc(smem, mn_block_bytes, k_group_bytes, kSwizzle128B);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
template <int kCount>
__device__ __forceinline__ void fence_accumulators(float (&d)[kCount]) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// ... and for a set of accumulators run in one wgmma group (the paired PVs)
template <int kSets, int kCount>
__device__ __forceinline__ void fence_accumulators(float (&d)[kSets][kCount]) {
#pragma unroll
    for (int k = 0; k < kSets; ++k) fence_accumulators(d[k]);
}
// Inline asm needs literal operand lists, so the wrappers are stamped out per accumulator
// size: SNAPMLA_ACC<n>(d) lists d[0..n) as "+f" operands, SNAPMLA_REGS<n> names them in the
// instruction; the descriptor / A-fragment / predicate operands follow at %n, %n+1, ...

#define SNAPMLA_ACC4(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define SNAPMLA_ACC8(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define SNAPMLA_ACC16(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define SNAPMLA_ACC32(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define SNAPMLA_ACC32_AT(d, o) "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), "+f"(d[o + 16]), "+f"(d[o + 17]), "+f"(d[o + 18]), "+f"(d[o + 19]), "+f"(d[o + 20]), "+f"(d[o + 21]), "+f"(d[o + 22]), "+f"(d[o + 23]), "+f"(d[o + 24]), "+f"(d[o + 25]), "+f"(d[o + 26]), "+f"(d[o + 27]), "+f"(d[o + 28]), "+f"(d[o + 29]), "+f"(d[o + 30]), "+f"(d[o + 31])
#define SNAPMLA_ACC128(d) SNAPMLA_ACC32_AT(d, 0), SNAPMLA_ACC32_AT(d, 32), SNAPMLA_ACC32_AT(d, 64), SNAPMLA_ACC32_AT(d, 96)
#define SNAPMLA_REGS4 "{%0, %1, %2, %3}"
#define SNAPMLA_REGS8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define SNAPMLA_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define SNAPMLA_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SNAPMLA_REGS128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

// D[64 x N] (+)= A . B^T with A and B from shared memory (descriptors); `accumulate` = 0
// overwrites D. INSTR: the wgmma with shape and types; TAIL: its immediate scale/transpose flags.
#define SNAPMLA_WGMMA_SS(NAME, NACC, INSTR, TAIL, DA, DB, P)                                       \
    __device__ __forceinline__ void NAME(float (&d)[NACC], unsigned long long desc_a,                \
                                         unsigned long long desc_b, int accumulate) {                \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n" INSTR " " SNAPMLA_REGS##NACC      \
                     ", %" DA ", %" DB ", p" TAIL ";\n}\n"                                             \
                     : SNAPMLA_ACC##NACC(d)                                                          \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                   \
    }
// D[64 x N] (+)= A . B^T with A from registers (E4M3 ALayout 64x32: rows g, g+8 of each warp's
// 16, k 4c..4c+3 and 16+4c..) and B from shared memory.
#define SNAPMLA_WGMMA_RS(NAME, NACC, INSTR, TAIL, A0, DB, P)                                        \
    __device__ __forceinline__ void NAME(float (&d)[NACC], const unsigned (&a)[4],                   \
                                         unsigned long long desc_b, int accumulate = 1) {            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n" INSTR " " SNAPMLA_REGS##NACC      \
                     ", {%" A0 "}, %" DB ", p" TAIL ";\n}\n"                                            \
                     : SNAPMLA_ACC##NACC(d)                                                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));   \
    }

// QK: E4M3 content tiles (m64nNk32) and the bf16 RoPE tile (m64nNk16, K-major: no transpose).
SNAPMLA_WGMMA_SS(wgmma_fp8_ss, 4, "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3", ", 1, 1", "4", "5", "6")
SNAPMLA_WGMMA_SS(wgmma_fp8_ss, 8, "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3", ", 1, 1", "8", "9", "10")
SNAPMLA_WGMMA_SS(wgmma_fp8_ss, 16, "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3", ", 1, 1", "16", "17", "18")
SNAPMLA_WGMMA_SS(wgmma_fp8_ss, 32, "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", ", 1, 1", "32", "33", "34")
// (the 256-wide shape of a large GEMM: the wgmma-rate diagnostic's reference)
SNAPMLA_WGMMA_SS(wgmma_fp8_ss, 128, "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3", ", 1, 1", "128", "129", "130")
SNAPMLA_WGMMA_SS(wgmma_bf16_ss, 4, "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16", ", 1, 1, 0, 0", "4", "5", "6")
SNAPMLA_WGMMA_SS(wgmma_bf16_ss, 8, "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16", ", 1, 1, 0, 0", "8", "9", "10")
SNAPMLA_WGMMA_SS(wgmma_bf16_ss, 16, "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16", ", 1, 1, 0, 0", "16", "17", "18")
SNAPMLA_WGMMA_SS(wgmma_bf16_ss, 32, "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", ", 1, 1, 0, 0", "32", "33", "34")
// PV: V^T fragments from registers.
SNAPMLA_WGMMA_RS(wgmma_fp8_rs, 4, "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3", ", 1, 1", "4, %5, %6, %7", "8", "9")
SNAPMLA_WGMMA_RS(wgmma_fp8_rs, 8, "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3", ", 1, 1", "8, %9, %10, %11", "12", "13")
SNAPMLA_WGMMA_RS(wgmma_fp8_rs, 16, "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3", ", 1, 1", "16, %17, %18, %19", "20", "21")
SNAPMLA_WGMMA_RS(wgmma_fp8_rs, 32, "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", ", 1, 1", "32, %33, %34, %35", "36", "37")

// BF16 PV with V as B straight from the cache page: B is [k = 16 tokens] x [N = 256 dims] with
// the dims contiguous (MN-major), which bf16 wgmma reads with its transpose flag (imm-trans-b
// = 1). A = P from registers (BF16 ALayout 64x16: rows g, g+8 of each warp's 16, k 2c, 2c+1
// and 8+2c, 9+2c), or from shared memory (K-major, no transpose).
SNAPMLA_WGMMA_RS(wgmma_bf16_rs_tb, 128, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ", 1, 1, 1", "128, %129, %130, %131", "132", "133")
SNAPMLA_WGMMA_SS(wgmma_bf16_ss_tb, 128, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ", 1, 1, 0, 1", "128", "129", "130")

// ---- TMA: one 2-D box of a tensor map (in global memory) into shared memory ---------------
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const void* tensor_map, int x, int y,
                                            void* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(smem_addr(smem_dst)), "l"(tensor_map), "r"(x), "r"(y), "r"(smem_addr(bar))
        : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(void* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// A zero the optimizer cannot see through: `threadIdx.x + loop_zero()` inside a loop keeps what
// is derived from the thread index inside the loop (ptxas still sees a plain add of zero).
__device__ __forceinline__ int loop_zero() {
    int zero;
    asm volatile("mov.u32 %0, 0;" : "=r"(zero));
    return zero;
}
// Make mbarrier.init visible to the async proxy (TMA completes on these barriers).
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Move registers between warpgroups (whole warpgroup executes it; count a multiple of 8).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Programmatic dependent launch (runtime/pdl.py). The kernel before lets the one after it on the
// stream launch early; the one after waits here for its predecessor's completion and memory
// flush before touching anything it wrote. Both are no-ops when the launch was not
// programmatic; below sm_90 they do not exist (and the host never launches programmatically).
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_predecessor() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// ---- thread block clusters (sm_90; ops/cluster_fold.py launches a request's splits as one) ----
// CTAs in this CTA's cluster (1 when the launch had no cluster dimension) and this CTA's rank.
__device__ __forceinline__ int cluster_size() {
#if __CUDA_ARCH__ >= 900
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return static_cast<int>(n);
#else
    return 1;
#endif
}
__device__ __forceinline__ int cluster_rank() {
#if __CUDA_ARCH__ >= 900
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return static_cast<int>(r);
#else
    return 0;
#endif
}
// Every non-exited thread of the cluster (exited ones count as arrived): this thread's earlier
// shared-memory writes are visible to the cluster's reads after it (release / acquire). All
// threads of the calling warp must call it together (.aligned).
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The address in the shared memory of the cluster's CTA `rank` that corresponds to this CTA's
// shared-memory address `addr` (for ld.shared::cluster).
__device__ __forceinline__ unsigned map_shared_rank(unsigned addr, int rank) {
    unsigned remote = addr;
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
#endif
    return remote;
}
__device__ __forceinline__ float ld_shared_cluster_f32(unsigned addr) {
    float v = 0.f;
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
#endif
    return v;
}
__device__ __forceinline__ float4 ld_shared_cluster_v4(unsigned addr) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
#endif
    return v;
}

// %globaltimer (ns) and the SM this thread runs on, for the kernels' timing diagnostics
__device__ __forceinline__ long long globaltimer_ns() {
    long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}
__device__ __forceinline__ int sm_id() {
    int id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}
// Named barrier over `count` threads (a multiple of 32); id 0 is __syncthreads'.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Arrive at named barrier `id` (counting `count` threads in all) without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace snapmla
