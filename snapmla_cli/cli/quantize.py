"""``snapmla quantize``: write the SnapMLA FP8 cache of a KV dump and report the layer-wise
fidelity of every quantization configuration (paper Appendix G)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from ..analysis.fidelity import (
    PROBE_HEADS,
    PROBE_QUERIES,
    FidelityReport,
    LayerFidelity,
    analyze_layer,
    check_query_count,
    layer_queries,
)
from ..analysis.verify import resolve_device
from ..cache.atomic import check_outputs, committed_together, naming
from ..cache.dump_file import KVDump, LayerDump, read_dump
from ..cache.fp8_file import FP8CacheFile, FP8CacheLayer, quantize_layer_cache, write_fp8_cache
from ..cache.synth import (
    DEFAULT_SPEC,
    MAX_SYNTH_SEED,
    PROBE_BUILD_BYTES_PER_ROW,
    SynthSpec,
    synth_dump,
)
from ..errors import SnapmlaError
from ..host_memory import require_host_memory
from ..numerics.configs import CONFIGS, get_configs
from ..numerics.formats import D_QK
from ..report_header import report_header
from ..sizes import counted, parse_size, split_list
from ..tables import figure_table
from .common import (
    STDOUT,
    Device,
    console,
    file_path,
    fmt,
    input_argument,
    is_stdout,
    output_option,
    progress,
    report_console,
    require_at_least,
    seed_option,
    write_json,
    wrote_lines,
)


def quantize_command(
    *,  # keyword-only (as typer calls it), so that the required --output needs no placeholder default
    dump: Annotated[Path | None, input_argument("DUMP", help="KV dump (safetensors); omitted: the synthetic default.")] = None,
    output: Annotated[Path, output_option("--output", "-o", help="FP8 cache file to write.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUTPUT, --json, --plot files.")] = False,
    json_path: Annotated[Path | None, output_option("--json", help="Write the fidelity report as JSON.")] = None,
    plot: Annotated[Path | None, output_option("--plot", help="Write the Fig.-5-style plot of the attention output per layer (.png/.pdf/.svg; needs the plot extra, matplotlib).")] = None,
    queries: Annotated[int | None, typer.Option(help="Probe queries per layer (default: the dump's, else 4 synthetic).")] = None,
    configs: Annotated[str, typer.Option(help="Configurations to compare, comma-separated.")] = ",".join(CONFIGS),
    device: Annotated[Device, typer.Option(help="Where to quantize and analyse.")] = Device.auto,
    layers: Annotated[int | None, typer.Option(help="Synthetic default only: layers (8).")] = None,
    tokens: Annotated[str | None, typer.Option(help="Synthetic default only: tokens per layer (32k).")] = None,
    seed: Annotated[int, seed_option(help="Seed of the synthetic default and of synthetic probes.", maximum=MAX_SYNTH_SEED)] = 0,
) -> None:
    """Write the FP8 cache of a KV dump and compare quantization configs layer by layer.

    Every layer goes into the SnapMLA 656-byte FP8 cache file (SPEC section 8); the attention
    output and KV error of configurations snap, A, B, C, D, G are measured per layer against
    float64 attention on the original cache (paper Appendix G)."""
    check_outputs((("--output", output), ("--json", file_path(json_path)), ("--plot", plot)), force,
                  inputs=(("DUMP", dump),))
    if plot is not None:
        from ..plot_files import check_plot_output

        check_plot_output(plot)
    chosen = get_configs([c.strip() for c in split_list(configs, "--configs", "snap,A")], "--configs")
    require_at_least("--layers", layers)
    require_at_least("--queries", queries)
    dev = resolve_device(device.value)
    source = _load(dump, layers, tokens, seed, queries)
    check_query_count(source.layers, queries)
    _check_host_memory(source, queries)
    out, err = report_console(json_path), console(stderr=True)
    report = FidelityReport([c.id for c in chosen], [])
    pages = []
    with progress(err) as bar:
        task = bar.add_task("quantize + analyse", total=len(source.layers))
        for layer in source.layers:
            pages.append(FP8CacheLayer(layer.index, quantize_layer_cache(layer.kv, dev), layer.kv.shape[0]))
            probes, kind = layer_queries(layer, queries, seed)
            if dump is None:  # the synthetic default's queries are made by probe_queries too
                kind = "synthetic"
            report.layers.append(analyze_layer(layer, chosen, probes, kind, dev))
            bar.advance(task)
    meta = {"source": str(dump) if dump is not None else "synthetic default"}
    payload = {**report_header(QUANTIZE_JSON_FORMAT),
               "source": meta["source"], "model": source.model, **report.as_dict()}
    with committed_together():  # all of the outputs, or none of them
        with naming("--output"):
            write_fp8_cache(FP8CacheFile(pages, source.model, meta), output, force=force)
        if json_path is not None and not is_stdout(json_path):
            with naming("--json"):
                write_json(json_path, payload, force=force)
        if plot is not None:
            from ..analysis.plot import plot_fidelity

            with naming("--plot"):
                plot_fidelity(report, plot, title=f"layer-wise fidelity: {meta['source']}", force=force)
    if is_stdout(json_path):  # after the files landed: no JSON for outputs that failed
        write_json(STDOUT, payload)
    _render(out, report)
    out.print(f"wrote {output} ({counted(len(pages), 'layer')}, {output.stat().st_size / 2**20:.1f} MiB)")
    for line in wrote_lines(json_path, plot):
        out.print(line)


# Host bytes of analysing one layer (the layers are done one at a time): per synthetic probe row,
# what building it takes (cache.synth); per (query row, token), the float64 logits and
# probabilities of the float64 attention (four arrays, as in synth and verify); per token, the
# fake-quantized float32 copy and the float64 keys of the reference attention.
QUANTIZE_JSON_FORMAT = "snapmla-quantize"
BYTES_PER_LOGIT = 4 * 8
ANALYSIS_BYTES_PER_TOKEN = D_QK * (4 + 2 * 8)


def _probe_rows(layer: LayerDump, queries: int | None) -> tuple[int, bool]:
    """(query rows ``layer`` is probed with, whether they are synthetic, i.e. built here), as
    ``analysis.fidelity.layer_queries`` picks them (which refuses more than the dump holds)."""
    if layer.queries is not None:
        n, heads = layer.queries.shape[:2]
        return min(n, queries or n) * heads, False
    return (queries or PROBE_QUERIES) * PROBE_HEADS, True


def _layer_bytes(layer: LayerDump, queries: int | None) -> int:
    """About how much host memory analysing ``layer`` takes (the estimate behind the check)."""
    rows, synthetic = _probe_rows(layer, queries)
    tokens = layer.kv.shape[0]
    build = rows * PROBE_BUILD_BYTES_PER_ROW if synthetic else 0
    return build + rows * tokens * BYTES_PER_LOGIT + tokens * ANALYSIS_BYTES_PER_TOKEN


def _check_host_memory(source: KVDump, queries: int | None) -> None:
    """Refuse, before the first layer is quantized, probes that the host cannot hold: a
    ``--queries`` with a few zeros too many would otherwise end in an allocation error or
    minutes of swapping. The message names the option and the largest layer's sizes."""
    layer = max(source.layers, key=lambda entry: _layer_bytes(entry, queries))
    rows, _ = _probe_rows(layer, queries)
    label = f"--queries {queries}" if queries is not None else "the probe queries"
    require_host_memory(f"{label} ({rows} query rows x {layer.kv.shape[0]} tokens of layer {layer.index})",
                        _layer_bytes(layer, queries))


def _load(dump: Path | None, layers: int | None, tokens: str | None, seed: int, queries: int | None) -> KVDump:
    """The dump given, or the synthetic default made with ``--queries`` probe queries per layer
    (so that asking the default for more than its own 4 is not an error about "the dump")."""
    if dump is not None:
        if layers is not None or tokens is not None:
            raise SnapmlaError("--layers/--tokens apply only to the synthetic default (no DUMP given)")
        return read_dump(dump, "DUMP")
    spec = SynthSpec(
        layers=DEFAULT_SPEC.layers if layers is None else layers,
        tokens=DEFAULT_SPEC.tokens if tokens is None else parse_size(tokens, "--tokens"),
        queries=DEFAULT_SPEC.queries if queries is None else queries,
        seed=seed,
    )
    return synth_dump(spec)



def _probe_summary(rows: list[LayerFidelity]) -> str:
    """The probes the means are over: "32 probe rows/layer, dump queries", or, where layers
    differ (a dump with queries in some layers only), each kind once: the title once named
    layer 0's alone."""
    kinds = list(dict.fromkeys(f"{r.query_rows} probe rows/layer, {r.probes} queries" for r in rows))
    return kinds[0] if len(kinds) == 1 else "layers differ: " + "; ".join(kinds)

def _render(out: Console, report: FidelityReport) -> None:
    rows = report.layers
    per_layer = figure_table("attention output rel L2 vs float64 on the original cache, per layer",
                             ("layer", "tokens", *report.configs))
    for layer in rows:
        per_layer.add_row(str(layer.layer), str(layer.tokens),
                          *(fmt(layer.metrics["output"][c].rel_l2) for c in report.configs))
    out.print(per_layer)
    mean = figure_table(f"mean over {counted(len(rows), 'layer')} ({_probe_summary(rows)})",
        ("config", "out rmse", "out cos_diff", "out rel_l2", "kv rel_l2", "content rel_l2", "RoPE rel_l2"))
    best = min(report.configs, key=lambda c: report.mean("output", c, "rel_l2"))
    for config in report.configs:
        cells = [report.mean("output", config, m) for m in ("rmse", "cos_diff", "rel_l2")]
        cells += [report.mean(part, config, "rel_l2") for part in ("kv", "kv_content", "kv_rope")]
        name = Text(config, style="bold green" if config == best else "")
        mean.add_row(name, *(fmt(v) for v in cells))
    out.print(mean)
