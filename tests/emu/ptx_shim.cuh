// Host stand-in for kernels/common/ptx.cuh in the prep-kernel emulation (tests/emu/emu.h): the
// same functions, with every global access checked by emu_check.
#pragma once

#include "common/types.cuh"

namespace snapmla {

template <class T> inline T emu_load(const void* p) {
    emu_check(p, sizeof(T), false);
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}
template <class T> inline void emu_store(void* p, T v) {
    emu_check(p, sizeof(T), true);
    std::memcpy(p, &v, sizeof(T));
}

inline uint4 ldg_nc_v4(const void* p) { return emu_load<uint4>(p); }
inline uint4 ldg_nc_v4_l1(const void* p) { return emu_load<uint4>(p); }
inline uint2 ldg_nc_v2(const void* p) { return emu_load<uint2>(p); }
inline u32 ldg_nc_u32(const void* p) { return emu_load<u32>(p); }
inline i32 ldg_nc_i32(const void* p) { return static_cast<i32>(ldg_nc_u32(p)); }
inline i64 ldg_nc_i64(const void* p) { return emu_load<i64>(p); }
inline void stg_v4(void* p, uint4 v) { emu_store(p, v); }
inline void stg_v2(void* p, uint2 v) { emu_store(p, v); }
inline void stg_u32(void* p, u32 v) { emu_store(p, v); }

// max.NaN.f32: NaN if either input is NaN (the canonical NaN), else the larger
inline float fmax_nan(float a, float b) {
    if (std::isnan(a) || std::isnan(b)) return __uint_as_float(0x7fffffffu);
    return a > b ? a : (b > a ? b : (std::signbit(a) ? b : a));
}

inline float warp_max_nan(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = fmax_nan(v, __shfl_xor_sync(FULL_MASK, v, offset));
    }
    return v;
}

inline int lane_id() { return static_cast<int>(threadIdx.x) & (WARP_SIZE - 1); }

}  // namespace snapmla
