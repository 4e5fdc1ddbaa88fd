"""Gap (audit of the GPU suite): the builds the tuner can store, and the shipped database's
configurations, that no GPU test compares with the reference.

``snapmla tune`` searches tuning/space.kernel_variants (FP8: the wgmma kernel's dims split /
alternate pages / rows = M at 2-5 stages, 1-2 CTAs per SM, RoPE ring 0 or 3; the mma.sync kernel
with 1, 2 or 4 token groups; BF16: the wgmma kernel and the mma.sync one at 2-5 stages, tile width
32 or 64), each in its one-item build and, where the layout can run columns, its column build.
Of those 91 builds (and 28 cluster-merge builds: test_cluster_every_layout_gpu.py) the suite
compares 35 with a reference (FP8 wgmma 27 of 58, FP8 mma.sync 3 of 18, BF16 wgmma 2 of 2, BF16
mma.sync 3 of 13): test_decode.py's KERNELS are heuristic configurations with one switch laid over,
registry.py registers only the heuristics'. Never checked: the dims split at 3 or 5 stages, the
RoPE ring but at (16 rows, 5 stages), (32 rows, 2 and 5), (64 rows, 4), rows = M's one-item build
at 3 stages, two CTAs per SM (but the dims split's one-item build at 2 stages), and every mma.sync
build of either format but the three heuristic ones (so no 4 token groups, no BF16 mma.sync
pipeline deeper than 2 stages). The tuner's own gate
runs each candidate once when someone tunes; a kernel change that breaks one of these builds is
found by no test, and the next tune silently drops the build (or, where the gate's two problems
miss the bug, stores it).

The shipped tuning_db/ files make v3-rg2-wa-rr3-st4 (RoPE ring of 3, 4 stages) the default of five
H100 / H200 buckets (h16 s2 b1-b8, h32 s1 b1-b8): only test_decode.py's exact-switch tests run it,
against itself with a define flipped, never against the reference.

Every test: fresh random data, NaN-poisoned unused cache rows (random_problem) and outputs,
lengths 0 / 1 / 63 / 64 / 65 / long, s_q 2 causal, h_q odd (a second, partial row tile), the
reference of the work list's own split bounds, and a second call bit for bit.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from sibling_modules import load

from snapmla_cli.numerics.problem import random_problem

pytestmark = pytest.mark.gpu

G = load("test_coverage_gaps")  # _run, _check_against_reference, _sms, COLUMN_LENS, COLUMN_SMS


def _tuner_builds() -> list[tuple[bool, object, str]]:
    """(fp8, config, id) of every distinct build (tuning/space.kernel_key) a tune can time and
    store: each kernel variant with the fixed split plan, and with balanced columns where its
    layout runs them. Derived from the space itself, so a new axis value is tested the day it is
    searched."""
    from snapmla_cli.ops.decode_config import balanced, column_capable
    from snapmla_cli.ops.schedule import SplitPolicy
    from snapmla_cli.tuning.space import config_id, kernel_key, kernel_variants

    builds, seen = [], set()
    for fmt in ("fp8", "bf16"):
        fp8 = fmt == "fp8"
        valid, _pruned = kernel_variants(128, fmt)  # 128 rows: every row-group count is valid
        for kernel in valid:
            one_item = replace(kernel, split=SplitPolicy(ctas_per_sm=kernel.min_ctas_per_sm))
            for cfg in ([one_item, balanced(one_item)] if column_capable(one_item, fp8) else [one_item]):
                key = kernel_key(cfg, fmt)
                if key not in seen:
                    seen.add(key)
                    builds.append((fp8, cfg, f"{fmt}-{config_id(cfg, fmt).replace('/', '-')}"))
    return builds


TUNER_BUILDS = _tuner_builds()


def _seed(text: str) -> int:
    return zlib.crc32(text.encode()) % 10_000


@pytest.mark.parametrize("fp8,cfg", [(f, c) for f, c, _ in TUNER_BUILDS], ids=[i for _, _, i in TUNER_BUILDS])
def test_every_tuner_build_matches_reference_and_repeats_bitwise(fp8, cfg):
    from snapmla_cli.ops.decode_config import runs_columns

    device = torch.device("cuda")
    seed = _seed(repr(cfg))  # (before the SM count: the same data on every GPU)
    cfg = cfg.with_sms(G.COLUMN_SMS if cfg.split.balanced else G._sms(device))
    h_q = cfg.block_m // 2 + 3  # s_q 2: block_m + 6 rows (a second, partial row tile), h_q odd
    prob = random_problem(G.COLUMN_LENS, 2, h_q, causal=True, seed=seed)
    out, lse, cache, meta, splits = G._run(prob, fp8, cfg, device)
    if runs_columns(cfg, fp8):
        assert meta.shape[1] > 1  # the column build really ran columns of items
    assert out.isfinite().all()
    G._check_against_reference(prob, fp8, out, lse, cache, meta, splits, device)
    again = G._run(prob, fp8, cfg, device)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


def _ring_pairs() -> list[tuple[object, object, str]]:
    """(ring, plain, id): each RoPE-ring variant of the search space and the same layout with the
    RoPE tiles in the stages, where that one fits too."""
    from snapmla_cli.ops.decode_config import fp8_config_valid
    from snapmla_cli.ops.schedule import SplitPolicy
    from snapmla_cli.tuning.space import config_id, kernel_variants

    pairs = []
    for kernel in kernel_variants(128, "fp8")[0]:
        if not kernel.rope_ring:
            continue
        ring = replace(kernel, split=SplitPolicy(ctas_per_sm=kernel.min_ctas_per_sm))
        plain = replace(ring, rope_ring=0)
        if fp8_config_valid(plain):
            pairs.append((ring, plain, config_id(ring, "fp8").replace("/", "-")))
    return pairs


RING_PAIRS = _ring_pairs()


@pytest.mark.parametrize("ring,plain", [(r, p) for r, p, _ in RING_PAIRS], ids=[i for _, _, i in RING_PAIRS])
def test_every_tuner_rope_ring_keeps_the_bits_of_its_plain_layout(ring, plain):
    """test_fp8_rope_ring_keeps_every_bit at the (stages, slots) pairs the tuner searches: the
    ring moves where a page's RoPE tile and scales wait, not what is computed. No test compares
    these pairs, and but for 32 rows at 2 stages none compares the ring builds with the
    reference: 3 slots over 2-3 stages (a ring deeper than the content pipeline, its phases
    wrapping at another period than the stages') and 4 stages (the shipped default at 17-32
    rows)."""
    device = torch.device("cuda")
    sms = G._sms(device)
    s_q, h_q = 2, ring.block_m // 2 + 3
    prob = random_problem([9000, 70, 0, 4097, 129, 64, 1], s_q, h_q, causal=True,
                          seed=ring.stages * 10 + ring.row_groups)
    a = G._run(prob, True, ring.with_sms(sms), device)
    b = G._run(prob, True, plain.with_sms(sms), device)
    assert torch.equal(a[3], b[3])  # the same work list
    assert a[0].isfinite().all()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    G._check_against_reference(prob, True, a[0], a[1], a[2], a[3], a[4], device)


def _shipped_configs() -> list[tuple[bool, int, int, object, str]]:
    """(fp8, s_q, h_q, config, id): every configuration the shipped tuning database answers with,
    at each shape it answers it for (what runs by default on those GPUs)."""
    from snapmla_cli.tuning import db
    from snapmla_cli.tuning.space import config_id

    seen, out = set(), []
    for path in sorted(Path(db.shipped_dir()).glob("*.yaml")):
        for section in db.load_file(path).sections:
            for entry in section.entries:
                b = entry.bucket
                key = (b.format, b.s_q, b.h_q, config_id(entry.config, b.format))
                if key not in seen:
                    seen.add(key)
                    name = f"{b.format}-h{b.h_q}-s{b.s_q}-{key[3].replace('/', '-')}"
                    out.append((b.fp8, b.s_q, b.h_q, entry.config, name))
    return out


SHIPPED = _shipped_configs()


@pytest.mark.parametrize("fp8,s_q,h_q,cfg", [c[:4] for c in SHIPPED], ids=[c[4] for c in SHIPPED])
def test_shipped_tuning_entries_match_reference_at_their_shape(fp8, s_q, h_q, cfg):
    """Each shipped entry's configuration (its kernel and split policy, on this GPU's SMs) at its
    bucket's h_q and s_q (causal where s_q > 1, as the tuner timed it) on mixed lengths."""
    device = torch.device("cuda")
    seed = _seed(f"{fp8}{s_q}{h_q}{cfg}")
    cfg = cfg.with_sms(G._sms(device))
    prob = random_problem([0, 1, 63, 65, 4097, 9000, 300, 2500], s_q, h_q, causal=s_q > 1, seed=seed)
    out, lse, cache, meta, splits = G._run(prob, fp8, cfg, device)
    assert out.isfinite().all()
    G._check_against_reference(prob, fp8, out, lse, cache, meta, splits, device)
    again = G._run(prob, fp8, cfg, device)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
