"""snapmla: FP8 MLA decoding for Hopper GPUs (SnapMLA, arXiv 2602.10718).

Public API, FlashMLA-shaped: ``get_mla_metadata`` (``GraphWorkList`` for a decode step replayed
from a CUDA graph), ``flash_mla_with_kvcache``, plus the fused
token-preparation ops (``quantize_q``, ``append_kv``, ``fetch_dequant``) and ``decode_fp8`` for an
already-quantized Q (``QuantizedRows``, what ``quantize_q`` returns and what its ``out=`` takes;
``DecodeConfig``, the kernel parameters a caller may pass as ``config=``); ``set_gpu_checks``
turns on the NaN / inf checks of CUDA inputs (``SNAPMLA_CHECK_FINITE=1``); every refused argument raises ``SnapmlaError``. GPU modules are
imported on first use so that ``import snapmla_cli`` works on a machine without CuPy or a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # The same names for a caller's type checker (the package ships py.typed): mypy reads a
    # module-level ``__getattr__`` as "every name is Any", so without these an engine's
    # ``snapmla.quantize_q("text")`` type-checked. Never run: the lazy table below imports.
    from .errors import SnapmlaError
    from .numerics.quant import QuantizedRows
    from .ops.decode import decode_bf16, decode_fp8, flash_mla_with_kvcache, get_mla_metadata
    from .ops.decode_config import DecodeConfig
    from .ops.finite import set_gpu_checks
    from .ops.graph_work_list import GraphWorkList
    from .ops.prep import (
        append_kv,
        fetch_dequant,
        fetch_dequant_slots,
        fetch_dequant_soa,
        quantize_q,
    )

__version__ = "0.1.0"

_LAZY = {
    "get_mla_metadata": "snapmla_cli.ops.decode",
    "GraphWorkList": "snapmla_cli.ops.graph_work_list",
    "flash_mla_with_kvcache": "snapmla_cli.ops.decode",
    "decode_fp8": "snapmla_cli.ops.decode",
    "decode_bf16": "snapmla_cli.ops.decode",
    "quantize_q": "snapmla_cli.ops.prep",
    "append_kv": "snapmla_cli.ops.prep",
    "fetch_dequant": "snapmla_cli.ops.prep",
    "fetch_dequant_slots": "snapmla_cli.ops.prep",
    "fetch_dequant_soa": "snapmla_cli.ops.prep",
    "set_gpu_checks": "snapmla_cli.ops.finite",
    "SnapmlaError": "snapmla_cli.errors",
    "QuantizedRows": "snapmla_cli.numerics.quant",
    "DecodeConfig": "snapmla_cli.ops.decode_config",
}

__all__ = [
    "DecodeConfig",
    "GraphWorkList",
    "QuantizedRows",
    "SnapmlaError",
    "append_kv",
    "decode_bf16",
    "decode_fp8",
    "fetch_dequant",
    "fetch_dequant_slots",
    "fetch_dequant_soa",
    "flash_mla_with_kvcache",
    "get_mla_metadata",
    "quantize_q",
    "set_gpu_checks",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'snapmla_cli' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
