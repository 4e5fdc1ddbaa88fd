"""Capture real MLA KV caches from Hugging Face models (``snapmla dump``, SPEC section 8).

``transformers`` is imported lazily (only when a model is loaded), so importing this package
works without it.
"""

from __future__ import annotations

from .check import CHECK_TOLERANCE, CheckResult, recompute_check
from .checkpoint import load_model
from .mla import MlaAttention, check_mla_config, find_mla_attention
from .prompts import read_prompts
from .run import Capture, DumpOptions, capture_kv, dump_model, parse_layers

__all__ = [
    "CHECK_TOLERANCE",
    "Capture",
    "CheckResult",
    "DumpOptions",
    "MlaAttention",
    "capture_kv",
    "check_mla_config",
    "dump_model",
    "find_mla_attention",
    "load_model",
    "parse_layers",
    "read_prompts",
    "recompute_check",
]
