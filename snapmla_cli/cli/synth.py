"""``snapmla synth``: write a realistic synthetic KV dump (docs/DATA.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..cache.atomic import check_writable, naming
from ..cache.dump_file import write_dump
from ..cache.synth import DEFAULT_SPEC, MAX_SYNTH_SEED, SynthSpec, layer_stats, synth_dump
from ..sizes import MAX_QUERY_HEADS, counted, format_size, parse_size
from ..tables import figure_table
from .common import console, output_option, require_at_least, require_at_most, seed_option


def synth_command(
    output: Annotated[Path, output_option("--output", "-o", help="KV dump to write (safetensors).")],
    layers: Annotated[int, typer.Option(help="Layers; depth 0..1 spreads over them.")] = DEFAULT_SPEC.layers,
    tokens: Annotated[str, typer.Option(help="Tokens per layer, e.g. 4096, 32k, 1m.")] = format_size(DEFAULT_SPEC.tokens),
    queries: Annotated[int, typer.Option(help="Probe queries per layer (0: none).")] = DEFAULT_SPEC.queries,
    heads: Annotated[int, typer.Option(help="Heads of each probe query.")] = DEFAULT_SPEC.heads,
    seed: Annotated[int, seed_option(help="Random seed; same seed, same tensors and metadata.", maximum=MAX_SYNTH_SEED)] = DEFAULT_SPEC.seed,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUTPUT if it exists.")] = False,
) -> None:
    """Write a realistic synthetic MLA KV dump (docs/DATA.md).

    Content within about +-10 with per-token magnitudes and sink tokens, DeepSeek-rotated RoPE
    whose range grows with depth to about +-1e3, and probe queries per layer."""
    require_at_least("--layers", layers)
    require_at_least("--heads", heads)
    require_at_most("--heads", heads, MAX_QUERY_HEADS)  # as verify's and bench's --heads
    require_at_least("--queries", queries, 0)
    check_writable(output, force, "--output")
    spec = SynthSpec(layers=layers, tokens=parse_size(tokens, "--tokens"), queries=queries,
                     heads=heads, seed=seed)
    dump = synth_dump(spec)
    with naming("--output"):
        write_dump(dump, output, force=force)
    table = figure_table(f"synthetic KV dump, seed {seed}",
                         ("layer", "tokens", "|content| max", "content rms", "|RoPE| p99.9", "|RoPE| max", "queries"))
    for layer in dump.layers:
        st = layer_stats(layer.kv)
        shape = "-" if layer.queries is None else "x".join(str(d) for d in layer.queries.shape)
        table.add_row(str(layer.index), str(layer.kv.shape[0]), f"{st.content_absmax:.3g}",
                      f"{st.content_rms:.3g}", f"{st.rope_p999:.4g}", f"{st.rope_absmax:.4g}", shape)
    out = console()
    out.print(table)
    size_mb = output.stat().st_size / 2**20
    out.print(f"wrote {output} ({counted(spec.layers, 'layer')} x {counted(spec.tokens, 'token')}, bf16, {size_mb:.1f} MiB)")
