"""Load a Hugging Face MLA model from local files, run prompts through it and build a KV dump.

Each prompt runs alone (batch 1): a prefill of its first ``max_tokens`` tokens, then ``decode``
greedy steps that feed the argmax token back through the model's own KV cache, so the dump also
holds decoded positions. A layer of the dump is the concatenation of every prompt's rows, in
prompt-file order, with positions restarting at 0 per prompt. The probe queries are the last
``queries`` tokens of the last prompt; with ``causal=True`` and ``s_q = queries`` over that
prompt's rows (from the last position 0 to the end) they reproduce the model's attention exactly.
"""

from __future__ import annotations

import inspect
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..cache.atomic import check_writable, file_kind
from ..cache.dump_file import VALUE_LIMIT, KVDump, LayerDump, first_bad_row, write_dump
from ..errors import NoGpuError, SnapmlaError
from ..numerics.formats import default_softmax_scale
from ..sizes import MAX_SIZE, split_list, unique_values
from .check import CheckResult, recompute_check
from .checkpoint import DTYPES, load_model
from .mla import MlaAttention, find_mla_attention
from .prompts import read_prompts
from .recorder import LayerRecorder, StepState

DEVICES = ("cpu", "cuda")

# progress(done_prompts, total_prompts, rows_so_far); called once with done=0 after loading.
Progress = Callable[[int, int, int], None]


@dataclass(frozen=True)
class DumpOptions:
    model: str
    prompts: Path
    max_tokens: int = 2048
    layers: tuple[int, ...] | None = None  # None: every MLA layer
    decode: int = 0
    queries: int = 4
    device: str = "cpu"
    dtype: str = "bf16"
    check: bool = False
    trust_remote_code: bool = False  # run the checkpoint's own code where transformers has none


@dataclass
class Capture:
    dump: KVDump
    checks: list[CheckResult] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)  # rows per prompt, in order
    # with check: the attention modules and their outputs for the probe tokens, by layer index,
    # so that recompute_check can be run again (e.g. on a modified layer)
    attentions: dict[int, MlaAttention] = field(default_factory=dict)
    attention_outputs: dict[int, torch.Tensor] = field(default_factory=dict)


def parse_layers(text: str) -> tuple[int, ...] | None:
    """``"all"`` -> None, ``"0,5,10"`` -> (0, 5, 10) (sorted); anything else, a layer given
    twice (``sizes.unique_values``) and a blank list or an empty item (``sizes.split_list``)
    included, is a one-line error."""
    text = text.strip()
    if text.lower() == "all":
        return None
    items = split_list(text, "--layers", "all or 0,5,10")
    try:
        typed = [(int(part), part) for part in items]
    except ValueError:
        raise SnapmlaError(
            f"--layers {text!r}: expected 'all' or comma-separated layer indices"
        ) from None
    values = unique_values("--layers", typed)
    if not values or min(values) < 0:
        raise SnapmlaError(
            f"--layers {text!r}: expected 'all' or comma-separated layer indices >= 0"
        )
    return tuple(sorted(values))


def _check_options(options: DumpOptions) -> None:
    if not options.model.strip():
        raise SnapmlaError("--model: expected a checkpoint folder or a Hugging Face id, got ''")
    _check_model_is_no_file(options.model)
    if options.dtype not in DTYPES:
        raise SnapmlaError(f"--dtype {options.dtype}: expected one of {', '.join(DTYPES)}")
    if options.device not in DEVICES:
        raise SnapmlaError(f"--device {options.device}: expected cpu or cuda")
    if options.device == "cuda" and not torch.cuda.is_available():
        raise NoGpuError("--device cuda: no usable CUDA GPU on this machine")
    if options.max_tokens < 1:
        raise SnapmlaError(f"--max-tokens {options.max_tokens}: expected >= 1")
    for option, value in (("--decode", options.decode), ("--queries", options.queries)):
        if value < 0:
            raise SnapmlaError(f"{option} {value}: expected >= 0")
    if options.decode > MAX_SIZE:  # a layer's rows are int32 in the files
        raise SnapmlaError(f"--decode {options.decode}: expected at most {MAX_SIZE}")
    if options.check and options.queries < 1:
        raise SnapmlaError("--check needs probe queries: pass --queries >= 1")


def _check_model_is_no_file(model: str) -> None:
    """A ``--model`` that exists but is no folder (the weights file given for its checkpoint
    folder) is named as what it is: transformers' refusal read as "no such checkpoint folder",
    which sent the user looking for a missing path. A missing path (or a hub id) is the
    loader's to explain."""
    try:
        mode = os.stat(Path(model)).st_mode  # Path: "weights.st/" is the file too
    except OSError:
        return
    if not stat.S_ISDIR(mode):
        raise SnapmlaError(f"model {model}: is a {file_kind(mode)}, expected a checkpoint folder")


def _select(attentions: list[MlaAttention], layers: tuple[int, ...] | None) -> list[MlaAttention]:
    if layers is None:
        return attentions
    by_index = {a.index: a for a in attentions}
    missing = [i for i in layers if i not in by_index]
    if missing:
        have = sorted(by_index)
        raise SnapmlaError(
            f"--layers: no MLA layer {', '.join(map(str, missing))} "
            f"(the model has layers {have[0]}..{have[-1]})"
        )
    return [by_index[i] for i in layers]


class _Forward:
    """Calls the causal LM for one step with whichever keyword names this transformers uses."""

    def __init__(self, model: Any) -> None:  # a transformers causal LM
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_key = "cache" if "cache" in params else "past_key_values"
        self.extra = {}
        if "logits_to_keep" in params:
            self.extra["logits_to_keep"] = 1
        elif "num_logits_to_keep" in params:
            self.extra["num_logits_to_keep"] = 1

    def __call__(self, ids: torch.Tensor, start: int, cache: object) -> tuple[torch.Tensor, object]:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        kwargs = {self.cache_key: cache, **self.extra}
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
        return out.logits[:, -1], new_cache


def capture_kv(options: DumpOptions, progress: Progress | None = None) -> Capture:
    """Run the prompts through the model and return the dump (and the check results when
    ``options.check``). Memory: the model, its KV cache for one prompt, and the dump on the CPU."""
    _check_options(options)
    prompts = read_prompts(options.prompts)
    token_ids: list[torch.Tensor] = []

    def before_weights(config: Any, tokenizer: Any) -> None:
        token_ids.extend(_tokenize(prompts, tokenizer, options.max_tokens))
        _check_lengths(options, config, [int(ids.shape[1]) for ids in token_ids])

    model, _ = load_model(options.model, options.device, options.dtype, options.trust_remote_code,
                          before_weights=before_weights)
    attentions = _select(find_mla_attention(model, options.model), options.layers)
    state = StepState()
    dtype = DTYPES[options.dtype]
    recorders = [LayerRecorder(a, state, dtype, keep_outputs=options.check) for a in attentions]
    forward = _Forward(model)
    positions: list[torch.Tensor] = []
    segments: list[int] = []
    if progress:
        progress(0, len(token_ids), 0)
    for rec in recorders:
        rec.attach()
    try:
        with torch.inference_mode():
            for number, ids in enumerate(token_ids):
                last = number == len(token_ids) - 1
                total = _run_prompt(forward, recorders, state, ids.to(options.device), number, options, last)
                positions.append(torch.arange(total, dtype=torch.int64))
                segments.append(total)
                if progress:
                    progress(number + 1, len(token_ids), sum(segments))
    finally:
        for rec in recorders:
            rec.detach()
    all_positions = torch.cat(positions)
    layers: list[LayerDump] = []
    capture = Capture(dump=KVDump(layers=layers, model=options.model), segments=segments)
    for rec in recorders:
        kv = torch.cat(rec.kv)
        rec.kv.clear()
        queries = torch.cat(rec.queries) if rec.queries else None
        # each layer gets its own positions tensor: safetensors refuses shared storage
        layer = LayerDump(rec.attention.index, kv, all_positions.clone(), queries)
        layers.append(layer)
        if options.check:
            expected = torch.cat(rec.outputs)
            rec.outputs.clear()
            capture.attentions[layer.index] = rec.attention
            capture.attention_outputs[layer.index] = expected
            capture.checks.append(recompute_check(layer, rec.attention, expected))
    capture.dump.extra_metadata = _metadata(model, attentions, options, segments)
    return capture


def _tokenize(prompts: list[str], tokenizer: Any, max_tokens: int) -> list[torch.Tensor]:
    """Each prompt's token ids ``[1, n]``, cut to ``max_tokens``; a prompt of no tokens is
    refused (the model has nothing to attend to)."""
    token_ids = []
    for number, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"][:, :max_tokens]
        if ids.shape[1] == 0:
            raise SnapmlaError(f"--prompts: prompt {number + 1} has no tokens")
        token_ids.append(ids)
    return token_ids


def _check_lengths(options: DumpOptions, config: Any, lengths: list[int]) -> None:
    """Before the weights load: every prompt plus its ``--decode`` tokens within the model's
    context length (positions past it are outside what the model was trained for, and
    ``--decode`` had no bound at all), and the last prompt long enough for ``--queries``."""
    limit = _context_length(config)
    if limit is not None:
        too_long = next((i for i, n in enumerate(lengths) if n > limit), None)
        if too_long is not None:
            raise SnapmlaError(f"--max-tokens {options.max_tokens}: prompt {too_long + 1} has {lengths[too_long]} "
                               f"tokens, past the model's context length {limit} (max_position_embeddings); "
                               f"expected --max-tokens <= {limit}")
        longest = max(lengths)
        if longest + options.decode > limit:
            raise SnapmlaError(f"--decode {options.decode}: prompt {lengths.index(longest) + 1} has {longest} tokens, "
                               f"{longest + options.decode} with the decoded ones, past the model's context length "
                               f"{limit} (max_position_embeddings); expected --decode <= {limit - longest}")
    total = lengths[-1] + options.decode
    if options.queries > total:  # not silently fewer queries than asked
        raise SnapmlaError(f"--queries {options.queries}: the last prompt gives only {total} tokens "
                           f"({lengths[-1]} of the prompt + --decode {options.decode})")


def _context_length(config: Any) -> int | None:
    """The model's ``max_position_embeddings`` (None where its config has no usable one)."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    return None


def _run_prompt(forward: _Forward, recorders: list[LayerRecorder], state: StepState, ids: torch.Tensor,
                number: int, options: DumpOptions, last: bool) -> int:
    """One prompt (``number``, 0-based): its prefill, then ``options.decode`` greedy steps,
    each step's recorded rows checked (:func:`_check_step`). Returns the rows it adds."""
    total = ids.shape[1] + options.decode
    first_query = max(total - options.queries, 0) if last and options.queries else None
    cache, start = None, 0
    for _ in range(options.decode + 1):
        width = ids.shape[1]
        state.query_rows = _rows(first_query, start, width)
        queries_before = [len(rec.queries) for rec in recorders]
        logits, cache = forward(ids, start, cache)
        _check_step(options.model, recorders, queries_before, number, start)
        start += width
        ids = logits.argmax(dim=-1, keepdim=True)
    del cache
    return total


def _check_step(model: str, recorders: list[LayerRecorder], queries_before: list[int], prompt: int,
                start: int) -> None:
    """The rows one forward step recorded (positions from ``start``), layer by layer: a NaN/inf
    or a value too large for the FP8 pipeline is the model's (a damaged weight, an overflow),
    named with the first layer and position where it shows. Found only when the dump was
    written, it was blamed on the output file (or, with --check, on the recomputed cache)."""
    for rec, before in zip(recorders, queries_before):
        index = rec.attention.index
        if rec.kv:
            _check_produced(model, index, "latent KV", rec.kv[-1], prompt, start)
        rows = rec.state.query_rows
        if len(rec.queries) > before and rows is not None:
            _check_produced(model, index, "probe queries", rec.queries[-1], prompt, start + rows.start)


def _check_produced(model: str, layer: int, what: str, rows: torch.Tensor, prompt: int, position: int) -> None:
    """Refuse ``rows`` (positions from ``position`` of prompt ``prompt``, 0-based) holding a value
    the dump cannot take (:func:`~snapmla_cli.cache.dump_file.first_bad_row`), naming the model."""
    bad = first_bad_row(rows)
    if bad is None:
        return
    row, value = bad
    where = f"prompt {prompt + 1}, position {position + row}"
    if not math.isfinite(value):
        raise SnapmlaError(f"model {model}: layer {layer} produced NaN/inf in its {what} ({where})")
    raise SnapmlaError(f"model {model}: layer {layer} produced |x| = {value:.3g} in its {what} ({where}), "
                       f"{VALUE_LIMIT}")


def _rows(first_query: int | None, start: int, width: int) -> slice | None:
    """The rows of a call covering positions ``start .. start+width-1`` that are probe queries."""
    if first_query is None or start + width <= first_query:
        return None
    return slice(max(first_query - start, 0), width)


def _metadata(
    model: Any, attentions: list[MlaAttention], options: DumpOptions, segments: list[int]
) -> dict[str, str]:
    first = attentions[0]
    return {
        "source": "snapmla dump",
        "model_type": str(getattr(model.config, "model_type", "unknown")),
        "dtype": options.dtype,
        "num_heads": str(first.num_heads),
        "segments": ",".join(map(str, segments)),
        "decode_tokens": str(options.decode),
        "model_softmax_scale": repr(first.softmax_scale),
        "softmax_scale": repr(default_softmax_scale()),
        "query_prescale": repr(first.query_prescale),
        "queries": (
            "absorbed [n, h, 576] of the last n tokens of the last segment, pre-scaled for "
            "softmax_scale; exact with causal=True, s_q=n over that segment"
        ),
    }


def dump_model(
    options: DumpOptions, output: Path, force: bool = False, progress: Progress | None = None
) -> Capture:
    """``snapmla dump``: refuse a clobber before the (long) run, capture, then write atomically.
    The file is written even when a check fails; the caller reports the failure."""
    output = Path(output)
    check_writable(output, force)
    capture = capture_kv(options, progress)
    write_dump(capture.dump, output, force=force)
    return capture
