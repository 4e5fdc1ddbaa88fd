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
import os
from collections.abc import Callable, Iterable, Iterator
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
# How many missing / mismatched weight names an error lists: enough to see which modules are
# affected (e.g. every layer's kv_b_proj), short enough to stay one readable line.
LISTED_KEYS = 3


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


@contextlib.contextmanager
def _loader_errors(message: str) -> Iterator[None]:
    """Turn whatever transformers, safetensors or huggingface_hub raise while reading the user's
    checkpoint into a one-line :class:`SnapmlaError` ``message (first line of the error)``.

    Why so broad: the checkpoint is user input read by third-party loaders, whose failures on a
    damaged file are not confined to OSError / ValueError (a truncated model.safetensors raises
    ``SafetensorError``, a wrongly typed config.json field ``StrictDataclassFieldValidationError``,
    a config that does not fit the weights ``RuntimeError``); each of them is a bad input, not a
    bug in snapmla. ``MemoryError`` (a checkpoint too large for this machine) is left alone, as
    are ``KeyboardInterrupt`` and the other non-``Exception`` signals."""
    try:
        yield
    except (SnapmlaError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring: a third-party loader boundary
        raise SnapmlaError(f"{message} ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, joined with the next where it only introduces it
    (ends with ':', as huggingface_hub's "Validation error for field 'x':" does), so that the
    one line kept still says what is wrong."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


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
    ``Any``: transformers' classes are read by attribute (``config_class``, ``from_pretrained``).
    A config.json that is unreadable or not shaped as a config (a JSON list, ``architectures``
    not a list of names) also gives None: the Auto classes then refuse it in one line."""
    try:
        raw, _ = transformers.PretrainedConfig.get_config_dict(model, local_files_only=True)
    except (SnapmlaError, MemoryError):
        raise
    except Exception:  # noqa: BLE001 - unreadable here: the Auto classes then say what is wrong
        return None
    names = raw.get("architectures") if isinstance(raw, dict) else None
    for name in names if isinstance(names, list) else ():
        if isinstance(name, str) and name in NATIVE_MLA_ARCHITECTURES and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def _load_config(transformers: ModuleType, model: str, trust_remote_code: bool) -> tuple[object, Any | None]:
    """(config, the native model class or None for the Auto classes). A native class named by the
    checkpoint comes first, even with ``trust_remote_code``: its code is the one tested."""
    native = _native_class(transformers, model)
    if native is not None:
        with _loader_errors(f"model {model}: cannot read its config as {native.__name__}"):
            return native.config_class.from_pretrained(model, local_files_only=True), native
    config = _auto_loaded(model, "config", trust_remote_code, lambda: transformers.AutoConfig.from_pretrained(
        model, local_files_only=True, trust_remote_code=trust_remote_code), lambda exc: _missing_checkpoint(model, exc))
    return config, None


def _load_tokenizer(transformers: ModuleType, model: str, trust_remote_code: bool) -> Any:
    return _auto_loaded(model, "tokenizer", trust_remote_code, lambda: transformers.AutoTokenizer.from_pretrained(
        model, local_files_only=True, trust_remote_code=trust_remote_code),
        lambda exc: f"model {model}: cannot load its tokenizer ({_first_line(exc)})")


def _auto_loaded(model: str, part: str, trust_remote_code: bool, load: Callable[[], Any],
                 failure: Callable[[BaseException], str]) -> Any:
    """``load()`` (a transformers Auto class) at the loader boundary of :func:`_loader_errors`,
    with one more answer: a ``part`` that is the checkpoint's own code, refused without the flag,
    says so; any other failure is the one line ``failure(exc)``."""
    try:
        return load()
    except (SnapmlaError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - a third-party loader boundary, as in _loader_errors
        if _needs_remote_code(exc, trust_remote_code):
            raise SnapmlaError(f"model {model}: its {part} is the checkpoint's own code, which snapmla "
                               f"runs only with {REMOTE_CODE_FLAG}") from None
        raise SnapmlaError(failure(exc)) from None


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:LISTED_KEYS])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > LISTED_KEYS else "")


def missing_weights(net: torch.nn.Module, missing: Iterable[str] | None) -> list[str]:
    """The names in ``missing`` (transformers' ``missing_keys``) that really lack weights, sorted.

    transformers fills a missing weight with random initial values (and only logs it, which
    :func:`_quiet` silences), so a dump from such a model would look fine and mean nothing. Two
    kinds of name are legitimately absent from a checkpoint and tolerated here, whichever
    transformers version did or did not filter them already: names outside the model's
    ``state_dict`` (non-persistent buffers such as the rotary ``inv_freq``, computed at init) and
    tensors tied to one that was loaded (an ``lm_head`` sharing the embedding's storage)."""
    names = sorted(str(key) for key in (missing or ()))
    if not names:
        return []
    state = net.state_dict(keep_vars=True)
    absent = set(names)
    loaded = {_storage(t) for key, t in state.items() if key not in absent}
    return [key for key in names if key in state and _storage(state[key]) not in loaded]


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """What identifies a tensor's memory for tying: (storage address, offset); an empty tensor
    gets its own id so that two empty tensors never count as tied."""
    if tensor.numel() == 0:
        return (-1, id(tensor))
    return (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))


def _mismatched(mismatched: Iterable[Any] | None) -> list[str]:
    """transformers' ``mismatched_keys`` ((name, checkpoint shape, model shape) tuples) as sorted
    readable lines: the first one names the weight and both shapes."""
    lines = []
    for item in mismatched or ():
        if isinstance(item, (tuple, list)) and len(item) == 3:
            key, ckpt, want = item
            lines.append(f"{key} is {list(ckpt)} in the checkpoint but {list(want)} by config.json")
        else:
            lines.append(str(item))
    return sorted(lines)


def _check_loading_info(model: str, net: torch.nn.Module, info: dict[str, Any]) -> None:
    """Refuse a model transformers built with weights that are not the checkpoint's: missing
    weights (randomly initialised) or weights whose shapes do not match config.json (with
    ``ignore_mismatched_sizes`` they are re-initialised and listed here, so the error can name
    them; without it transformers' own error only points at a log snapmla silences)."""
    missing = missing_weights(net, info.get("missing_keys"))
    if missing:
        raise SnapmlaError(
            f"model {model}: cannot load the weights (the checkpoint lacks {_listed(missing)}; "
            "expected every weight of the model, as a random one would make a meaningless dump)"
        )
    mismatched = _mismatched(info.get("mismatched_keys"))
    if mismatched:
        raise SnapmlaError(
            f"model {model}: cannot load the weights (they do not match its config.json: "
            f"{_listed(mismatched)})"
        )


def _native_from_pretrained(native: Any, model: str, config: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``native.from_pretrained`` under the native class's own ``model_type``.

    Why: transformers picks the checkpoint conversions it applies while loading (transformers 5
    fuses per-expert MoE weights into one tensor per layer) by ``config.model_type``. Loaded under
    the checkpoint's own model_type (Kimi-K2's ``kimi_k2``, which transformers does not know), no
    conversion applies and the fused expert weights stay randomly initialised. The checkpoint's
    model_type is put back afterwards: the dump's metadata records it."""
    own = getattr(config, "model_type", None)
    native_type = getattr(getattr(native, "config_class", None), "model_type", None)
    if not isinstance(own, str) or not isinstance(native_type, str) or own == native_type:
        return native.from_pretrained(model, **kwargs)
    config.model_type = native_type
    try:
        net, info = native.from_pretrained(model, **kwargs)
    finally:
        config.model_type = own
    net.config.model_type = own
    return net, info


def _require_readable_files(model: str) -> None:
    """A local checkpoint folder's files must be readable: the safetensors library reports a
    weights file it may not read as "No such file or directory", which named a file that is
    there. (A hub id, resolved from the local cache, is the loaders' to check.)"""
    folder = Path(model)
    if not folder.is_dir():
        return
    try:
        paths = sorted(folder.iterdir())
    except OSError as exc:
        raise SnapmlaError(f"model {model}: cannot list the folder ({exc.strerror or type(exc).__name__})") from None
    for path in paths:
        if path.is_file() and not os.access(path, os.R_OK):
            raise SnapmlaError(f"model {model}: cannot read {path.name} (permission denied)")


def load_model(model: str, device: str, dtype: str, trust_remote_code: bool = False,
               before_weights: Callable[[Any, Any], None] | None = None) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) from local files only (``local_files_only=True``: a hub id resolves
    from the local Hugging Face cache, nothing is downloaded). A checkpoint that lacks weights of
    the model, or holds weights of other shapes than its config.json says, is refused.
    ``before_weights(config, tokenizer)`` runs before the weights load (minutes for a large
    checkpoint), so that the caller can refuse options the model cannot serve (a prompt past its
    context length) up front."""
    _require_readable_files(model)
    transformers = import_transformers()
    with _quiet(transformers):
        config, native = _load_config(transformers, model, trust_remote_code)
        check_mla_config(config, model)
        tokenizer = _load_tokenizer(transformers, model, trust_remote_code)
        if before_weights is not None:
            before_weights(config, tokenizer)
        dtype_key = "dtype" if _version(transformers) >= (4, 56) else "torch_dtype"
        kwargs = {"config": config, "local_files_only": True, dtype_key: DTYPES[dtype],
                  "output_loading_info": True, "ignore_mismatched_sizes": True}
        with _loader_errors(f"model {model}: cannot load the weights"):
            if native is not None:
                net, info = _native_from_pretrained(native, model, config, kwargs)
            else:
                net, info = transformers.AutoModelForCausalLM.from_pretrained(
                    model, trust_remote_code=trust_remote_code, **kwargs)
    _check_loading_info(model, net, info)
    return net.to(device).eval(), tokenizer
