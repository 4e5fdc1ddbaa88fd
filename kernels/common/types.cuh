// Shapes and byte layout of the SnapMLA FP8 cache (SPEC sections 1 and 3).
//
// Mirrors snapmla_cli/numerics/formats.py; tests/test_kernel_compile.py parses the
// `constexpr` lines below and compares them with the Python constants, so the two cannot drift.
#pragma once

#include <cuda/std/cstdint>

namespace snapmla {

using u8 = cuda::std::uint8_t;
using u16 = cuda::std::uint16_t;
using u32 = cuda::std::uint32_t;
using i32 = cuda::std::int32_t;
using i64 = cuda::std::int64_t;

constexpr int D_CONTENT = 512;  // d_c, kv_lora_rank
constexpr int D_ROPE = 64;      // d_r
constexpr int D_QK = 576;       // d_c + d_r
constexpr int D_V = 512;
constexpr int PAGE_SIZE = 64;   // tokens per page of the paged cache
constexpr int P_BLOCK_TOKENS = 64;  // tokens per P-quantization block (= PAGE_SIZE)

// 656-byte token: E4M3 content | float32 scale | 12 zero bytes | pre-scaled bf16 RoPE.
constexpr int FP8_TOKEN_BYTES = 656;
constexpr int CONTENT_OFFSET = 0;
constexpr int SCALE_OFFSET = 512;
constexpr int PAD_OFFSET = 516;
constexpr int ROPE_OFFSET = 528;
constexpr int ROPE_BYTES = 128;

constexpr float E4M3_MAX = 448.0f;
constexpr float KV_SCALE_FLOOR = 0x1p-32f;  // s = max(amax / 448, 2^-32)
constexpr float P_SCALE_FLOOR = 0x1p-64f;   // sigma_k = max(max et / 448, 2^-64)

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int VEC_BYTES = 16;  // one 128-bit global access

static_assert(D_QK == D_CONTENT + D_ROPE, "QK width");
static_assert(SCALE_OFFSET == CONTENT_OFFSET + D_CONTENT, "scale follows content");
static_assert(PAD_OFFSET == SCALE_OFFSET + 4, "pad follows scale");
static_assert(ROPE_OFFSET + ROPE_BYTES == FP8_TOKEN_BYTES, "rope ends the token");
static_assert(ROPE_BYTES == 2 * D_ROPE, "rope is bf16");
static_assert(FP8_TOKEN_BYTES % VEC_BYTES == 0, "token rows keep 16-byte alignment");
static_assert(ROPE_OFFSET % VEC_BYTES == 0, "rope starts 16-byte aligned");
static_assert(SCALE_OFFSET % VEC_BYTES == 0, "scale + pad form one 16-byte chunk");

}  // namespace snapmla
