// Host emulation of the few CUDA features the prep kernels use, so that kernels/prep.cu itself
// (its lane maps, shuffles, ballots, loops and stores) runs on a CPU and its bytes can be
// compared with the reference (tests/test_prep_emulation.py). Each warp runs as 32 std::threads;
// shuffles and ballots exchange values through a barrier (a shuffle in divergent code would
// deadlock, which the test turns into a failure); every global load and store is checked
// against the buffers the test registered (bounds, read-only, natural alignment).
// Floating point: IEEE float on the host, no flush-to-zero, round to nearest, which is what the
// kernels ask for with __fmul_rn / __fmaf_rn / __frcp_rn / __fdiv_rn (NVRTC default: no -ftz).
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct EmuDim3 {
    unsigned x = 0, y = 0, z = 0;
};
extern thread_local EmuDim3 threadIdx;
extern thread_local EmuDim3 blockIdx;
extern EmuDim3 gridDim;
extern EmuDim3 blockDim;

struct EmuWarp {
    std::barrier<> bar{32};
    uint64_t slot[32];
};
extern thread_local EmuWarp* emu_warp;
extern thread_local int emu_lane;

struct EmuRange {
    uintptr_t lo, hi;
    bool writable;
};
extern std::vector<EmuRange> emu_ranges;
extern int emu_errors;
extern std::mutex emu_mu;

inline void emu_check(const void* p, size_t n, bool write) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    bool inside = false;
    for (const auto& r : emu_ranges) {
        if (a >= r.lo && a + n <= r.hi && (!write || r.writable)) inside = true;
    }
    if (!inside || a % n != 0) {
        std::lock_guard<std::mutex> guard(emu_mu);
        if (emu_errors++ < 10) {
            std::fprintf(stderr, "emu: bad %zu-byte %s at %p (%s)\n", n, write ? "store" : "load",
                         p, inside ? "misaligned" : "outside the registered buffers");
        }
    }
}

template <class T> inline uint64_t emu_bits(T v) {
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> inline T emu_from(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

template <class T> inline T __shfl_sync(unsigned, T v, int src) {
    emu_warp->slot[emu_lane] = emu_bits(v);
    emu_warp->bar.arrive_and_wait();
    const T r = emu_from<T>(emu_warp->slot[src & 31]);
    emu_warp->bar.arrive_and_wait();
    return r;
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return __shfl_sync(mask, v, emu_lane ^ lane_mask);
}
inline unsigned __ballot_sync(unsigned, int pred) {
    emu_warp->slot[emu_lane] = pred ? 1 : 0;
    emu_warp->bar.arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; ++i) m |= static_cast<unsigned>(emu_warp->slot[i]) << i;
    emu_warp->bar.arrive_and_wait();
    return m;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __uint_as_float(uint32_t u) { return emu_from<float>(u); }
inline uint32_t __float_as_uint(float f) { return static_cast<uint32_t>(emu_bits(f)); }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float __frcp_rn(float a) { volatile float r = 1.0f / a; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
using std::isfinite;
using std::max;
using std::min;
