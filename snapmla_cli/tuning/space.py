"""The tuner's search space: shape buckets, the budget, and the candidate kernel configurations
of one bucket, pruned by what the kernels accept (shared memory, warps per SM, rows).

A *bucket* is one line of the tuning database (SPEC section 9): ``h_q``, ``s_q``, a batch range,
a context range and the cache format. It is timed at one representative point (the geometric
middle of its ranges, so ``--batch 64`` is timed at 64 and ``--batch 16-128`` at 45).

A *candidate* is a full :class:`DecodeConfig`: the compile-time kernel parameters (row groups,
token groups, pipeline stages, BF16 tile width, CTAs per SM for ``__launch_bounds__``) plus the
split-KV policy. Candidates whose split policy yields exactly the same work list as an earlier
candidate's for the bucket's representative shape are dropped (they would time the same launch).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from itertools import product

from ..errors import SnapmlaError
from ..ops import cluster_fold
from ..ops import decode_config as dc
from ..ops.decode_config import SMEM_PER_SM, SMEM_RESERVED_PER_CTA, DecodeConfig, heuristic_for_work
from ..ops.schedule import SplitPolicy, work_columns
from ..sizes import (
    MAX_BATCH,
    MAX_SIZE,
    counted,
    format_size,
    parse_size,
    refuse_long_number,
    shorten,
    split_list,
    unique_values,
)
from .fields import DbError, read_int, read_pair, show

FORMATS = ("fp8", "bf16")

# Values each kernel parameter may take (the tuner's axes; issue 5).
ROW_GROUPS = (1, 2, 4)
KV_SPLITS = (1, 2, 4)  # FP8 kernel only, when DecodeConfig has the field
STAGES = (2, 3, 4, 5)
# FP8 kernels the tuner searches: the wgmma kernel and the mma.sync one.
FP8_VERSIONS = (dc.FP8_WGMMA, dc.FP8_MMA_SYNC)
BLOCK_NS = (32, 64)  # BF16 mma.sync kernel only; the others always work on the 64-token page
# BF16 kernels the tuner searches: the wgmma kernel (64-row tiles) and the mma.sync one.
BF16_VERSIONS = (dc.BF16_WGMMA, dc.BF16_MMA_SYNC)
MIN_CTAS = (1, 2)
# wgmma kernel: float32 promotion of the QK / PV accumulation. Always on: without it the kernel
# fails `snapmla verify --ctx 32k` (docs/PERF.md), and a numerics switch is not a speed knob.
PROMOTE = (1,)
# wgmma kernel: how the two consumer warpgroups share a page's work: the dims split and
# alternate pages (rows = M too, valid at 64-row tiles only). The own-rows and ping-pong modes
# were 4-25% slower at every shape class of the b=64 sweep (docs/PERF.md, "Warpgroup modes"),
# so timing them would only spend the budget. Rows = M on a transposed V^T (WG_ROWS_M_VT) is
# an experiment: never faster than rows = M in a tuned bucket, and compute-sanitizer racecheck
# reports hazards on it that are not explained yet (docs/DESIGN.md), so no tune may pick it.
WG_MODES = (dc.WG_DIMS_SPLIT, dc.WG_ALT_PAGES, dc.WG_ALT_ROWS_M)
# wgmma kernel, alternate pages: a page's RoPE tile and scales in a ring of this many slots of their own
# (0: in the page's stage), so that one more stage of content fits (1.02-1.03x at 32 rows, b 64,
# docs/PERF.md, twenty-sixth session); two slots bound the pipeline (1.01-1.02x slower)
ROPE_RINGS = (0, 3)
SPLIT_CTAS = (1, 2)
SPLIT_WAVES = (1, 2)
MIN_BLOCKS_PER_SPLIT = (2, 4, 8, 16)

DEFAULT_NUM_SMS = SplitPolicy().num_sms  # used by --dry-run on a machine without a GPU


# ---------------------------------------------------------------------------------------------
# buckets


@dataclass(frozen=True)
class Bucket:
    """One shape bucket: ``batch`` and ``context`` are inclusive ``(lo, hi)`` ranges."""

    h_q: int
    s_q: int
    batch: tuple[int, int]
    context: tuple[int, int]
    format: str  # "fp8" or "bf16"

    @property
    def rows(self) -> int:
        return self.h_q * self.s_q

    @property
    def fp8(self) -> bool:
        return self.format == "fp8"

    @property
    def causal(self) -> bool:
        """MTP engines decode with a causal mask; plain decode (s_q = 1) is the same either way."""
        return self.s_q > 1

    @property
    def timed_batch(self) -> int:
        return _geo_mid(self.batch)

    @property
    def timed_context(self) -> int:
        return _geo_mid(self.context)

    @property
    def id(self) -> str:
        """Stable text key, e.g. ``h64-s2-b64-c16384-fp8`` or ``h64-s2-b16_128-c16384-fp8``."""
        return (f"h{self.h_q}-s{self.s_q}-b{_range_id(self.batch)}-c{_range_id(self.context)}"
                f"-{self.format}")

    def label(self) -> str:
        return (f"h_q {self.h_q} s_q {self.s_q} batch {_range_text(self.batch)} "
                f"ctx {_range_text(self.context, sizes=True)} {self.format}")

    def as_dict(self) -> dict[str, object]:
        return {"h_q": self.h_q, "s_q": self.s_q, "batch": list(self.batch),
                "context": list(self.context), "format": self.format}

    @classmethod
    def from_dict(cls, data: object) -> Bucket:
        """A database entry's bucket; :class:`DbError` for any malformed field (the loader then
        skips that entry alone)."""
        if not isinstance(data, dict):
            raise DbError(f"bucket: expected a mapping, got {show(data)}")
        unknown = sorted(map(str, set(data) - {f.name for f in fields(cls)}))  # (as_dict's keys)
        if unknown:  # a dimension of a newer snapmla: ignored, it would widen the bucket
            raise DbError(f"bucket: unknown dimension(s) {shorten(', '.join(unknown), 60)}")
        fmt = data.get("format")
        if fmt not in FORMATS:
            raise DbError(f"bucket: format {show(fmt)} is not fp8 or bf16")
        return cls(h_q=read_int(data.get("h_q"), "bucket.h_q"),
                   s_q=read_int(data.get("s_q"), "bucket.s_q"),
                   batch=read_pair(data.get("batch"), "bucket.batch"),
                   context=read_pair(data.get("context"), "bucket.context"), format=fmt)


def _geo_mid(r: tuple[int, int]) -> int:
    return r[0] if r[0] == r[1] else max(r[0], min(r[1], round(math.sqrt(r[0] * r[1]))))


def _range_id(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}_{r[1]}"


def _range_text(r: tuple[int, int], sizes: bool = False) -> str:
    f = format_size if sizes else str
    return f(r[0]) if r[0] == r[1] else f"{f(r[0])}-{f(r[1])}"


def bucket_command(bucket: Bucket, budget: str) -> str:
    """The ``snapmla tune`` command line that names exactly ``bucket`` (what an entry re-timed
    by ``--stale`` records as its command)."""
    return (f"snapmla tune --heads {bucket.h_q} --mtp {bucket.s_q} --batch {_range_text(bucket.batch)} "
            f"--ctx {_range_text(bucket.context, sizes=True)} --format {bucket.format} --budget {budget}")


# The largest batch a bucket may name: planning a work list is linear in the batch (a dry run of
# b 16384 took 25 s), and no engine decodes more requests than this on one GPU in one step
# (the same bound as every command's --batch: sizes.MAX_BATCH).
MAX_TUNE_BATCH = MAX_BATCH
_RANGE = re.compile(r"^\s*([^-\s]+)\s*-\s*([^-\s]+)\s*$")
RANGES_EXAMPLE = "64, 1,8,64 or 16-128"  # what a --batch or --ctx error shows as valid ranges


def parse_ranges(text: str, what: str, most: int = MAX_SIZE, most_text: str | None = None) -> list[tuple[int, int]]:
    """``"64"``, ``"1,8,64"``, ``"16-128"``, ``"16k,32k-64k"``: each comma item is one bucket
    range, a single value ``N`` meaning ``N-N``, its ends in 1..``most``. Sizes take k/m
    suffixes (``32k`` = 32768). The same range given twice (``64,64-64``, ``16k-32k,16384-32768``)
    is an error (``sizes.unique_values``), as are a blank list and an empty item
    (``sizes.split_list``); ``most_text`` names the limit (``parse_size``)."""
    out: list[tuple[tuple[int, int], str]] = []
    for part in split_list(text, what, RANGES_EXAMPLE):
        m = _RANGE.match(part)
        lo, hi = (parse_size(m.group(1), what, most, most_text), parse_size(m.group(2), what, most, most_text)) if m \
            else (parse_size(part, what, most, most_text),) * 2
        if lo > hi:
            raise SnapmlaError(f"{what}: range {part.strip()!r} runs backwards")
        out.append(((lo, hi), part))
    return unique_values(what, out, show=lambda r: str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}")


def parse_formats(text: str) -> list[str]:
    value = str(text).strip().lower()
    if value == "both":
        return list(FORMATS)
    if value in FORMATS:
        return [value]
    raise SnapmlaError(f"--format: expected fp8, bf16 or both, got {text!r}")


def make_buckets(heads: list[int], mtp: list[int], batches: list[tuple[int, int]],
                 contexts: list[tuple[int, int]], formats: list[str]) -> list[Bucket]:
    return [Bucket(h, s, b, c, f) for f in formats for h in heads for s in mtp
            for b in batches for c in contexts]


# ---------------------------------------------------------------------------------------------
# budget


@dataclass(frozen=True)
class Budget:
    """Per bucket: stop starting new candidates after ``seconds`` of tuning, or after ``count``
    candidates besides the heuristic default (which is always measured)."""

    seconds: float | None = None
    count: int | None = None

    def __str__(self) -> str:
        if self.seconds is not None:
            return f"{self.seconds:g}s per bucket"
        if self.count is not None:
            return f"{counted(self.count, 'candidate')} per bucket"
        return "no limit per bucket"


_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min)?\s*$", re.IGNORECASE)


def parse_budget(text: str) -> Budget:
    """``"120s"`` / ``"2m"`` -> seconds per bucket; ``"40"`` -> candidates per bucket."""
    m = _BUDGET.match(str(text))
    if m is None:
        raise SnapmlaError(f"--budget: {text!r} is neither seconds (120s, 2m) nor a count (40)")
    number, unit = m.group(1), (m.group(2) or "").lower()
    refuse_long_number(number, "--budget", text)
    if not unit:
        if "." in number or int(number) < 1:
            raise SnapmlaError(
                f"--budget: a candidate count must be a whole number >= 1, got {text!r}")
        return Budget(count=int(number))
    seconds = float(number) * (60.0 if unit.startswith("m") else 1.0)
    if seconds <= 0:
        raise SnapmlaError(f"--budget: {text!r} must be more than 0 seconds")
    return Budget(seconds=seconds)


# ---------------------------------------------------------------------------------------------
# candidates


def max_row_groups(rows: int) -> int:
    """The most 16-row groups worth launching for ``rows``: more would only add empty groups."""
    return max(g for g in ROW_GROUPS if g <= max(1, -(-rows // 16)))


def smem_bytes(cfg: DecodeConfig, fmt: str) -> int:
    return dc.fp8_smem_bytes(cfg) if fmt == "fp8" else dc.bf16_smem_bytes(cfg)


@dataclass(frozen=True)
class ConfigProblem:
    """Why a kernel would refuse a configuration. ``rule`` is the constraint broken, worded the
    same for every configuration that breaks it, so that a search space's pruned variants can be
    counted by rule; ``detail`` is the rule with this configuration's numbers (``str()``), where
    the rule has any."""

    rule: str
    detail: str | None = None

    def __str__(self) -> str:
        return self.detail or self.rule


def config_problem(cfg: DecodeConfig, fmt: str,
                   rows: int | None = None) -> ConfigProblem | None:
    """Why the kernel would refuse ``cfg`` (None: it compiles and launches)."""
    if cfg.row_groups not in ROW_GROUPS:
        return ConfigProblem(f"row_groups not in {ROW_GROUPS}",
                             f"row_groups {cfg.row_groups} not in {ROW_GROUPS}")
    if rows is not None and cfg.row_groups > max_row_groups(rows):
        return ConfigProblem("row_groups x 16 rows beyond the bucket's rows",
                             f"row_groups {cfg.row_groups} x 16 rows > {rows} rows")
    if cfg.min_ctas_per_sm < 1 or cfg.stages < 2:
        return ConfigProblem("min_ctas_per_sm >= 1 and stages >= 2 required")
    if fmt == "bf16" and not cfg.wgmma and (cfg.block_n % 16 or 64 % cfg.block_n or cfg.block_n < 16):
        return ConfigProblem("block_n must be 16, 32 or 64",
                             f"block_n {cfg.block_n} must be 16, 32 or 64")
    smem = smem_bytes(cfg, fmt)
    if smem > dc.MAX_SMEM_PER_CTA:
        return ConfigProblem(f"shared memory > {dc.MAX_SMEM_PER_CTA} B per CTA",
                             f"shared memory {smem} B > {dc.MAX_SMEM_PER_CTA} B per CTA")
    if cfg.min_ctas_per_sm * (smem + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
        rule = f"CTAs x (shared memory + {SMEM_RESERVED_PER_CTA} B) > {SMEM_PER_SM} B per SM"
        return ConfigProblem(rule, f"{cfg.min_ctas_per_sm} CTAs x {smem} B do not fit "
                                   f"{SMEM_PER_SM} B per SM")
    if fmt == "fp8" and not dc.fp8_config_valid(cfg):
        return ConfigProblem("kernel constraint (fp8_config_valid: warps per SM, token-group scratch)")
    if fmt == "bf16" and not dc.bf16_config_valid(cfg):
        return ConfigProblem("kernel constraint (bf16_config_valid: the wgmma kernel's 64-row tile, "
                             "one CTA per SM)")
    return None


def kernel_key(cfg: DecodeConfig, fmt: str) -> tuple[str, tuple[tuple[str, int], ...]]:
    """What must be compiled for ``cfg``: the source and its sorted defines."""
    if fmt == "fp8":
        return (dc.fp8_kernel(cfg)[0], tuple(sorted(dc.fp8_defines(cfg).items())))
    return (dc.bf16_kernel(cfg)[0], tuple(sorted(dc.bf16_defines(cfg).items())))


def kernel_keys(cfg: DecodeConfig, fmt: str) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """Every build a timing of ``cfg`` may load: :func:`kernel_key`, and its cluster-merge build
    where the kernel has one (the tuner's equal-length batches launch a request's splits as a
    cluster whenever it has 2, 4 or 8 of them: ops/cluster_fold.py). Compiled ahead, so that no
    candidate compiles inside its bucket's budget (one NVRTC compile is about a second)."""
    key = kernel_key(cfg, fmt)
    if not (cluster_fold.enabled() and dc.cluster_capable(cfg, fmt == "fp8")):
        return (key,)
    source, defines = key
    return key, (source, tuple(sorted(cluster_fold.cluster_defines(dict(defines)).items())))


def config_id(cfg: DecodeConfig, fmt: str) -> str:
    """Short stable name, e.g. ``v3-rg4-wd-st4-c1/1x1-mb4`` or ``v2-rg4-kv1-st2-c1/1x1-mb4`` (split: target CTAs per SM x waves,
    or ``bal`` for balanced columns, ``auto`` for the planner's choice of the two, minimum blocks per split)."""
    parts = [f"v{cfg.kernel_version}", f"rg{cfg.row_groups}"]
    if fmt == "fp8":
        if not cfg.wgmma:
            parts.append(f"kv{cfg.kv_split}")
        else:
            parts.append(dc.WG_MODE_NAMES[cfg.wg_mode])
            if (cfg.qk_promote, cfg.pv_promote) != (1, 1):
                parts.append(f"pq{cfg.qk_promote}v{cfg.pv_promote}")
            if cfg.rope_ring:
                parts.append(f"rr{cfg.rope_ring}")
    parts.append(f"st{cfg.stages}")
    if fmt == "bf16" and not cfg.wgmma:
        parts.append(f"bn{cfg.block_n}")
    parts.append(f"c{cfg.min_ctas_per_sm}")
    s = cfg.split
    split = f"{s.ctas_per_sm}x{'bal' if s.balanced else 'auto' if s.auto_balance else s.waves}-mb{s.min_blocks_per_split}"
    if s.max_splits_per_request != SplitPolicy().max_splits_per_request:
        split += f"-ms{s.max_splits_per_request}"
    return "-".join(parts) + "/" + split


def default_config(bucket: Bucket, num_sms: int) -> DecodeConfig:
    """What runs without a database entry: the built-in heuristic for the bucket's timed shape
    (which, for FP8 64-row tiles, depends on the work per SM)."""
    return heuristic_for_work(bucket.rows, bucket.fp8, bucket.timed_batch, bucket.timed_context,
                              num_sms).with_sms(num_sms)


def kernel_variants(rows: int, fmt: str
                    ) -> tuple[list[DecodeConfig], list[tuple[DecodeConfig, ConfigProblem]]]:
    """Every kernel-parameter combination of the axes: (valid, [(pruned, reason)]). The split
    policy of each is left at the dataclass default. FP8 covers both kernels: the wgmma one
    (no token groups) and the mma.sync one (token groups ``kv_split``)."""
    axes: dict[str, tuple[int, ...]] = {"row_groups": ROW_GROUPS, "stages": STAGES,
                                        "min_ctas_per_sm": MIN_CTAS}
    combos: list[dict[str, int]] = []
    if fmt == "fp8":
        for version in FP8_VERSIONS:
            extra = ({"kv_split": KV_SPLITS} if version == dc.FP8_MMA_SYNC
                     else {"qk_promote": PROMOTE, "pv_promote": PROMOTE, "wg_mode": WG_MODES,
                           "rope_ring": ROPE_RINGS})
            names = [*axes, *extra]
            for values in product(*axes.values(), *extra.values()):
                combos.append({**dict(zip(names, values)), "kernel_version": version, "block_n": 64})
    else:
        for version in BF16_VERSIONS:
            block_ns = BLOCK_NS if version == dc.BF16_MMA_SYNC else (dc.PAGE_SIZE,)
            for values in product(*axes.values(), block_ns):
                combos.append({**dict(zip([*axes, "block_n"], values)), "kernel_version": version})
    valid: list[DecodeConfig] = []
    pruned: list[tuple[DecodeConfig, ConfigProblem]] = []
    for combo in combos:
        cfg = DecodeConfig.of(combo)
        why = config_problem(cfg, fmt, rows)
        (pruned.append((cfg, why)) if why else valid.append(cfg))
    return valid, pruned


def split_policies(kernel: DecodeConfig, default: SplitPolicy, fp8: bool = True) -> list[SplitPolicy]:
    """Split policies to try with ``kernel``: the default's first (target CTAs per SM = the
    kernel's own ``min_ctas_per_sm``), then the others. Only ``ctas_per_sm * waves`` matters to
    the scheduler, so one representative per product is kept. A kernel that runs columns of
    work items also gets the balanced policy (one column per resident CTA; waves do not apply)
    with each minimum split length."""
    pairs = [(kernel.min_ctas_per_sm, default.waves)]
    pairs += [(c, w) for c in SPLIT_CTAS for w in SPLIT_WAVES]
    blocks = [default.min_blocks_per_split]
    blocks += [b for b in MIN_BLOCKS_PER_SPLIT if b != default.min_blocks_per_split]
    seen: set[int] = set()
    out: list[SplitPolicy] = []
    fixed = replace(default, balanced=False, auto_balance=False)
    for c, w in pairs:
        if c * w in seen:
            continue
        seen.add(c * w)
        out += [replace(fixed, ctas_per_sm=c, waves=w, min_blocks_per_split=b) for b in blocks]
    if dc.column_capable(kernel, fp8):
        out += [replace(fixed, ctas_per_sm=kernel.min_ctas_per_sm, waves=1, min_blocks_per_split=b, balanced=True)
                for b in blocks]
        # first, the planner's own choice per batch (what the heuristic runs): at the timed shape
        # it is one of the fixed policies, which then alias it, and the entry that keeps it
        # settles again at the batch sizes the bucket's lookup serves
        out.insert(0, replace(fixed, ctas_per_sm=kernel.min_ctas_per_sm, waves=1, auto_balance=True))
    return out


@dataclass
class SearchSpace:
    """The candidates of one bucket, the heuristic default first."""

    bucket: Bucket
    num_sms: int
    default: DecodeConfig
    candidates: list[DecodeConfig]
    kernels: list[DecodeConfig]  # distinct kernel variants among the candidates, default's first
    pruned: list[tuple[DecodeConfig, ConfigProblem]]  # kernel variants the kernels would refuse
    aliases: int  # candidates dropped: same work list as an earlier one at the timed shape
    # the candidate that runs what the bucket's stored entry runs, measured right after the
    # default (None: no stored entry, or it is the default): see :func:`seeded`
    prior: DecodeConfig | None = None

    def ids(self) -> list[str]:
        return [config_id(c, self.bucket.format) for c in self.candidates]


def seeded(space: SearchSpace, stored: DecodeConfig) -> tuple[SearchSpace, str | None]:
    """``space`` with the candidate that runs the same kernel build and work list as ``stored``
    (a database entry's configuration, SM count stripped) as its prior, which the tuner measures
    right after the default. Why: re-timing a bucket after a kernel change (``--stale``,
    ``--force``) with a short budget must not lose the configuration that won before to a budget
    cut; it is the likeliest winner again. Returns a note (not an error) when today's space has no
    such candidate: the stored kernel variant was dropped or its split plan is no longer searched."""
    bucket = space.bucket
    target = stored.with_sms(space.num_sms)
    if target == space.default:
        return space, None  # measured first anyway
    if target in space.candidates:  # the usual case, without a work list per candidate
        return replace(space, prior=target), None
    try:  # an alias: another configuration that runs the same kernel build and work list
        wanted = _signature(target, bucket)
    except SnapmlaError as exc:
        return space, f"the stored configuration {config_id(stored, bucket.format)} does not run today ({exc})"
    if wanted == _signature(space.default, bucket):
        return space, None
    for cfg in space.candidates[1:]:
        if _signature(cfg, bucket) == wanted:
            return replace(space, prior=cfg), None
    return space, (f"the stored configuration {config_id(stored, bucket.format)} is not in today's search "
                   f"space; not timed first")


def settled_at(cfg: DecodeConfig, bucket: Bucket) -> DecodeConfig:
    """``cfg`` with an automatic balance settled at the bucket's timed shape: the kernel build
    and the work list that timing it runs."""
    return dc.settle_balance(cfg, [bucket.timed_context] * bucket.timed_batch, bucket.rows, bucket.fp8)


def _signature(cfg: DecodeConfig, bucket: Bucket) -> tuple[object, ...]:
    """What timing ``cfg`` at the bucket's timed shape runs: the kernel build and the work
    list's columns (all requests equally long), its automatic balance settled once."""
    cfg = settled_at(cfg, bucket)
    return (kernel_key(cfg, bucket.format), _plan_signature(cfg, bucket))


def _plan_signature(cfg: DecodeConfig, bucket: Bucket) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The work list's columns at the bucket's timed shape for a settled ``cfg``."""
    return work_columns([bucket.timed_context] * bucket.timed_batch, bucket.rows, cfg.block_m,
                        cfg.split, dc.runs_columns(cfg, bucket.fp8)).as_columns()


def search_space(bucket: Bucket, num_sms: int = DEFAULT_NUM_SMS) -> SearchSpace:
    """All candidates of ``bucket`` for a GPU with ``num_sms`` SMs (split plans depend on it)."""
    fmt = bucket.format
    default = default_config(bucket, num_sms)
    valid, pruned = kernel_variants(bucket.rows, fmt)
    default_kernel = replace(default, split=SplitPolicy())
    kernels = [default_kernel] + [k for k in valid if k != default_kernel]
    candidates: list[DecodeConfig] = [default]
    seen = {_signature(default, bucket)}
    aliases = 0
    for kernel in kernels:
        for policy in split_policies(kernel, default.split, bucket.fp8):
            cfg = replace(kernel, split=policy)
            if cfg == default:
                continue
            sig = _signature(cfg, bucket)
            if sig in seen:
                aliases += 1
                continue
            seen.add(sig)
            candidates.append(cfg)
    return SearchSpace(bucket, num_sms, default, candidates, kernels, pruned, aliases)


def same_kernel(a: DecodeConfig, b: DecodeConfig) -> bool:
    return replace(a, split=SplitPolicy()) == replace(b, split=SplitPolicy())
