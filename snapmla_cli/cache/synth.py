"""Synthetic MLA KV caches and probe queries shaped like a real model's (docs/DATA.md measures them).

The data is built the way a DeepSeek-style MLA layer makes it; every parameter is a named
constant below:

- **content** (512 dims, the normalised latent): ``c[t, ch] = g_t * w_ch * z[t, ch]``. ``z`` is
  the topic direction of the token's segment plus noise (tokens come in topic segments, so keys
  cluster and a query can concentrate on a topic), ``w_ch`` a log-normal channel gain with a few
  outlier channels, ``g_t`` a log-normal per-token magnitude; "sink" tokens (position 0 and one
  delimiter-like token per ``SINK_EVERY``) carry massive values (about +-``SINK_VALUE``) in a
  few shared channels. |c| stays below about 15.
- **RoPE** (64 dims): per pair ``i`` the pre-rotation key is a fixed per-layer direction (the
  consistent, "massive" component real keys carry in their low-frequency pairs) times a pair
  amplitude, plus heavy-tailed Student-t noise, times a small per-token gain; it is then rotated
  the DeepSeek way (interleaved pairs ``(2i, 2i+1)``, angle ``pos * f_i``) at the token's real
  position. ``f_i`` are DeepSeek-V3's frequencies: theta 10000 with its YaRN correction
  (factor 40, original context 4096, beta 32/1), so the lowest-frequency pairs barely turn over
  a 32k context. Amplitudes grow with depth: about +-1e2 in the first layer, about +-1e3 with
  outlier tails in the last (SnapMLA paper, Fig. 3a).
- **probe queries** (:func:`probe_queries`, used for any KV without its own queries): see there.

Everything is seeded; the same arguments give the same tensors and metadata (the file's bytes
may still differ: safetensors writes the metadata keys in no fixed order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import SnapmlaError
from ..host_memory import require_host_memory
from ..numerics.formats import D_CONTENT, D_QK, D_ROPE, default_softmax_scale
from ..sizes import counted
from .dump_file import KVDump, LayerDump

# RoPE frequencies (DeepSeek-V3 config.json: rope_theta, rope_scaling).
ROPE_THETA = 10000.0
YARN_FACTOR = 40.0
YARN_ORIGINAL_CONTEXT = 4096
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0

# Content.
NUM_TOPICS = 32
MEAN_SEGMENT = 256  # mean length (tokens) of a topic segment
TOPIC_WEIGHT = 0.6  # share of a token's content direction that comes from its topic
CONTENT_GAIN_MEDIAN = 0.25
CONTENT_GAIN_SIGMA = 0.4  # log-normal sigma of the per-channel gain
OUTLIER_CHANNELS = 6
OUTLIER_CHANNEL_GAIN = 4.0
TOKEN_GAIN_SIGMA = 0.25  # log-normal sigma of the per-token magnitude
SINK_EVERY = 4096  # one delimiter-like sink per this many tokens, plus position 0
SINK_CHANNELS = 4  # sinks carry massive values in these many (shared) channels ...
SINK_VALUE = 8.0  # ... of about this magnitude
SINK_JITTER = 0.1  # relative per-sink, per-channel spread of that magnitude

# RoPE.
ROPE_AMPLITUDE_FIRST = 8.0  # pair-amplitude base of the first layer ...
ROPE_AMPLITUDE_LAST = 80.0  # ... and of the last one (geometric in between)
ROPE_MASSIVE_PAIRS = 3  # low-frequency pairs with an extra-large amplitude ...
ROPE_MASSIVE_GAIN_FIRST = 1.5  # ... this much larger in the first layer ...
ROPE_MASSIVE_GAIN_LAST = 4.0  # ... and this much in the last
ROPE_NOISE = 0.3  # Student-t noise relative to the pair amplitude ...
ROPE_MASSIVE_NOISE = 0.02  # ... and on the massive pairs (consistent: no per-token gain either)
ROPE_NOISE_DF = 4
ROPE_TOKEN_GAIN_SIGMA = 0.1  # log-normal per-token gain of the other pairs
ROPE_PAIR_SIGMA = 0.4  # log-normal spread of a layer's pair amplitudes ...
ROPE_PAIR_RAMP = (0.3, 2.0)  # ... times a + b * frac^2 (frac: 0 at the highest frequency, 1 at the lowest)

# Probe queries.
QUERY_MIX_KEYS = 16  # keys whose content a probe query mixes
ROPE_SHARE = (0.25, 4.0)  # range of a row's std(RoPE logits) / std(content logits)
EFFECTIVE_KEYS = (8.0, 1024.0)  # range of a row's exp(attention entropy)
QUERY_ROPE_WEIGHT_SIGMA = 0.5  # log-normal weight of a probe query's RoPE pairs ...
QUERY_ROPE_NOISE = 0.3  # ... plus this much Gaussian noise (relative to the RoPE part's RMS)


@dataclass(frozen=True)
class SynthSpec:
    """What ``snapmla synth`` makes; the default is the embedded data of ``verify`` and ``quantize``."""

    layers: int = 8
    tokens: int = 32768
    queries: int = 4
    heads: int = 16
    seed: int = 0

    def depth(self, layer: int) -> float:
        """0 for the first layer, 1 for the last."""
        return layer / max(self.layers - 1, 1)


DEFAULT_SPEC = SynthSpec()


# The mix below works modulo 2^62: seeds that differ by a multiple of it give the same tensors, so
# the commands that make synthetic data take seeds below it (larger ones repeated smaller ones' data)
SEED_MODULUS = 2**62
MAX_SYNTH_SEED = SEED_MODULUS - 1


def _generator(*seeds: int) -> torch.Generator:
    """A generator seeded from several integers (seed, layer, purpose), stable across runs."""
    value = 0x5EED
    for s in seeds:
        value = (value * 1_000_003 + int(s)) % SEED_MODULUS
    return torch.Generator().manual_seed(value)


def _lerp_log(first: float, last: float, depth: float) -> float:
    return first * (last / first) ** depth


def rope_frequencies() -> torch.Tensor:
    """float64 ``[32]``: DeepSeek-V3's per-pair frequencies, ``theta^(-2i/64)`` blended towards
    ``/ YARN_FACTOR`` for the low-frequency pairs (YaRN's linear ramp over pair index)."""
    pairs = D_ROPE // 2
    extra = ROPE_THETA ** (-torch.arange(0, D_ROPE, 2, dtype=torch.float64) / D_ROPE)

    def correction_dim(rotations: float) -> float:
        return D_ROPE * math.log(YARN_ORIGINAL_CONTEXT / (rotations * 2 * math.pi)) / (2 * math.log(ROPE_THETA))

    low = max(math.floor(correction_dim(YARN_BETA_FAST)), 0)
    high = min(math.ceil(correction_dim(YARN_BETA_SLOW)), D_ROPE - 1)
    ramp = torch.clamp((torch.arange(pairs, dtype=torch.float64) - low) / max(high - low, 1e-3), 0, 1)
    return extra * (1 - ramp) + (extra / YARN_FACTOR) * ramp


def apply_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., 64]`` at ``positions`` (one per leading row) the DeepSeek way:
    interleaved pairs ``(x[2i], x[2i+1])`` by angle ``pos * f_i``."""
    angle = positions.to(torch.float64)[..., None] * rope_frequencies()
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def sink_positions(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Position 0 plus ``tokens // SINK_EVERY`` positions drawn uniformly over the layer (one per
    ``SINK_EVERY`` tokens on average, not one in each window)."""
    picks = torch.randint(0, max(tokens, 1), (tokens // SINK_EVERY,), generator=gen)
    return torch.unique(torch.cat([torch.zeros(1, dtype=torch.long), picks]))


def synth_content(tokens: int, layer_gen: torch.Generator, gen: torch.Generator) -> torch.Tensor:
    """float32 ``[tokens, 512]`` content (module docstring). ``layer_gen`` draws the layer's
    structure (topics, channel gains, sink channels), ``gen`` the tokens."""
    topics = torch.randn(NUM_TOPICS, D_CONTENT, generator=layer_gen)
    gain = CONTENT_GAIN_MEDIAN * torch.exp(CONTENT_GAIN_SIGMA * torch.randn(D_CONTENT, generator=layer_gen))
    gain[torch.randperm(D_CONTENT, generator=layer_gen)[:OUTLIER_CHANNELS]] *= OUTLIER_CHANNEL_GAIN
    channels = torch.randperm(D_CONTENT, generator=layer_gen)[:SINK_CHANNELS]
    signs = torch.where(torch.rand(SINK_CHANNELS, generator=layer_gen) < 0.5, -1.0, 1.0)
    starts = torch.rand(tokens, generator=gen) < 1.0 / MEAN_SEGMENT
    starts[0] = True
    segment = torch.cumsum(starts.long(), 0) - 1
    topic = torch.randint(0, NUM_TOPICS, (int(segment[-1]) + 1,), generator=gen)[segment]
    z = TOPIC_WEIGHT * topics[topic] + math.sqrt(1 - TOPIC_WEIGHT**2) * torch.randn(tokens, D_CONTENT, generator=gen)
    token_gain = torch.exp(TOKEN_GAIN_SIGMA * torch.randn(tokens, 1, generator=gen))
    content = token_gain * gain * z
    sinks = sink_positions(tokens, gen)
    jitter = 1 + SINK_JITTER * torch.randn(sinks.shape[0], SINK_CHANNELS, generator=gen)
    content[sinks[:, None], channels[None, :]] = SINK_VALUE * signs * jitter
    return content


def synth_rope(positions: torch.Tensor, depth: float, layer_gen: torch.Generator, gen: torch.Generator) -> torch.Tensor:
    """float32 ``[tokens, 64]`` rotated RoPE keys (module docstring). ``layer_gen`` draws the
    layer's pair amplitudes, massive pairs and directions, ``gen`` the tokens."""
    pairs = D_ROPE // 2
    frac = torch.arange(pairs, dtype=torch.float32) / (pairs - 1)  # 0 = highest frequency
    ramp_base, ramp_gain = ROPE_PAIR_RAMP
    amp = torch.exp(ROPE_PAIR_SIGMA * torch.randn(pairs, generator=layer_gen)) * (ramp_base + ramp_gain * frac**2)
    massive = pairs - 1 - torch.randperm(pairs // 3, generator=layer_gen)[:ROPE_MASSIVE_PAIRS]
    amp[massive] *= _lerp_log(ROPE_MASSIVE_GAIN_FIRST, ROPE_MASSIVE_GAIN_LAST, depth)
    amp *= _lerp_log(ROPE_AMPLITUDE_FIRST, ROPE_AMPLITUDE_LAST, depth)
    angle = 2 * math.pi * torch.rand(pairs, generator=layer_gen)
    direction = torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1)  # [pairs, 2]
    n = positions.shape[0]
    normal = torch.randn(n, pairs, 2, generator=gen)
    chi2 = torch.randn(n, pairs, 2, ROPE_NOISE_DF, generator=gen).pow(2).sum(-1)
    student = normal / torch.sqrt(chi2 / ROPE_NOISE_DF)
    token_gain = torch.exp(ROPE_TOKEN_GAIN_SIGMA * torch.randn(n, 1, 1, generator=gen)).repeat(1, pairs, 1)
    token_gain[:, massive] = 1.0
    noise = torch.full((pairs, 1), ROPE_NOISE)
    noise[massive] = ROPE_MASSIVE_NOISE
    pre = amp[None, :, None] * token_gain * (direction[None] + noise * student)
    return apply_rope(pre.reshape(n, D_ROPE), positions)


def synth_layer_kv(tokens: int, depth: float, seed: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[tokens, 576]`` KV and int64 positions ``0 .. tokens-1`` of one layer at ``depth``.
    The layer's structure depends on ``(seed, layer)`` only, not on ``tokens``."""
    if tokens < 1:
        raise SnapmlaError(f"synth: tokens must be at least 1, got {tokens}")
    layer_gen, gen = _generator(seed, layer, 3), _generator(seed, layer, 1)
    positions = torch.arange(tokens, dtype=torch.int64)
    content = synth_content(tokens, layer_gen, gen)
    rope = synth_rope(positions, depth, layer_gen, gen)
    return torch.cat([content, rope], dim=1).to(torch.bfloat16), positions


def probe_queries(
    kv: torch.Tensor,
    n: int,
    heads: int,
    seed: int,
    anchors: list[int] | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """bf16 ``[n, heads, 576]`` absorbed decode queries probing ``kv`` ``[tokens, 576]``.

    Query ``j`` sits at token ``anchors[j]`` (default: the last token). Per row (query, head):
    the content part is the mean of ``QUERY_MIX_KEYS`` random keys' content plus Gaussian noise of
    the same norm; the RoPE part is the anchor key's RoPE (so it is rotated at the query's
    position and shares the keys' massive low-frequency direction) with log-normal per-pair
    weights (sigma 0.5) plus 30 % Gaussian noise. The parts are scaled so that over the keys
    ``std(RoPE logits) / std(content logits)`` is a ratio drawn log-uniformly from ``ROPE_SHARE``
    (semantic to positional heads), then together so that the row's attention over all keys
    has ``exp(entropy)`` drawn log-uniformly from ``EFFECTIVE_KEYS``: neither uniform nor one-hot."""
    tokens = kv.shape[0]
    anchors = [tokens - 1] * n if anchors is None else list(anchors)
    if len(anchors) != n or any(not 0 <= a < tokens for a in anchors):
        raise SnapmlaError(f"probe queries: need {n} anchors within 0..{tokens - 1}, got {anchors}")
    scale = default_softmax_scale() if softmax_scale is None else softmax_scale
    gen = _generator(seed, tokens, n, heads, 2)
    rows = n * heads
    keys = kv.float()
    k_c, k_r = keys[:, :D_CONTENT], keys[:, D_CONTENT:]
    channel_rms = torch.clamp(k_c.pow(2).mean(dim=0).sqrt(), min=1e-30)
    q_c = (k_c[torch.randint(0, tokens, (rows, QUERY_MIX_KEYS), generator=gen)] / channel_rms).mean(dim=1)
    noise = torch.randn(rows, D_CONTENT, generator=gen)
    q_c = q_c + noise * q_c.norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True)
    q_r = k_r[torch.tensor(anchors).repeat_interleave(heads)]
    q_r = q_r * torch.exp(QUERY_ROPE_WEIGHT_SIGMA * torch.randn(rows, D_ROPE // 2, generator=gen)).repeat_interleave(2, dim=1)
    q_r = q_r + QUERY_ROPE_NOISE * q_r.norm(dim=-1, keepdim=True) / math.sqrt(D_ROPE) * torch.randn(rows, D_ROPE, generator=gen)
    logit_c = scale * (q_c.double() @ k_c.double().T)
    logit_r = scale * (q_r.double() @ k_r.double().T)
    share = _log_uniform(ROPE_SHARE, rows, gen)
    if tokens > 1:
        r_gain = share * logit_c.std(dim=1) / torch.clamp(logit_r.std(dim=1), min=1e-30)
    else:  # one key: no spread to match (an unbiased std of one sample is NaN)
        r_gain = torch.zeros_like(share)
    logits = logit_c + r_gain[:, None] * logit_r
    target = torch.clamp(_log_uniform(EFFECTIVE_KEYS, rows, gen), max=max(1.0, tokens / 2))
    temp = _temperature_for(logits.float(), target.float()).double()
    q = torch.cat([q_c * temp[:, None], q_r * (temp * r_gain)[:, None]], dim=1)
    return q.reshape(n, heads, D_QK).to(torch.bfloat16)


def _log_uniform(bounds: tuple[float, float], rows: int, gen: torch.Generator) -> torch.Tensor:
    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    return torch.exp(lo + (hi - lo) * torch.rand(rows, generator=gen, dtype=torch.float64))


def effective_keys(logits: torch.Tensor) -> torch.Tensor:
    """``exp(entropy)`` of ``softmax(logits)`` per row: how many keys the attention spreads over."""
    logp = torch.log_softmax(logits, dim=-1)
    return torch.exp(-(logp.exp() * logp).sum(dim=-1))


def _temperature_for(logits: torch.Tensor, target: torch.Tensor, steps: int = 20) -> torch.Tensor:
    """Per row, the factor ``a`` with ``effective_keys(a * logits) == target`` (bisection on
    ``log a``; the effective key count falls as ``a`` grows)."""
    lo = torch.full_like(target, -10.0)
    hi = torch.full_like(target, 10.0)
    for _ in range(steps):
        mid = (lo + hi) / 2
        too_broad = effective_keys(torch.exp(mid)[:, None] * logits) > target
        lo = torch.where(too_broad, mid, lo)
        hi = torch.where(too_broad, hi, mid)
    return torch.exp((lo + hi) / 2)


# Host bytes of a synthetic dump: each layer's bf16 KV and bf16 probe queries kept; while a layer
# is built, float32 temporaries of its KV (four copies) and the probe queries' float64 logits
# (four [rows, tokens] arrays).
KV_BYTES_PER_TOKEN = D_QK * 2
QUERY_BYTES_PER_ROW = D_QK * 2  # (per layer: 400 layers of 64 x 1024 rows kept 28 GiB unestimated)
BUILD_BYTES_PER_TOKEN = 4 * D_QK * 4
PROBE_BYTES_PER_LOGIT = 4 * 8
# per probe row, while probe_queries builds it: the gathered content of the QUERY_MIX_KEYS keys it
# mixes, twice (float32: the gather and its division by the channel RMS live together, with int64
# indices), and its float64 copies (content and RoPE); a large --queries x --heads at few tokens
# is bound by this, not by the logits (measured: 0.99 GiB for 16,000 rows at 64 tokens, which
# the estimate had at 0.80 without the second copy)
PROBE_BUILD_BYTES_PER_ROW = QUERY_MIX_KEYS * (2 * D_CONTENT * 4 + 8) + 2 * D_QK * 8


def synth_bytes(spec: SynthSpec) -> int:
    """About how much host memory :func:`synth_dump` takes at its peak."""
    rows = spec.queries * spec.heads
    return (spec.layers * (spec.tokens * KV_BYTES_PER_TOKEN + rows * QUERY_BYTES_PER_ROW)
            + spec.tokens * BUILD_BYTES_PER_TOKEN
            + rows * (spec.tokens * PROBE_BYTES_PER_LOGIT + PROBE_BUILD_BYTES_PER_ROW))


def synth_dump(spec: SynthSpec = DEFAULT_SPEC) -> KVDump:
    """The whole synthetic dump: ``spec.layers`` layers, each with ``spec.queries`` probe queries."""
    if spec.layers < 1 or spec.tokens < 1 or spec.queries < 0 or spec.heads < 1:
        raise SnapmlaError(
            f"synth: need layers, tokens, heads >= 1 and queries >= 0; got layers={spec.layers}, "
            f"tokens={spec.tokens}, heads={spec.heads}, queries={spec.queries}"
        )
    require_host_memory(f"synthetic dump of {counted(spec.layers, 'layer')} x {counted(spec.tokens, 'token')}, "
                        f"{counted(spec.queries, 'query', 'queries')} x {counted(spec.heads, 'head')}", synth_bytes(spec))
    layers = []
    for index in range(spec.layers):
        kv, positions = synth_layer_kv(spec.tokens, spec.depth(index), spec.seed, index)
        queries = probe_queries(kv, spec.queries, spec.heads, spec.seed * 7919 + index) if spec.queries else None
        layers.append(LayerDump(index, kv, positions, queries))
    meta = {"synthetic": "1", "seed": str(spec.seed), "rope": "deepseek-v3 (theta 10000, yarn 40)"}
    return KVDump(layers=layers, model="snapmla-synthetic", extra_metadata=meta)


@dataclass(frozen=True)
class LayerStats:
    """Measured statistics of one layer (docs/DATA.md and ``snapmla synth``'s summary)."""

    content_absmax: float
    content_rms: float
    content_p999: float  # 99.9th percentile of |c|
    rope_absmax: float
    rope_rms: float
    rope_p999: float
    token_amax_spread: float  # max / median over tokens of the per-token content amax


def layer_stats(kv: torch.Tensor) -> LayerStats:
    x = kv.float()
    c, r = x[:, :D_CONTENT].abs(), x[:, D_CONTENT:].abs()
    token_amax = c.amax(dim=1)
    return LayerStats(
        content_absmax=float(c.max()),
        content_rms=float(c.pow(2).mean().sqrt()),
        content_p999=_quantile(c, 0.999),
        rope_absmax=float(r.max()),
        rope_rms=float(r.pow(2).mean().sqrt()),
        rope_p999=_quantile(r, 0.999),
        token_amax_spread=float(token_amax.max() / token_amax.median().clamp(min=1e-30)),
    )


def _quantile(x: torch.Tensor, q: float, sample: int = 1 << 20) -> float:
    """Quantile of ``x`` (on a fixed random sample of at most ``sample`` values)."""
    flat = x.reshape(-1)
    if flat.numel() > sample:
        flat = flat[torch.randint(0, flat.numel(), (sample,), generator=torch.Generator().manual_seed(0))]
    k = max(1, min(flat.numel(), math.ceil(q * flat.numel())))
    return float(flat.kthvalue(k).values)
