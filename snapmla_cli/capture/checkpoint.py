"""Load a Hugging Face MLA checkpoint from local files only, without running its own code unless
the user asks for it.

Why this is its own module: a checkpoint's ``config.json`` may point at code shipped with the
checkpoint (``auto_map``), and transformers then either asks on the terminal whether to run it
(a prompt in the middle of ``snapmla dump``) or refuses. snapmla never lets it ask:
``trust_remote_code`` is always passed explicitly. Where the checkpoint names an architecture that
transformers implements itself (Kimi-K2: ``model_type`` ``kimi_k2``, ``architectures``
``DeepseekV3ForCausalLM``), that native class is loaded instead of the checkpoint's code, which
also keeps the RoPE function the capture reuses (``capture.mla``) the one it was tested with.
Only what has no native class (a tokenizer of its own, e.g. Kimi-K2's tiktoken one, or an
unknown architecture) needs ``--trust-remote-code``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..errors import SnapmlaError
from .mla import check_mla_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Model classes of transformers whose MLA attention snapmla captures (tests/test_capture.py): a
# checkpoint naming one of them in `architectures` loads through it, whatever its model_type.
NATIVE_MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "LongcatFlashForCausalLM")
REMOTE_CODE_FLAG = "--trust-remote-code"


def import_transformers() -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise SnapmlaError("snapmla dump needs transformers: pip install 'snapmla[dump]'") from None


def _version(module: ModuleType) -> tuple[int, ...]:
    parts = []
    for piece in str(getattr(module, "__version__", "0")).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdecimal())
        parts.append(int(digits or 0))
    return tuple(parts)


@contextlib.contextmanager
def _quiet(transformers: ModuleType) -> Iterator[None]:
    """Silence transformers' own logging and progress bars: the library never prints."""
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _missing_checkpoint(model: str, exc: BaseException) -> str:
    folder = Path(model)
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            return f"model {model}: not a checkpoint folder (no config.json)"
        return f"model {model}: cannot read its config ({_first_line(exc)})"
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or folder.exists():
        return f"model {model}: no such checkpoint folder"
    return (
        f"model {model}: not in the local Hugging Face cache (snapmla dump never downloads; "
        f"fetch it first, e.g. `hf download {model}`, or pass a folder)"
    )


def _needs_remote_code(exc: BaseException, trusted: bool) -> bool:
    """Whether transformers refused because the checkpoint's own code was not allowed to run (its
    message asks for ``trust_remote_code=True``)."""
    return not trusted and "trust_remote_code" in str(exc)


def _native_class(transformers: ModuleType, model: str) -> Any | None:
    """The transformers class of the checkpoint's ``architectures`` if it is one snapmla
    captures, else None (the raw config.json is read; none of the checkpoint's code runs). Typed
    ``Any``: transformers' classes are read by attribute (``config_class``, ``from_pretrained``)."""
    try:
        raw, _ = transformers.PretrainedConfig.get_config_dict(model, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None
    for name in raw.get("architectures") or ():
        if name in NATIVE_MLA_ARCHITECTURES and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def _load_config(transformers: ModuleType, model: str, trust_remote_code: bool) -> tuple[object, Any | None]:
    """(config, the native model class or None for the Auto classes). A native class named by the
    checkpoint comes first, even with ``trust_remote_code``: its code is the one tested."""
    native = _native_class(transformers, model)
    if native is not None:
        try:
            return native.config_class.from_pretrained(model, local_files_only=True), native
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SnapmlaError(
                f"model {model}: cannot read its config as {native.__name__} ({_first_line(exc)})") from None
    try:
        config = transformers.AutoConfig.from_pretrained(
            model, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        if _needs_remote_code(exc, trust_remote_code):
            raise SnapmlaError(f"model {model}: its config is the checkpoint's own code, which snapmla "
                               f"runs only with {REMOTE_CODE_FLAG}") from None
        raise SnapmlaError(_missing_checkpoint(model, exc)) from None
    return config, None


def _load_tokenizer(transformers: ModuleType, model: str, trust_remote_code: bool) -> Any:
    try:
        return transformers.AutoTokenizer.from_pretrained(
            model, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if _needs_remote_code(exc, trust_remote_code):
            raise SnapmlaError(f"model {model}: its tokenizer is the checkpoint's own code, which snapmla "
                               f"runs only with {REMOTE_CODE_FLAG}") from None
        raise SnapmlaError(f"model {model}: cannot load its tokenizer ({_first_line(exc)})") from None


def load_model(model: str, device: str, dtype: str, trust_remote_code: bool = False) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) from local files only (``local_files_only=True``: a hub id resolves
    from the local Hugging Face cache, nothing is downloaded)."""
    transformers = import_transformers()
    with _quiet(transformers):
        config, native = _load_config(transformers, model, trust_remote_code)
        check_mla_config(config, model)
        tokenizer = _load_tokenizer(transformers, model, trust_remote_code)
        dtype_key = "dtype" if _version(transformers) >= (4, 56) else "torch_dtype"
        kwargs = {"config": config, "local_files_only": True, dtype_key: DTYPES[dtype]}
        try:
            if native is not None:
                net = native.from_pretrained(model, **kwargs)
            else:
                net = transformers.AutoModelForCausalLM.from_pretrained(
                    model, trust_remote_code=trust_remote_code, **kwargs)
        except (OSError, ValueError, KeyError) as exc:
            raise SnapmlaError(
                f"model {model}: cannot load the weights ({_first_line(exc)})"
            ) from None
    return net.to(device).eval(), tokenizer
