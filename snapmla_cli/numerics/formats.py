"""Constants of the MLA shapes and of the SnapMLA FP8 formats (SPEC sections 1 and 3).

Every module that needs a width, an offset or a clamp takes it from here, so that the
reference, the kernels' Python faces and the file formats cannot drift apart.
"""

from __future__ import annotations

import torch

D_CONTENT = 512  # d_c, kv_lora_rank
D_ROPE = 64  # d_r
D_QK = D_CONTENT + D_ROPE  # 576
D_V = D_CONTENT  # 512
PAGE_SIZE = 64  # tokens per page of the paged cache
P_BLOCK_TOKENS = 64  # tokens per P-quantization block (= page)

E4M3_MAX = 448.0
KV_SCALE_FLOOR = 2.0**-32  # s = max(amax / 448, 2^-32)
P_SCALE_FLOOR = 2.0**-64  # sigma_k = max(max et / 448, 2^-64)

# 656-byte token layout (matches DeepSeek-V3.2's fp8_ds_mla offsets).
FP8_TOKEN_BYTES = 656
CONTENT_OFFSET = 0
SCALE_OFFSET = 512
PAD_OFFSET = 516
ROPE_OFFSET = 528
ROPE_BYTES = D_ROPE * 2

# Structure-of-arrays form of SGLang-FluentLLM: 512 + 4 + 128 bytes per token.
SOA_TOKEN_BYTES = D_CONTENT + 4 + ROPE_BYTES

BF16_TOKEN_BYTES = D_QK * 2  # 1152

FP8_DTYPE = torch.float8_e4m3fn
FP8_CACHE_DTYPES = (torch.uint8, FP8_DTYPE)  # the dtypes an FP8 cache's bytes may come in


def default_softmax_scale() -> float:
    """FlashMLA's default: 1/sqrt(576) over the full QK width."""
    return D_QK**-0.5
