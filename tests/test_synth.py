"""The synthetic KV generator: determinism, DeepSeek RoPE, ranges, probe queries (docs/DATA.md)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snapmla_cli.cache.synth import (
    SynthSpec,
    apply_rope,
    effective_keys,
    layer_stats,
    probe_queries,
    rope_frequencies,
    synth_dump,
    synth_layer_kv,
)
from snapmla_cli.numerics.formats import D_CONTENT, default_softmax_scale


def test_same_seed_same_bytes() -> None:
    a = synth_dump(SynthSpec(layers=2, tokens=300, queries=2, heads=3, seed=5))
    b = synth_dump(SynthSpec(layers=2, tokens=300, queries=2, heads=3, seed=5))
    c = synth_dump(SynthSpec(layers=2, tokens=300, queries=2, heads=3, seed=6))
    for x, y, z in zip(a.layers, b.layers, c.layers):
        assert torch.equal(x.kv, y.kv) and torch.equal(x.queries, y.queries)
        assert not torch.equal(x.kv, z.kv)


def test_deepseek_rope_frequencies_and_rotation() -> None:
    f = rope_frequencies()
    assert f[0] == 1.0 and math.isclose(float(f[31]), 10000 ** (-62 / 64) / 40, rel_tol=1e-12)
    assert bool((f[1:] < f[:-1]).all())  # frequencies fall with the pair index
    x, y = torch.randn(2, 64, dtype=torch.float64)
    # a rotation: pair norms kept; the dot product depends only on the position difference
    rx = apply_rope(x[None], torch.tensor([1000]))[0]
    assert torch.allclose(rx.view(32, 2).norm(dim=1), x.view(32, 2).norm(dim=1))
    d1 = apply_rope(x[None], torch.tensor([1000]))[0] @ apply_rope(y[None], torch.tensor([990]))[0]
    d2 = apply_rope(x[None], torch.tensor([50]))[0] @ apply_rope(y[None], torch.tensor([40]))[0]
    assert math.isclose(float(d1), float(d2), rel_tol=1e-9)
    # interleaved pairs: (x0, x1) turns by pos * f_0 = pos radians
    e = torch.zeros(64, dtype=torch.float64)
    e[0] = 1.0
    r = apply_rope(e[None], torch.tensor([1]))[0]
    assert math.isclose(float(r[0]), math.cos(1.0)) and math.isclose(float(r[1]), math.sin(1.0))


def test_ranges_grow_with_depth_like_the_paper() -> None:
    first = layer_stats(synth_layer_kv(8192, 0.0, 0, 0)[0])
    last = layer_stats(synth_layer_kv(8192, 1.0, 0, 7)[0])
    for st in (first, last):
        assert st.content_absmax < 20 and 0.1 < st.content_rms < 1.0
    assert first.rope_p999 < 200 and last.rope_p999 > 500  # ~1e2 -> ~1e3
    assert last.rope_absmax > 3 * last.rope_p999 / 2  # outlier tails
    assert last.rope_rms > 5 * first.rope_rms


def test_sinks_and_per_token_magnitudes() -> None:
    kv, _ = synth_layer_kv(4096, 0.5, 0, 3)
    amax = kv[:, :D_CONTENT].float().abs().amax(dim=1)
    assert amax[0] > 2 * amax.median()  # token 0 is a sink
    assert amax.max() / amax.min() > 3  # per-token magnitudes vary


def test_probe_queries_attend_neither_uniformly_nor_one_hot() -> None:
    kv, _ = synth_layer_kv(4096, 1.0, 0, 7)
    q = probe_queries(kv, 3, 8, seed=1)
    assert q.shape == (3, 8, 576) and q.dtype == torch.bfloat16
    logits = default_softmax_scale() * (q.double().reshape(-1, 576) @ kv.double().T)
    n_eff = effective_keys(logits)
    assert bool((n_eff > 4).all()) and bool((n_eff < 2048).all())
    assert float(torch.softmax(logits, -1).amax(-1).median()) < 0.9


def test_probe_queries_anchor_position() -> None:
    kv, _ = synth_layer_kv(1024, 1.0, 0, 7)
    q = probe_queries(kv, 2, 4, seed=0, anchors=[100, 1023])
    assert q.shape == (2, 4, 576)


def test_bad_sizes_and_anchors_are_one_line_errors() -> None:
    import pytest

    from snapmla_cli.errors import SnapmlaError

    with pytest.raises(SnapmlaError, match="synth: tokens must be at least 1, got 0"):
        synth_layer_kv(0, 0.5, 0)
    for spec in (SynthSpec(layers=1, tokens=8, heads=0), SynthSpec(layers=0, tokens=8), SynthSpec(tokens=0)):
        with pytest.raises(SnapmlaError, match="synth: need layers, tokens, heads >= 1 and queries >= 0"):
            synth_dump(spec)
    kv, _ = synth_layer_kv(10, 0.5, 0)
    for anchors in ([10], [-1], [3, 4]):
        with pytest.raises(SnapmlaError, match=r"probe queries: need 1 anchors within 0\.\.9"):
            probe_queries(kv, 1, 2, 0, anchors=anchors)
    assert probe_queries(kv, 1, 2, 0, anchors=[9]).shape == (1, 2, 576)


def test_probe_queries_of_a_short_cache_spread_over_at_most_half_its_keys() -> None:
    """The drawn effective key count (8 .. 1024) is capped at half the keys: over 32 keys no row
    attends (nearly) uniformly."""
    kv, _ = synth_layer_kv(32, 0.5, 0, 2)
    q = probe_queries(kv, 4, 8, seed=3)
    n_eff = effective_keys(default_softmax_scale() * (q.double().reshape(-1, 576) @ kv.double().T))
    assert float(n_eff.max()) < 0.55 * 32 and float(n_eff.min()) > 4


def test_layer_stats_use_nearest_rank_quantiles_and_the_median_token() -> None:
    from snapmla_cli.cache.synth import _quantile

    assert _quantile(torch.arange(1.0, 11.0), 0.25) == 3.0 and _quantile(torch.arange(1.0, 11.0), 1.0) == 10.0
    kv = torch.zeros(5, 576)
    kv[:, 0] = torch.tensor([1.0, 1.0, 1.0, 2.0, 10.0])
    kv[:, D_CONTENT + 3] = 0.5
    stats = layer_stats(kv)
    assert stats.token_amax_spread == 10.0 and stats.content_absmax == 10.0 and stats.rope_absmax == 0.5


def test_synth_bytes_count_every_layers_cache_and_queries() -> None:
    """Each layer keeps its bf16 KV and its bf16 probe queries: the queries' term was missing, so
    400 layers of 64 x 1024 probe rows (28 GiB of queries) passed the host-memory check."""
    from snapmla_cli.cache.synth import synth_bytes

    one, eight = SynthSpec(layers=1, tokens=1000, queries=3, heads=5), SynthSpec(layers=8, tokens=1000, queries=3, heads=5)
    assert synth_bytes(eight) - synth_bytes(one) == 7 * (1000 + 3 * 5) * 576 * 2


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS from /proc (Linux)")
@pytest.mark.parametrize(("layers", "queries"), [(1, 4), (16, 16)])
def test_synth_bytes_cover_a_many_row_build_measured_in_a_fresh_process(layers: int, queries: int) -> None:
    """The host-memory check trusts the estimate: at few tokens and many probe rows (4,096 here)
    the build's peak is the gathered keys, which the estimate once put 25% low (a 100,000-head
    synth passed the check and the kernel killed it); over many layers of many rows, the queries
    every layer keeps (16 layers of 16,384 rows: without them the estimate was 8% low). The growth of a fresh process's peak RSS
    (VmHWM: a new process image starts its own, unlike getrusage's maxrss, which keeps the
    forking parent's across exec)."""
    code = (
        "from snapmla_cli.cache.synth import SynthSpec, synth_bytes, synth_dump\n"
        "def hwm():\n"
        "    line = next(t for t in open('/proc/self/status') if t.startswith('VmHWM:'))\n"
        "    return int(line.split()[1]) * 1024\n"
        f"spec = SynthSpec(layers={layers}, tokens=64, queries={queries}, heads=1024, seed=1)\n"
        "base = hwm()\n"
        "synth_dump(spec)\n"
        "print(hwm() - base, synth_bytes(spec))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown, estimate = (int(v) for v in done.stdout.split())
    assert grown > 100 * 2**20, done.stdout  # the build did allocate what is being compared
    assert grown <= estimate <= 1.5 * grown, (grown, estimate)


def test_probe_queries_are_sized_for_the_softmax_scale_given() -> None:
    """The attention spread is matched at the caller's softmax scale: half the scale, twice the
    query (the logits, and so the spread, stay the same)."""
    kv, _ = synth_layer_kv(256, 0.5, 0, 1)
    q = probe_queries(kv, 2, 4, seed=0).float()
    q_half = probe_queries(kv, 2, 4, seed=0, softmax_scale=default_softmax_scale() / 2).float()
    assert float((q_half - 2 * q).norm() / (2 * q).norm()) < 1e-2
