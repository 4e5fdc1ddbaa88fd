// C entry points of the prep-kernel emulation (tests/test_prep_emulation.py loads them with
// ctypes). Build: g++ -std=c++20 -shared -fPIC -pthread -I<dir holding prep.cu + common/ with
// this folder's ptx_shim.cuh as common/ptx.cuh> -I<this folder> -I<CUDA include> harness.cpp
#include "emu.h"
#include "prep.cu"

#include <functional>
#include <thread>

thread_local EmuDim3 threadIdx;
thread_local EmuDim3 blockIdx;
EmuDim3 gridDim;
EmuDim3 blockDim;
thread_local EmuWarp* emu_warp;
thread_local int emu_lane;
std::vector<EmuRange> emu_ranges;
int emu_errors = 0;
std::mutex emu_mu;

// Blocks one after the other, warps one after the other, the 32 lanes of a warp concurrently.
static void run_grid(int grid, const std::function<void()>& body) {
    gridDim.x = static_cast<unsigned>(grid);
    blockDim.x = prep::THREADS;
    for (int b = 0; b < grid; ++b) {
        for (int w = 0; w < prep::WARPS_PER_CTA; ++w) {
            EmuWarp warp;
            std::vector<std::thread> lanes;
            for (int l = 0; l < WARP_SIZE; ++l) {
                lanes.emplace_back([&, l] {
                    blockIdx.x = static_cast<unsigned>(b);
                    threadIdx.x = static_cast<unsigned>(w * WARP_SIZE + l);
                    emu_warp = &warp;
                    emu_lane = l;
                    body();
                });
            }
            for (auto& t : lanes) t.join();
        }
    }
}

using bf16 = __nv_bfloat16;

extern "C" {
void emu_clear_ranges() {
    emu_ranges.clear();
    emu_errors = 0;
}
void emu_add_range(uintptr_t p, size_t n, int writable) {
    emu_ranges.push_back({p, p + n, writable != 0});
}
int emu_error_count() { return emu_errors; }
int emu_rows_per_cta() { return prep::WARPS_PER_CTA * prep::ROWS_PER_WARP; }

void emu_quantize_q(int grid, const void* q, void* content, void* scale, void* rope, i64 rows) {
    run_grid(grid, [&] {
        snapmla_quantize_q(static_cast<const bf16*>(q), static_cast<u8*>(content),
                           static_cast<float*>(scale), static_cast<bf16*>(rope), rows);
    });
}
void emu_append_kv(int grid, int slots_i64, const void* kv, const void* slots, i64 n, void* cache,
                   i64 num_slots) {
    run_grid(grid, [&] {
        if (slots_i64) {
            snapmla_append_kv_i64(static_cast<const bf16*>(kv), static_cast<const i64*>(slots), n,
                                  static_cast<u8*>(cache), num_slots);
        } else {
            snapmla_append_kv(static_cast<const bf16*>(kv), static_cast<const i32*>(slots), n,
                              static_cast<u8*>(cache), num_slots);
        }
    });
}
void emu_fetch_paged(int grid, const void* cache, i64 num_slots, const void* table, int max_blocks,
                     const void* cu, int batch, void* out, i64 total) {
    run_grid(grid, [&] {
        snapmla_fetch_dequant_paged(static_cast<const u8*>(cache), num_slots,
                                    static_cast<const i32*>(table), max_blocks,
                                    static_cast<const i32*>(cu), batch, static_cast<bf16*>(out),
                                    total);
    });
}
void emu_fetch_slots(int grid, int slots_i64, const void* cache, i64 num_slots, const void* slots,
                     i64 n, void* out) {
    run_grid(grid, [&] {
        if (slots_i64) {
            snapmla_fetch_dequant_slots_i64(static_cast<const u8*>(cache), num_slots,
                                            static_cast<const i64*>(slots), n,
                                            static_cast<bf16*>(out));
        } else {
            snapmla_fetch_dequant_slots(static_cast<const u8*>(cache), num_slots,
                                        static_cast<const i32*>(slots), n, static_cast<bf16*>(out));
        }
    });
}
void emu_fetch_soa(int grid, int slots_i64, const void* content, const void* scale,
                   const void* rope, i64 num_slots, const void* slots, i64 n, void* out) {
    run_grid(grid, [&] {
        const auto* c = static_cast<const u8*>(content);
        const auto* s = static_cast<const float*>(scale);
        const auto* r = static_cast<const bf16*>(rope);
        if (slots_i64) {
            snapmla_fetch_dequant_soa_i64(c, s, r, num_slots, static_cast<const i64*>(slots), n,
                                          static_cast<bf16*>(out));
        } else {
            snapmla_fetch_dequant_soa(c, s, r, num_slots, static_cast<const i32*>(slots), n,
                                      static_cast<bf16*>(out));
        }
    });
}
}
