"""What ``snapmla bench`` measures, as pure arithmetic: model presets, parallel layouts, head
sharding, KV-budget batch sizing and the list of timed cases. No torch, no GPU, no I/O, so every
rule here is tested on the CPU and shared by the worker, the gatherer and the renderer.

Conventions (see docs/DESIGN.md, "snapmla bench"):
- ``--dp N --tp M`` runs ``N * M`` ranks; rank ``r`` is DP group ``r // M``, TP index ``r % M``
  (TP groups are contiguous ranks, so they stay on one node under torchrun).
- TP splits the query heads (``heads / M`` per rank). MLA has one latent KV head, so TP does not
  split the KV cache: every rank of a TP group holds the whole cache of the group's requests.
- The KV budget ``--kv-mem`` is per GPU and pays for the real model's ``L`` layer caches:
  ``batch = floor(budget / (L * pages(ctx) * 64 * bytes_per_token))`` with 656 bytes per token
  for FP8 and 1152 for BF16, the same on every layout, at most ``MAX_BATCH`` (4096, every
  command's ``--batch`` limit: a short context's budget would otherwise size batches of tens of
  thousands of requests, whose queries alone outgrow the GPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SnapmlaError
from ..numerics.formats import BF16_TOKEN_BYTES, FP8_TOKEN_BYTES, PAGE_SIZE
from ..sizes import (
    MAX_BATCH,
    MAX_QUERY_HEADS,
    MAX_QUERY_TOKENS,
    counted,
    format_size,
    refuse_long_number,
    require_batch,
    split_list,
    unique_values,
)

FP8, BF16 = "fp8", "bf16"
IMPLS = (FP8, BF16)
TOKEN_BYTES = {FP8: FP8_TOKEN_BYTES, BF16: BF16_TOKEN_BYTES}
# attention calls per decoded token a bench step may make: 16x the deepest preset (DeepSeek-V3's
# 61); a larger count is a typo, whose step would allocate a cache per layer before failing
MAX_LAYERS = 1024
DEFAULT_KV_MEM = 60 * 2**30  # 60 GiB per GPU
DEFAULT_CONTEXTS = "16k,32k,64k,128k"


@dataclass(frozen=True)
class ModelPreset:
    """The attention stack of a model: query heads and the number of MLA attention calls (each
    with its own KV cache) per decoded token."""

    name: str
    heads: int
    layers: int
    source: str


# Facts from the models' Hugging Face configs (transformers 5.24 defaults, which follow the
# released checkpoints): kv_lora_rank 512 and qk_rope_head_dim 64 for all of them.
PRESETS: dict[str, ModelPreset] = {
    "deepseek-v3": ModelPreset(
        "deepseek-v3", heads=128, layers=61,
        source="DeepSeek-V3/V3.1: num_attention_heads 128, num_hidden_layers 61 "
        "(the MTP module's extra layer is not counted)",
    ),
    "kimi-k2": ModelPreset(
        "kimi-k2", heads=64, layers=61,
        source="Kimi-K2 (DeepseekV3ForCausalLM): num_attention_heads 64, num_hidden_layers 61",
    ),
    "longcat-flash": ModelPreset(
        "longcat-flash", heads=64, layers=56,
        source="LongCat-Flash: num_attention_heads 64, num_layers 28 with 2 MLA modules each "
        "(num_hidden_layers 56 attention calls, each with its own cache)",
    ),
}


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def name(self) -> str:
        return f"dp{self.dp}tp{self.tp}"

    @property
    def label(self) -> str:
        """The paper's spelling, ``DP4/TP2``."""
        return f"DP{self.dp}/TP{self.tp}"


LAYOUT_PRESETS = {"dp1tp8": Layout(1, 8), "dp4tp2": Layout(4, 2), "dp8tp1": Layout(8, 1)}
_LAYOUT = re.compile(r"^dp(\d+)tp(\d+)$")


def parse_layouts(text: str) -> tuple[Layout, ...]:
    """``"dp1tp8,dp4tp2,dp8tp1"`` (any ``dpNtpM``) -> layouts; all must use the same rank count,
    because one launch runs them all on the same processes. A layout given twice (``dp4tp2,DP4/TP2``)
    is an error (``sizes.unique_values``), as are a blank list and an empty item (``sizes.split_list``)."""
    found: list[tuple[Layout, str]] = []
    for part in split_list(text, "--layout", "dp4tp2 or dp1tp8,dp8tp1"):
        name = part.strip().lower().replace("/", "")
        match = _LAYOUT.match(name)
        if match is None:
            raise SnapmlaError(
                f"--layout: {name!r} is not a layout (expected dpNtpM, e.g. {', '.join(LAYOUT_PRESETS)})"
            )
        for number in match.groups():  # int() of more than 4,300 digits raises
            refuse_long_number(number, "--layout", name)
        layout = Layout(int(match.group(1)), int(match.group(2)))
        if layout.dp < 1 or layout.tp < 1:
            raise SnapmlaError(f"--layout: {name!r}: dp and tp must be at least 1")
        found.append((layout, part))
    layouts = unique_values("--layout", found, show=lambda layout: layout.name)
    worlds = {layout.world for layout in layouts}
    if len(worlds) > 1:
        raise SnapmlaError(
            f"--layout: {text!r} mixes rank counts ({', '.join(f'{x.name}={x.world}' for x in layouts)});"
            " layouts run together must use the same number of GPUs"
        )
    return tuple(layouts)


# a number, then nothing, a unit prefix (k m g t) with an optional i (binary), and an optional B;
# an i without a prefix ("60i") is no unit
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_bytes(text: str | int, what: str = "--kv-mem") -> int:
    """``60GiB`` / ``60G`` / ``60g`` -> 60 * 2**30; ``60GB`` -> 60 * 10**9; ``4096`` -> 4096 bytes.
    A bare suffix is binary, like ``32k`` contexts (``sizes.parse_size``)."""
    if isinstance(text, int):
        value = text
    else:
        match = _BYTES.match(str(text))
        if match is None:
            raise SnapmlaError(f"{what}: {text!r} is not a memory size (expected e.g. 60GiB, 80G or 500MB)")
        number, prefix, binary, unit_b = match.groups()
        refuse_long_number(number, what, text)  # float() of it would be inf
        power = _POWERS[(prefix or "").lower()]
        decimal = bool(unit_b) and not binary and power > 0
        value = int(float(number) * (1000**power if decimal else 1024**power))
    if value < 1:
        raise SnapmlaError(f"{what}: {text!r} must be at least 1 byte")
    return value


_BYTE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def format_bytes(value: float) -> str:
    """``60 GiB``, ``1.5 MiB``, ``1000 MiB``: three significant digits, never an exponent (``:.3g``
    writes 1000-1023 of a unit as ``1e+03``), never 1024 of a unit (a value just under 1 GiB
    rounds to ``1 GiB``, not ``1024 MiB``)."""
    i = next((i for i, (_, size) in enumerate(_BYTE_UNITS) if value >= size), len(_BYTE_UNITS) - 1)
    unit, size = _BYTE_UNITS[i]
    scaled = value / size
    text = f"{scaled:.0f}" if scaled >= 100 else f"{scaled:.3g}"
    if float(text) >= 1024 and i > 0:
        unit, size = _BYTE_UNITS[i - 1]
        text = f"{value / size:.3g}"
    return f"{text} {unit}"


def heads_per_rank(heads: int, tp: int, given_as: str | None = None) -> int:
    """Query heads on each rank of a TP group; TP must split the heads evenly. ``given_as`` is
    how the user typed the TP size (default ``--tp N``; ``--layout dp3tp5`` for a layout), so
    that the error names the option on the command line."""
    if heads < 1:
        raise SnapmlaError(f"--heads: expected at least 1, got {heads}")
    if tp < 1:
        raise SnapmlaError(f"--tp: expected at least 1, got {tp}")
    if heads % tp:
        raise SnapmlaError(
            f"{given_as or f'--tp {tp}'}: {heads} heads do not split evenly over {tp} ranks "
            f"(use a TP size that divides {heads})"
        )
    return heads // tp


@dataclass(frozen=True)
class RankPlace:
    """Where rank ``rank`` sits in a layout and what it runs."""

    rank: int
    dp_index: int
    tp_index: int
    heads: int


def place(rank: int, layout: Layout, heads: int) -> RankPlace:
    if not 0 <= rank < layout.world:
        raise SnapmlaError(f"rank {rank} is outside {layout.name} ({layout.world} ranks)")
    return RankPlace(rank, rank // layout.tp, rank % layout.tp, heads_per_rank(heads, layout.tp))


def cache_tokens(context: int) -> int:
    """Tokens a request of ``context`` tokens occupies in the paged cache (whole 64-token pages)."""
    return -(-context // PAGE_SIZE) * PAGE_SIZE


def kv_bytes_per_request(context: int, layers: int, impl: str) -> int:
    """Cache bytes one request holds on one GPU: all ``layers`` caches, whole pages."""
    return layers * cache_tokens(context) * TOKEN_BYTES[impl]


def budget_batch(kv_mem: int, context: int, layers: int, impl: str) -> int:
    """Requests the per-GPU KV budget holds at ``context`` (0 when not even one fits), at most
    :data:`MAX_BATCH`."""
    return min(MAX_BATCH, kv_mem // kv_bytes_per_request(context, layers, impl))


L2_FLUSH_BYTES = 256 * 2**20  # several times any Hopper L2 (H100/H200: 50 MB)


def distinct_caches(cache_bytes: int, layers: int, flush_bytes: int = L2_FLUSH_BYTES) -> int:
    """How many separate KV cache tensors the timed step cycles through (layer ``l`` reads cache
    ``l % n``): one when a cache is larger than ``flush_bytes``, else enough that the other
    caches read between two uses of one cache (``(n - 1) * cache_bytes``) flush the L2, so
    that a small cache is never re-read from L2 by the next layer. Never more than ``layers``."""
    if cache_bytes < 1 or layers < 1:
        raise SnapmlaError(f"distinct_caches: need positive sizes, got {cache_bytes} bytes, {layers} layers")
    if cache_bytes >= flush_bytes:
        return 1
    others = -(-flush_bytes // cache_bytes)  # caches read between two uses of one
    return min(layers, 1 + others)


@dataclass(frozen=True)
class Case:
    """One timed configuration on every rank: a cache format and the batch of each DP group."""

    impl: str
    batch: int


@dataclass(frozen=True)
class Batches:
    """Per-DP-group batches at one context. ``equal`` runs both formats; ``fp8_mem`` /
    ``bf16_mem`` are what the KV budget holds in each format (None without a budget)."""

    equal: int
    fp8_mem: int | None = None
    bf16_mem: int | None = None

    @property
    def equal_memory(self) -> tuple[int, int] | None:
        """(FP8 batch, BF16 batch) at the same KV memory, or None without a budget, and None
        where both formats reach the :data:`MAX_BATCH` cap: the two batches are then equal, not
        what the same memory holds, and would only repeat the equal-batch comparison."""
        if self.fp8_mem is None or self.bf16_mem is None:
            return None
        if self.fp8_mem == self.bf16_mem == MAX_BATCH:
            return None
        return self.fp8_mem, self.bf16_mem

    def cases(self) -> list[Case]:
        wanted = [Case(FP8, self.equal), Case(BF16, self.equal)]
        if (pair := self.equal_memory) is not None:
            wanted += [Case(FP8, pair[0]), Case(BF16, pair[1])]
        return list(dict.fromkeys(wanted))  # unique, in order


@dataclass(frozen=True)
class BenchPlan:
    """Everything every rank needs to know; picklable (sent to spawned ranks)."""

    model: str
    heads: int
    layers: int
    s_q: int
    contexts: tuple[int, ...]
    layouts: tuple[Layout, ...]
    batch: int | None = None
    kv_mem: int | None = DEFAULT_KV_MEM
    seed: int = 0

    @property
    def world(self) -> int:
        return self.layouts[0].world

    def capped_fp8_notes(self) -> list[str]:
        """Where the budget holds more FP8 requests than :data:`MAX_BATCH` while BF16's batch is
        below it: the same-memory comparison then runs FP8 at the cap, understating its gain,
        which the table's 'same mem' rows alone do not show."""
        notes = []
        for ctx in self.contexts:
            b = self.batches(ctx)
            if b.fp8_mem == MAX_BATCH and b.bf16_mem is not None and b.bf16_mem < MAX_BATCH:
                assert self.kv_mem is not None
                holds = self.kv_mem // kv_bytes_per_request(ctx, self.layers, FP8)
                notes.append(f"context {format_size(ctx)}: the KV budget holds {holds:,} FP8 requests; the "
                             f"same-memory FP8 batch is capped at {MAX_BATCH} (--batch's limit), so FP8's "
                             "gain at the same memory is understated there")
        return notes

    def batches(self, context: int) -> Batches:
        """Equal batch: ``--batch`` if given, else what the budget holds in BF16 (the largest
        batch both formats hold). Equal memory: each format's budget batch, when a budget is set."""
        if self.kv_mem is None:
            assert self.batch is not None
            return Batches(self.batch)
        fp8 = budget_batch(self.kv_mem, context, self.layers, FP8)
        bf16 = budget_batch(self.kv_mem, context, self.layers, BF16)
        return Batches(self.batch if self.batch is not None else bf16, fp8, bf16)


def make_plan(
    *,
    model: str = "deepseek-v3",
    heads: int | None = None,
    layers: int | None = None,
    mtp: int = 1,
    contexts: list[int] | tuple[int, ...] = (16384, 32768, 65536, 131072),
    layouts: tuple[Layout, ...] = (Layout(1, 1),),
    batch: int | None = None,
    kv_mem: int | None = None,
    seed: int = 0,
    from_layout_option: bool = False,
) -> BenchPlan:
    """Check every argument and build the plan; raises a one-line :class:`SnapmlaError`.

    ``kv_mem`` None means: the default budget (60 GiB) when ``batch`` is None, no budget (no
    equal-memory comparison) when ``batch`` is given. ``from_layout_option``: the layouts were
    typed as ``--layout`` (not ``--dp``/``--tp``), which their errors then name."""
    preset = PRESETS.get(model)
    if preset is None:
        raise SnapmlaError(f"--model: {model!r} is not a preset (expected one of {', '.join(PRESETS)})")
    heads = preset.heads if heads is None else heads
    layers = preset.layers if layers is None else layers
    if not 1 <= heads <= MAX_QUERY_HEADS:
        raise SnapmlaError(f"--heads: expected 1..{MAX_QUERY_HEADS}, got {heads}")
    if not 1 <= layers <= MAX_LAYERS:
        raise SnapmlaError(f"--layers: expected 1..{MAX_LAYERS}, got {layers}")
    if not 1 <= mtp <= MAX_QUERY_TOKENS:
        raise SnapmlaError(f"--mtp: expected 1..{MAX_QUERY_TOKENS} query tokens per request, got {mtp}")
    if batch is not None and batch < 1:
        raise SnapmlaError(f"--batch: expected at least 1, got {batch}")
    require_batch("--batch", batch)
    if not contexts:
        raise SnapmlaError("--ctx: no context given")
    for ctx in contexts:
        if ctx < mtp:
            raise SnapmlaError(f"--ctx: {ctx} is shorter than --mtp {mtp} (the queries are cache tokens)")
    if not layouts:
        raise SnapmlaError("--layout: no layout given")
    for layout in layouts:
        if layout.dp < 1:
            raise SnapmlaError(f"--dp: expected at least 1, got {layout.dp}")
        heads_per_rank(heads, layout.tp, f"--layout {layout.name}" if from_layout_option else None)
    if len({layout.world for layout in layouts}) > 1:
        raise SnapmlaError("--layout: layouts run together must use the same number of GPUs")
    if kv_mem is None and batch is None:
        kv_mem = DEFAULT_KV_MEM
    plan = BenchPlan(
        model=preset.name, heads=heads, layers=layers, s_q=mtp,
        contexts=tuple(dict.fromkeys(contexts)), layouts=tuple(layouts),
        batch=batch, kv_mem=kv_mem, seed=seed,
    )
    if kv_mem is not None:
        for ctx in plan.contexts:
            b = plan.batches(ctx)
            if not b.bf16_mem:
                need = kv_bytes_per_request(ctx, layers, BF16)
                budget_text, need_text = format_bytes(kv_mem), format_bytes(need)
                if budget_text == need_text:  # (rounded alike: the bytes say which is larger)
                    budget_text, need_text = f"{kv_mem:,} bytes", f"{need:,} bytes"
                raise SnapmlaError(
                    f"--kv-mem {budget_text} holds no BF16 request of context "
                    f"{format_size(ctx)} with {counted(layers, 'layer')} (one needs {need_text})"
                )
    return plan
