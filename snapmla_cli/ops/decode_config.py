"""Compile-time and launch parameters of the decode kernels: the tuner's search space and the
built-in heuristic used when the tuning database has no entry.

Shared-memory sizes mirror the ``kSmemBytes`` formulas of the kernels (which ``static_assert``
the same limit, and the wgmma kernels the host's exact launch size).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..errors import SnapmlaError, show
from ..numerics.formats import FP8_TOKEN_BYTES, PAGE_SIZE
from .schedule import SplitPolicy, prefer_balanced

ROWS_PER_GROUP = 16
WARPS_PER_GROUP = 2
MAX_SMEM_PER_CTA = 232448  # 227 KB opt-in on sm_90
FP8_Q_CONTENT_STRIDE = 512 + 16
FP8_Q_ROPE_STRIDE = 128 + 16
EXCHANGE_BYTES_PER_LANE_TILE = 16  # one float4 per lane per logit column tile
BF16_ROW_STRIDE = 576 * 2 + 16
FP8_REDUCE_BYTES_PER_ROW = 8  # (block max, block max of e * s_k) per row per token group
FP8_OUT_TILES = 32  # 8-wide output tiles per warp (256 dims)
MBARRIER_BYTES = 8
MAX_WARPS = 8

# FP8 kernel versions: 2 = mma.sync with f16 conversion (decode_fp8.cu), 3 = wgmma + TMA
# (decode_fp8_wgmma.cu). Mirrors of the latter's shared-memory map:
FP8_MMA_SYNC = 2
FP8_WGMMA = 3
FP8_KERNEL_VERSIONS = (FP8_MMA_SYNC, FP8_WGMMA)
# What runs when nothing is asked for: the wgmma kernel, with float32 promotion of its QK and PV
# accumulations (without promotion it failed `snapmla verify --ctx 32k` in 5 of 6 cases on the
# H200; with it, 6 of 6 with errors as small as the mma.sync kernel's: docs/PERF.md).
DEFAULT_FP8_KERNEL = FP8_WGMMA
# wgmma kernel warpgroup modes (WG_MODE): the two consumer warpgroups split the 512 output dims
# and share P; or each owns its rows (independent); or owns its rows and they take turns on
# the tensor cores (ping-pong); or they split the output dims and take the pages' QK and
# softmax in turn, handing the row state over (alternate pages); or the same with the query
# rows as wgmma's M in QK, so that a row's statistics are a quad's (64-row tiles only); or
# that with PV unswapped too, on a V^T the page's owner transposes in shared memory under its
# QK (6; an experiment, not searched by the tuner).
WG_DIMS_SPLIT, WG_OWN_ROWS, WG_PINGPONG, WG_ALT_PAGES, WG_ALT_ROWS_M, WG_ROWS_M_VT = 0, 1, 2, 3, 4, 6
WG_MODES = (WG_DIMS_SPLIT, WG_OWN_ROWS, WG_PINGPONG, WG_ALT_PAGES, WG_ALT_ROWS_M, WG_ROWS_M_VT)
WG_MODE_NAMES = {WG_DIMS_SPLIT: "wd", WG_OWN_ROWS: "wr", WG_PINGPONG: "wp", WG_ALT_PAGES: "wa",
                 WG_ALT_ROWS_M: "wm", WG_ROWS_M_VT: "wv"}
# the modes with the query rows as wgmma's M: 64-row tiles only
WG_ROWS_M_MODES = (WG_ALT_ROWS_M, WG_ROWS_M_VT)
WG_ALT_PAGES_MODES = (WG_ALT_PAGES, *WG_ROWS_M_MODES)
ROWS_M_ROW_GROUPS = 4  # rows = M fills wgmma's M = 64 with the CTA's rows
MIN_STAGES = 2  # the kernels' pipelines need two stages
# the heuristic's RoPE ring at 32-row tiles: three slots and five content stages (what fits next to Q)
RING_ROW_GROUPS, RING_STAGES, RING_SLOTS = 2, 5, 3
# RoPE ring sizes a configuration may name: none, or two slots up to MAX_ROPE_RING (shared memory
# decides what fits)
MAX_ROPE_RING = 8
ROPE_RING_CHOICES = (0, *range(MIN_STAGES, MAX_ROPE_RING + 1))
WGMMA_THREADS = 384  # two consumer warpgroups + one producer warpgroup
WGMMA_STAGE_BYTES = 5 * PAGE_SIZE * 128 + PAGE_SIZE * 16  # 4 content + RoPE boxes + scales
WGMMA_CONTENT_BYTES = 4 * PAGE_SIZE * 128  # a stage's content boxes alone (with a RoPE ring)
WGMMA_ROPE_SLOT_BYTES = WGMMA_STAGE_BYTES - WGMMA_CONTENT_BYTES  # a RoPE ring slot: RoPE box + scales
WGMMA_Q_BYTES_PER_ROW = 5 * 128
WGMMA_P_BYTES_PER_ROW = PAGE_SIZE
WGMMA_SMEM_ALIGN = 1024
WGMMA_ROW_INFO_BYTES = 32  # per row: sigma, 1/sigma, gamma, pad, one rescale factor per warp
WGMMA_ROW_CONST_BYTES = 8  # per row: logit scale, visible keys
WGMMA_ROW_STATE_BYTES = 16  # alternate pages, per row: m, sigma, last gamma, pad
# WG_MODE 3 up to this many rows keeps the row state twice, by block parity (every warp derives
# the rows' new state while the other warps still read the old one; kWarpRowState)
WGMMA_ROW_STATE_DOUBLE_MAX_ROWS = 32
# BF16 kernel versions, numbered as the FP8 ones: 2 = mma.sync (decode_bf16.cu), 3 = wgmma + TMA
# (decode_bf16_wgmma.cu: 64 query rows as wgmma's M, a page of nine 64 x 128 B tiles per stage).
BF16_MMA_SYNC, BF16_WGMMA = FP8_MMA_SYNC, FP8_WGMMA
BF16_KERNEL_VERSIONS = (BF16_MMA_SYNC, BF16_WGMMA)
# What runs for the BF16 baseline when nothing is asked for (docs/PERF.md, "Hopper BF16
# baseline, programmatic combine": 1.2-2.4x faster than the mma.sync kernel at its heuristic).
DEFAULT_BF16_KERNEL = BF16_WGMMA
BF16_WGMMA_ROW_GROUPS = 4  # the rows are wgmma's M = 64 (fewer rows are padded)
BF16_WGMMA_ROW_BYTES = 576 * 2
BF16_WGMMA_P_BYTES_PER_ROW = PAGE_SIZE * 2  # P[row][64 tokens] bf16, one 128-byte tile row
BF16_WGMMA_ROW_STATE_BYTES = 8  # per row: m, gamma of the last block
BF16_WGMMA_PAGE_PARTS = 3  # RoPE tile, each warpgroup's V dims: a full and an empty barrier each
SMEM_PER_SM = 233472  # 228 KB of shared memory per SM on sm_90
SMEM_RESERVED_PER_CTA = 1024  # the driver reserves 1 KB per resident CTA


@dataclass(frozen=True)
class DecodeConfig:
    """``row_groups`` 16-row groups per CTA (two warps each), ``kv_split`` token groups of
    warps sharing each page (FP8 kernel), ``stages`` pipeline depth,
    ``block_n`` tokens per stage (BF16 kernel; the FP8 kernel always uses the 64-token page,
    the P-quantization block), ``min_ctas_per_sm`` for ``__launch_bounds__``, the FP8
    ``kernel_version``, the wgmma kernel's float32 promotion flags ``qk_promote`` /
    ``pv_promote`` (0 or 1: shorter tensor-core accumulation chains, see
    kernels/decode_fp8_wgmma.cu), its warpgroup mode ``wg_mode`` (``WG_MODES``), the slots of its
    RoPE ring ``rope_ring`` (0: a page's RoPE tile and scales stay in its stage), and the split
    policy."""

    row_groups: int = 4
    kv_split: int = 1
    stages: int = 2
    block_n: int = 64
    min_ctas_per_sm: int = 1
    kernel_version: int = DEFAULT_FP8_KERNEL
    qk_promote: int = 1
    pv_promote: int = 1
    wg_mode: int = WG_DIMS_SPLIT
    rope_ring: int = 0
    split: SplitPolicy = field(default_factory=SplitPolicy)

    def __post_init__(self) -> None:
        """Fields of the right types (ints, a SplitPolicy); which values a kernel takes is
        :func:`checked_config`'s question, since the tuner builds and prunes invalid ones."""
        for name in ("row_groups", "kv_split", "stages", "block_n", "min_ctas_per_sm", "kernel_version",
                     "qk_promote", "pv_promote", "wg_mode", "rope_ring"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SnapmlaError(f"DecodeConfig.{name}: expected an int, got {show(value)}")
        if not isinstance(self.split, SplitPolicy):
            raise SnapmlaError(f"DecodeConfig.split: expected a SplitPolicy, got {type(self.split).__name__}")

    @classmethod
    def of(cls, fields: Mapping[str, int]) -> DecodeConfig:
        """A configuration from integer fields by name (a kernel spec, a tuner combination), the
        split policy at its default. A name that is not a field raises TypeError, a value that is
        not an int SnapmlaError (``__post_init__``)."""
        return cls(**fields)  # type: ignore[arg-type]  # ints only: the split policy is not named

    @property
    def block_m(self) -> int:
        return ROWS_PER_GROUP * self.row_groups

    @property
    def wgmma(self) -> bool:
        """The Hopper wgmma + TMA kernel of the config's format (else the mma.sync one)."""
        return self.kernel_version == FP8_WGMMA

    def threads(self, fp8: bool = True) -> int:
        if self.wgmma:
            return WGMMA_THREADS
        groups = self.kv_split if fp8 else 1
        return 32 * WARPS_PER_GROUP * self.row_groups * groups

    def with_sms(self, num_sms: int) -> DecodeConfig:
        return _with_sms(self, num_sms)


# Configurations are frozen and get_mla_metadata derives the same few every step: the derivations
# are cached (dataclasses.replace costs about 5 us a call, and a step made eight of them)
@functools.lru_cache(maxsize=256)
def _with_sms(cfg: DecodeConfig, num_sms: int) -> DecodeConfig:
    return replace(cfg, split=replace(cfg.split, num_sms=num_sms))


# (qk_promote, pv_promote, wg_mode) as DecodeConfig defaults them; the mma.sync kernel has none
# of these switches, so its configs keep the defaults (one spelling per kernel).
WGMMA_SWITCH_DEFAULTS = (DecodeConfig.qk_promote, DecodeConfig.pv_promote, DecodeConfig.wg_mode)


def wgmma_smem_bytes(cfg: DecodeConfig) -> int:
    """``kSmemBytes + kSmemAlign`` of decode_fp8_wgmma.cu."""
    rows = cfg.block_m
    alt_pages = cfg.wg_mode in WG_ALT_PAGES_MODES
    qk_rows = rows if alt_pages else rows // 2  # the rows of one warpgroup's softmax
    p_buffers = 4 if alt_pages else 2
    # the per-warp statistics exchange: (max, max e*s_k) per warp and row, row info; rows = M
    # reduces inside quads and needs neither
    exchange = 0 if cfg.wg_mode in WG_ROWS_M_MODES else 2 * 4 * qk_rows * 8 + 2 * qk_rows * WGMMA_ROW_INFO_BYTES
    row_state_buffers = 2 if cfg.wg_mode == WG_ALT_PAGES and qk_rows <= WGMMA_ROW_STATE_DOUBLE_MAX_ROWS else 1
    stage_bytes = WGMMA_CONTENT_BYTES if cfg.rope_ring else WGMMA_STAGE_BYTES
    return (rows * WGMMA_Q_BYTES_PER_ROW + cfg.stages * stage_bytes + cfg.rope_ring * WGMMA_ROPE_SLOT_BYTES
            + p_buffers * rows * (WGMMA_P_BYTES_PER_ROW + 4)  # P^T and gamma per buffered block
            + exchange + 2 * 4 * qk_rows * 4  # L partials per warp and row
            + rows * WGMMA_ROW_CONST_BYTES
            + (row_state_buffers * rows * WGMMA_ROW_STATE_BYTES if alt_pages else 0)
            + (2 * cfg.stages + cfg.rope_ring) * MBARRIER_BYTES + WGMMA_SMEM_ALIGN)


# decode_common.cuh kClusterRowStride: a split's partial row in shared memory for the cluster
# merge (ops/cluster_fold.py), 512 floats and 8 of padding, then one lse per row
CLUSTER_ROW_STRIDE = 512 + 8


def cluster_rows_fit(cfg: DecodeConfig, fp8: bool = True) -> bool:
    """Whether a row tile's partial rows fit in the wgmma kernel's stages, where its cluster
    build keeps them (the kernels' static_assert on cluster_partial_bytes)."""
    if fp8:
        stage_bytes = WGMMA_CONTENT_BYTES if cfg.rope_ring else WGMMA_STAGE_BYTES
    else:
        stage_bytes = PAGE_SIZE * BF16_WGMMA_ROW_BYTES
    return cfg.block_m * (CLUSTER_ROW_STRIDE + 1) * 4 <= cfg.stages * stage_bytes


def cluster_capable(cfg: DecodeConfig, fp8: bool) -> bool:
    """Whether the kernel of ``cfg`` can merge a request's splits as one cluster
    (ops/cluster_fold.py): a wgmma kernel (either format) with one item per CTA and room for
    the rows. The mma.sync kernels merge through the global partials only."""
    return cfg.wgmma and not runs_columns(cfg, fp8) and cluster_rows_fit(cfg, fp8)


def fp8_smem_bytes(cfg: DecodeConfig) -> int:
    if cfg.wgmma:
        return wgmma_smem_bytes(cfg)
    warps = WARPS_PER_GROUP * cfg.row_groups * cfg.kv_split
    n_tiles = PAGE_SIZE // cfg.kv_split // 8
    exchange = 2 * warps * n_tiles * 32 * EXCHANGE_BYTES_PER_LANE_TILE  # double-buffered
    reduce = cfg.kv_split * cfg.row_groups * ROWS_PER_GROUP * FP8_REDUCE_BYTES_PER_ROW
    return (cfg.block_m * (FP8_Q_CONTENT_STRIDE + FP8_Q_ROPE_STRIDE)
            + cfg.stages * PAGE_SIZE * FP8_TOKEN_BYTES + exchange + reduce
            + cfg.stages * MBARRIER_BYTES)


def fp8_config_valid(cfg: DecodeConfig) -> bool:
    """The constraints the kernel ``static_assert``s: <= 8 warps per SM (the kernel needs
    ~230-250 registers per thread), page space for the token-group reduction, >= 2 stages,
    shared memory within the opt-in limit."""
    if cfg.kernel_version not in FP8_KERNEL_VERSIONS:
        return False
    if not cfg.wgmma and ((cfg.qk_promote, cfg.pv_promote, cfg.wg_mode) != WGMMA_SWITCH_DEFAULTS or cfg.rope_ring):
        return False  # wgmma-only switches; the mma.sync kernel accumulates in float32 already
    if cfg.wgmma:
        return (cfg.kv_split == 1 and cfg.row_groups in (1, 2, 4) and cfg.stages >= MIN_STAGES
                and cfg.qk_promote in (0, 1) and cfg.pv_promote in (0, 1) and cfg.wg_mode in WG_MODES
                and (cfg.wg_mode not in WG_ROWS_M_MODES or cfg.row_groups == ROWS_M_ROW_GROUPS)
                and cfg.rope_ring in ROPE_RING_CHOICES and (cfg.rope_ring == 0 or cfg.wg_mode == WG_ALT_PAGES)
                and cfg.min_ctas_per_sm in (1, 2) and fp8_smem_bytes(cfg) <= MAX_SMEM_PER_CTA
                and cfg.min_ctas_per_sm * (fp8_smem_bytes(cfg) + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM)
    warps = WARPS_PER_GROUP * cfg.row_groups * cfg.kv_split
    scratch = 2 * cfg.row_groups * 32 * (FP8_OUT_TILES + 1) * EXCHANGE_BYTES_PER_LANE_TILE
    return (warps * cfg.min_ctas_per_sm <= MAX_WARPS and cfg.stages >= 2 and cfg.kv_split in (1, 2, 4)
            and cfg.row_groups in (1, 2, 4)
            and (cfg.kv_split == 1 or scratch <= cfg.stages * PAGE_SIZE * FP8_TOKEN_BYTES)
            and fp8_smem_bytes(cfg) <= MAX_SMEM_PER_CTA)


def fit_stages(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with its pipeline as deep as it can be up to ``cfg.stages`` while the shared
    memory fits: a warpgroup mode or promotion switch laid over a heuristic configuration may
    need more buffers than the configuration was chosen for (alternate pages at 64 rows holds
    three pages, not four). Unchanged when it already fits or nothing smaller fits."""
    fitted = cfg
    while not fp8_config_valid(fitted) and fitted.stages > MIN_STAGES:
        fitted = replace(fitted, stages=fitted.stages - 1)
    return fitted if fp8_config_valid(fitted) else cfg


def bf16_wgmma_smem_bytes(cfg: DecodeConfig) -> int:
    """``kSmemBytes + kSmemAlign`` of decode_bf16_wgmma.cu."""
    rows = cfg.block_m
    return (rows * BF16_WGMMA_ROW_BYTES + cfg.stages * PAGE_SIZE * BF16_WGMMA_ROW_BYTES
            + rows * BF16_WGMMA_P_BYTES_PER_ROW + rows * BF16_WGMMA_ROW_STATE_BYTES
            + 2 * cfg.stages * BF16_WGMMA_PAGE_PARTS * MBARRIER_BYTES + WGMMA_SMEM_ALIGN)


def bf16_smem_bytes(cfg: DecodeConfig) -> int:
    if cfg.wgmma:
        return bf16_wgmma_smem_bytes(cfg)
    warps = WARPS_PER_GROUP * cfg.row_groups
    n_tiles = cfg.block_n // 8
    return (cfg.block_m * BF16_ROW_STRIDE + cfg.stages * cfg.block_n * BF16_ROW_STRIDE
            + warps * n_tiles * 32 * EXCHANGE_BYTES_PER_LANE_TILE)


def fp8_kernel(cfg: DecodeConfig) -> tuple[str, str]:
    """(source, kernel name) of the FP8 decode kernel ``cfg`` selects."""
    if cfg.wgmma:
        return "decode_fp8_wgmma.cu", "snapmla_decode_fp8_wgmma"
    return "decode_fp8.cu", "snapmla_decode_fp8"


# FP8 wgmma layouts (row_groups, wg_mode, min_ctas_per_sm) whose consumers spill when the
# kernel loops over a column's work items (found by compiling every tuner variant with
# COLUMN_ITEMS=1): alternate pages at 64 rows (O's 128 registers leave none for the loop),
# alternate pages at 16 rows with two CTAs per SM (104 registers), and 32 rows with two CTAs per
# SM (which spills without the loop too). They run one item per CTA; CI compiles every
# registered variant with the COLUMN_ITEMS its config gets. Rows = M (64 rows) runs columns
# since its column build reads PV's gammas from shared memory (kRowsMColumns in the kernel).
COLUMN_LOOP_SPILLS = {(ROWS_M_ROW_GROUPS, WG_ALT_PAGES, 1), (1, WG_ALT_PAGES, 2), (2, WG_DIMS_SPLIT, 2)}


def column_capable(cfg: DecodeConfig, fp8: bool) -> bool:
    """Whether ``cfg``'s kernel layout can run a column of work items per CTA: the wgmma
    kernels, but for the layouts whose column loop spills."""
    if not cfg.wgmma:
        return False
    if fp8 and cfg.rope_ring:  # the ring's phases start at the item
        return False
    return not fp8 or (cfg.row_groups, cfg.wg_mode, cfg.min_ctas_per_sm) not in COLUMN_LOOP_SPILLS


def runs_columns(cfg: DecodeConfig, fp8: bool) -> bool:
    """Whether ``cfg``'s kernel is built to run a column of work items per CTA (``COLUMN_ITEMS``):
    where its policy is balanced and its layout can. Only then: the other configurations keep
    the one-item build (the column loop's code is not free where nothing uses it)."""
    return cfg.split.balanced and column_capable(cfg, fp8)


def balanced(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with the balanced split policy (columns where its kernel can run them)."""
    return with_balance(cfg, True)


@functools.lru_cache(maxsize=256)
def with_balance(cfg: DecodeConfig, balanced_columns: bool) -> DecodeConfig:
    """``cfg`` with its split policy fixed to balanced columns or to the split plan (an
    ``auto_balance`` policy settled)."""
    return replace(cfg, split=replace(cfg.split, balanced=balanced_columns, auto_balance=False))


def settle_blind(cfg: DecodeConfig) -> DecodeConfig:
    """An ``auto_balance`` policy settled without the batch (a decode call whose work list
    ``get_mla_metadata`` did not plan): the split plan's one-item build, which runs any work
    list, columns included. Other configurations are returned as they are."""
    return with_balance(cfg, False) if cfg.split.auto_balance else cfg


def settle_balance(cfg: DecodeConfig, seqlens: list[int], rows: int, fp8: bool) -> DecodeConfig:
    """An ``auto_balance`` policy decided for this batch: balanced columns where the layout can
    run them and the planner's model says they finish sooner (:func:`schedule.prefer_balanced`),
    else the split plan. Other configurations are returned as they are. ``get_mla_metadata``
    settles once per step, and the kernel build (``COLUMN_ITEMS``) follows the settled policy."""
    if not cfg.split.auto_balance:
        return cfg
    columns = column_capable(cfg, fp8) and prefer_balanced(seqlens, rows, cfg.block_m, cfg.split)
    return with_balance(cfg, columns)


def fp8_defines(cfg: DecodeConfig) -> dict[str, int]:
    if cfg.wgmma:  # the kernel static_asserts that its layout needs exactly this launch size
        return {"ROW_GROUPS": cfg.row_groups, "STAGES": cfg.stages,
                "MIN_CTAS_PER_SM": cfg.min_ctas_per_sm, "QK_PROMOTE": cfg.qk_promote,
                "PV_PROMOTE": cfg.pv_promote, "WG_MODE": cfg.wg_mode,
                "COLUMN_ITEMS": int(runs_columns(cfg, True)), "SNAPMLA_EXPECT_SMEM": wgmma_smem_bytes(cfg),
                **({"ROPE_RING": cfg.rope_ring} if cfg.rope_ring else {})}
    return {"ROW_GROUPS": cfg.row_groups, "KV_SPLIT": cfg.kv_split, "STAGES": cfg.stages,
            "MIN_CTAS_PER_SM": cfg.min_ctas_per_sm}


def bf16_config_valid(cfg: DecodeConfig) -> bool:
    """What the BF16 kernels accept: the wgmma one 64-row tiles of whole pages, one CTA per SM
    (two 72 KB pages and Q fill shared memory); the mma.sync one 16 to 64 rows, a tile width
    dividing the page. Neither has the FP8 kernels' token groups or wgmma switches."""
    if cfg.kernel_version not in BF16_KERNEL_VERSIONS or cfg.kv_split != 1:
        return False
    if (cfg.qk_promote, cfg.pv_promote, cfg.wg_mode) != WGMMA_SWITCH_DEFAULTS or cfg.stages < MIN_STAGES:
        return False
    if cfg.wgmma:
        return (cfg.row_groups == BF16_WGMMA_ROW_GROUPS and cfg.block_n == PAGE_SIZE
                and cfg.min_ctas_per_sm == 1 and bf16_smem_bytes(cfg) <= MAX_SMEM_PER_CTA)
    return (cfg.row_groups in (1, 2, 4) and cfg.block_n in (16, 32, 64)
            and cfg.min_ctas_per_sm * cfg.row_groups * WARPS_PER_GROUP <= MAX_WARPS
            and bf16_smem_bytes(cfg) <= MAX_SMEM_PER_CTA)


def checked_config(config: object, fp8: bool) -> DecodeConfig | None:
    """A caller's explicit configuration, refused here with its name when the format's kernels
    would not compile or launch it (rather than as a ZeroDivisionError in the planner or a
    compile error on the GPU); None stays None (the database or the heuristic decides)."""
    if config is None:
        return None
    if not isinstance(config, DecodeConfig):
        raise SnapmlaError(f"config: expected a DecodeConfig or None, got {type(config).__name__}")
    valid = fp8_config_valid(config) if fp8 else bf16_config_valid(config)
    if not valid:
        from ..tuning.space import config_problem  # (the tuner's space imports this module)

        problem = config_problem(config, "fp8" if fp8 else "bf16")
        why = f": {problem}" if problem is not None else ""
        raise SnapmlaError(f"config: not a configuration the {'FP8' if fp8 else 'BF16'} decode kernels accept{why} "
                           f"({config}; snapmla tune --dry-run lists the valid ones)")
    return config


def pads_row_tile(cfg: DecodeConfig, fp8: bool) -> bool:
    """Whether ``cfg``'s kernel works on whole 64-row tiles whatever the rows, padding the rest
    (the BF16 wgmma kernel: the rows are its wgmma M), so that its row groups must never be
    narrowed to the rows a shape needs."""
    return not fp8 and cfg.wgmma


def bf16_kernel(cfg: DecodeConfig) -> tuple[str, str]:
    """(source, kernel name) of the BF16 decode kernel ``cfg`` selects."""
    if cfg.wgmma:
        return "decode_bf16_wgmma.cu", "snapmla_decode_bf16_wgmma"
    return "decode_bf16.cu", "snapmla_decode_bf16"


def bf16_defines(cfg: DecodeConfig) -> dict[str, int]:
    if cfg.wgmma:
        return {"ROW_GROUPS": cfg.row_groups, "STAGES": cfg.stages, "MIN_CTAS_PER_SM": cfg.min_ctas_per_sm,
                "COLUMN_ITEMS": int(runs_columns(cfg, False)), "SNAPMLA_EXPECT_SMEM": bf16_wgmma_smem_bytes(cfg)}
    return {"ROW_GROUPS": cfg.row_groups, "STAGES": cfg.stages, "BLOCK_N": cfg.block_n,
            "MIN_CTAS_PER_SM": cfg.min_ctas_per_sm}


SPEC_FIELDS = ("kernel_version", "row_groups", "kv_split", "stages", "min_ctas_per_sm", "qk_promote",
               "pv_promote", "wg_mode", "rope_ring")


def config_from_spec(spec: str) -> DecodeConfig:
    """A decode config from the compact text the kernel scripts take,
    ``version:row_groups:kv_split:stages:ctas[:qk_promote:pv_promote[:wg_mode[:rope_ring]]]``; omitted
    trailing fields keep their defaults; the split policy targets ``ctas`` CTAs per SM."""
    try:
        values = [int(v) for v in spec.split(":")]
    except ValueError:
        values = []
    if not 5 <= len(values) <= len(SPEC_FIELDS):
        raise SnapmlaError(f"kernel spec {show(spec)}: expected "
                           f"{':'.join(SPEC_FIELDS[:5])}[:{':'.join(SPEC_FIELDS[5:])}]")
    cfg = DecodeConfig.of(dict(zip(SPEC_FIELDS, values)))
    return replace(cfg, split=replace(cfg.split, ctas_per_sm=cfg.min_ctas_per_sm))


@functools.lru_cache(maxsize=256)
def heuristic_config(rows: int, fp8: bool = True, version: int | None = None) -> DecodeConfig:
    """Built-in choice, from the variant sweeps and tuned entries on the H200 (docs/PERF.md).
    wgmma kernel (float32 promotion on): up to 32 rows one CTA per SM with the warpgroups taking
    alternate pages, four pages deep (17-32 rows: five pages of content, their RoPE tiles and scales
    in a ring of three, the split plan); 33+ rows the same with the rows as QK's M (rows = M,
    33-63 rows padded to a 64-row tile: 20-30% faster than alternate pages alone at 64 rows,
    docs/PERF.md); the split policy
    leaves balanced columns or the split plan to the planner, per batch (``auto_balance``,
    :func:`settle_balance`). mma.sync kernel: 16 rows as two small CTAs per SM; 32 rows as two
    row groups with two token groups per page; 64+ rows as 64-row tiles. BF16 (``version``
    defaults to ``DEFAULT_BF16_KERNEL``): the wgmma kernel always works on 64-row tiles, in
    balanced columns where a request needs two or more of them; the mma.sync one as before."""
    if version is None:
        version = DEFAULT_FP8_KERNEL if fp8 else DEFAULT_BF16_KERNEL
    row_groups = 1 if rows <= 16 else 2 if rows <= 32 else 4
    if fp8 and version == FP8_WGMMA:
        # one CTA per SM, its warpgroups taking alternate pages four deep, at every row count
        # (32 rows x 2 CTAs per SM lack registers: ptxas serializes the wgmmas); at 16 rows
        # this beat two CTAs per SM with the dims split in every tuned bucket, b 1-128
        # (1.01-1.16x, docs/PERF.md, twenty-first session)
        mode = WG_ALT_ROWS_M if row_groups == ROWS_M_ROW_GROUPS else WG_ALT_PAGES
        cfg = fit_stages(DecodeConfig(row_groups=row_groups, stages=4, min_ctas_per_sm=1,
                                      kernel_version=FP8_WGMMA, wg_mode=mode))
        if row_groups == RING_ROW_GROUPS:
            # 17-32 rows: the RoPE tiles and scales in a ring of their own and five content stages
            # (1.02-1.03x at b 64, 16k-128k, docs/PERF.md, twenty-sixth session); the ring runs
            # one work item per CTA, so the split plan
            cfg = replace(cfg, stages=RING_STAGES, rope_ring=RING_SLOTS)
        # each batch gets the split plan or balanced columns, whichever the planner's model
        # says finishes sooner (where the layout can run columns)
        cfg = replace(cfg, split=replace(cfg.split, auto_balance=column_capable(cfg, True)))
    elif fp8:
        if row_groups == 1:
            cfg = DecodeConfig(row_groups=1, kv_split=1, stages=2, min_ctas_per_sm=2, kernel_version=FP8_MMA_SYNC)
        elif row_groups == 2:
            cfg = DecodeConfig(row_groups=2, kv_split=2, stages=3, min_ctas_per_sm=1, kernel_version=FP8_MMA_SYNC)
        else:
            cfg = DecodeConfig(row_groups=4, kv_split=1, stages=2, min_ctas_per_sm=1, kernel_version=FP8_MMA_SYNC)
    elif version == BF16_WGMMA:
        cfg = DecodeConfig(row_groups=BF16_WGMMA_ROW_GROUPS, stages=MIN_STAGES, block_n=PAGE_SIZE,
                           min_ctas_per_sm=1, kernel_version=BF16_WGMMA)
        if rows > cfg.block_m:
            # two or more 64-row tiles per request: balanced columns. Every tuned H200 bucket of
            # 128-256 rows from 32k on chose them, b 1-64 (1.02-1.09x over the split plan); at
            # 16k half did, and the two came within 3% of each other either way (docs/PERF.md,
            # twenty-second session). The planner's cost model, drawn from the FP8 kernel, does
            # not see this, so the choice is fixed here rather than left to auto_balance.
            cfg = balanced(cfg)
    else:
        block_n = 64 if row_groups == 1 else 32
        cfg = DecodeConfig(row_groups=row_groups, stages=2, block_n=block_n, min_ctas_per_sm=1,
                           kernel_version=BF16_MMA_SYNC)
    return replace(cfg, split=replace(cfg.split, ctas_per_sm=cfg.min_ctas_per_sm))


# Row-tile pages per SM below which 64-row tiles (rows = M) are split into smaller row tiles on
# the alternate-pages kernel. A 64-row tile's page is one long chain (QK, softmax, PV of 64 rows);
# with few pages per SM the call is that chain's latency, and more CTAs over the same pages finish
# sooner. From both GPUs' sweeps of 64 / 32 / 16-row tiles (scripts/ab_small_work.py, docs/PERF.md,
# forty-fifth session): requests of two or more 64-row tiles ran fastest as 64-row tiles from 7.8
# tile-pages per SM on, and slower below 6 but for one shape (2.5%); requests of one 64-row tile
# (64 rows) still gained 6-16% from 32-row tiles at 7.8 (0.6% lost on the H200 at one shape), and
# split the GPUs at 15.5, so their threshold sits between the two.
SMALL_WORK_TILE_PAGES_PER_SM = 6.0
SMALL_WORK_ONE_TILE_PAGES_PER_SM = 12.0
# 16-row tiles only where the call has at most this many (request, 32-row tile) pairs: with more,
# each page is read by more CTAs than the shorter chains save (h64 s1 b 4 4k and h128 s2 b 1 4k,
# eight pairs, ran 6-17% faster as 32-row tiles on both GPUs; with two or four pairs 16-row tiles
# beat 32-row ones by up to 1.17x, h64 s1 b 1 4k).
SMALL_WORK_MAX_PAIRS_FOR_16_ROWS = 4


def tile_pages_per_sm(rows: int, batch: int, context: float, sms: int, groups: int = ROWS_M_ROW_GROUPS) -> float:
    """(request, row tile) pages per SM of a call whose row tiles hold ``groups`` row groups: the
    work measure of the small-work rule (and of scripts/ab_small_work.py's shape filter)."""
    tiles = math.ceil(rows / (groups * ROWS_PER_GROUP))
    return tiles * batch * max(1, math.ceil(context / PAGE_SIZE)) / sms


def small_work_row_groups(rows: int, batch: int, context: float, sms: int) -> int:
    """Row groups (16 rows each) of the row tile for ``rows`` rows of ``batch`` requests of mean
    ``context`` tokens on ``sms`` SMs: the largest tile, from the 64-row one down, whose tiles
    times pages give every SM enough work (``SMALL_WORK_ONE_TILE_PAGES_PER_SM`` for requests of
    one 64-row tile, ``SMALL_WORK_TILE_PAGES_PER_SM`` otherwise); below that 16-row tiles where
    the 32-row pairs are few (``SMALL_WORK_MAX_PAIRS_FOR_16_ROWS``), else 32-row tiles."""
    for groups in (ROWS_M_ROW_GROUPS, RING_ROW_GROUPS):
        one_tile = groups == ROWS_M_ROW_GROUPS and rows <= groups * ROWS_PER_GROUP
        enough = SMALL_WORK_ONE_TILE_PAGES_PER_SM if one_tile else SMALL_WORK_TILE_PAGES_PER_SM
        if tile_pages_per_sm(rows, batch, context, sms, groups) >= enough:
            return groups
    pairs_32 = batch * math.ceil(rows / (RING_ROW_GROUPS * ROWS_PER_GROUP))
    return 1 if pairs_32 <= SMALL_WORK_MAX_PAIRS_FOR_16_ROWS else RING_ROW_GROUPS


def heuristic_for_work(rows: int, fp8: bool, batch: int | None, context: float | None,
                       sms: int) -> DecodeConfig:
    """The built-in choice for a call whose work is known: :func:`heuristic_config`, except that
    an FP8 call of 64-row tiles with too few pages per SM runs the configuration of smaller row
    tiles (:func:`small_work_row_groups`), which the kernel runs over any row count. Unknown work
    (``batch`` or ``context`` None, a host that does not know the lengths) keeps the rows-only
    choice, as do BF16 and the mma.sync kernel."""
    cfg = heuristic_config(rows, fp8)
    if batch is None or context is None or batch < 1 or sms < 1:
        return cfg
    if not (fp8 and cfg.kernel_version == FP8_WGMMA and cfg.row_groups == ROWS_M_ROW_GROUPS):
        return cfg
    groups = small_work_row_groups(rows, batch, context, sms)
    return cfg if groups == ROWS_M_ROW_GROUPS else heuristic_config(groups * ROWS_PER_GROUP, fp8)


def variant_config(rows: int, version: int = DEFAULT_FP8_KERNEL, **overrides: int) -> DecodeConfig:
    """An FP8 kernel variant: the heuristic configuration for ``rows`` with ``overrides`` (a
    warpgroup mode, promotion switches, a depth) laid over it, its pipeline fitted to the shared
    memory (:func:`fit_stages`). What ``verify --fp8-kernel``, the kernel registry and the tests
    build for a named variant."""
    cfg = replace(heuristic_config(rows, True, version), **overrides)  # type: ignore[arg-type]  # int fields
    if cfg.rope_ring and "rope_ring" not in overrides and not fp8_config_valid(cfg):
        cfg = replace(cfg, rope_ring=0)  # a layout the heuristic's RoPE ring does not apply to
    return fit_stages(cfg)
