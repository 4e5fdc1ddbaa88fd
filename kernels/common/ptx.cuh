// Small inline-PTX helpers shared by every snapmla kernel.
//
// Global accesses go through these wrappers so that their width is explicit (the SASS check in
// tests/test_kernel_compile.py looks for LDG.E.128) and the read-only inputs use the
// non-coherent path. Later kernels add their wgmma / mbarrier / TMA wrappers here.
#pragma once

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
