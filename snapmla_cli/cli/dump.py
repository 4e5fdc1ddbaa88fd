"""``snapmla dump``: capture real MLA KV caches from a Hugging Face model into a KV dump."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from ..cache.atomic import check_outputs
from ..cache.dump_file import check_input_file
from ..capture import Capture, DumpOptions, dump_model, parse_layers
from ..errors import SnapmlaError
from ..sizes import counted
from ..tables import figure_table
from .common import input_option, one_line, output_option


def dump_command(
    model: Annotated[
        str,
        typer.Option(
            "--model", help="Local checkpoint folder, or a hub id already in the local HF cache."
        ),
    ],
    prompts: Annotated[
        Path,
        input_option(
            "--prompts", help="Prompt file: one prompt per line, or .jsonl with 'prompt'/'text'."
        ),
    ],
    output: Annotated[Path, output_option("--output", "-o", help="KV dump to write (safetensors).")],
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Cut each prompt to its first N tokens.")
    ] = 2048,
    layers: Annotated[
        str, typer.Option("--layers", help="Layer indices to dump, e.g. 0,5,10, or 'all'.")
    ] = "all",
    decode: Annotated[
        int, typer.Option("--decode", help="Greedy tokens generated per prompt (cached too).")
    ] = 0,
    queries: Annotated[
        int,
        typer.Option(
            "--queries",
            help="Absorbed probe queries to store: the last N tokens of the last prompt.",
        ),
    ] = 4,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    dtype: Annotated[
        str, typer.Option("--dtype", help="Model and dump dtype: bf16, fp16 or fp32.")
    ] = "bf16",
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Recompute each layer's attention from the dump and compare with the model's.",
        ),
    ] = False,
    trust_remote_code: Annotated[
        bool,
        typer.Option(
            "--trust-remote-code",
            help="Run code shipped with the checkpoint where transformers has none (e.g. "
            "Kimi-K2's tokenizer). Off: snapmla runs only transformers' own classes, never asks.",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite an existing output file.")
    ] = False,
) -> None:
    """Capture real MLA KV caches from a local Hugging Face model into a KV dump.

    Per layer the dump holds the normalised c_kv and the RoPE-rotated k_pe of a
    DeepSeek-V2/V3-style model (Kimi-K2, LongCat-Flash too), which is loaded from local files
    only. Needs the ``dump`` extra (transformers): pip install -e ".[dump]"."""
    out = Console()
    err = Console(stderr=True)
    try:
        check_input_file(prompts, "--prompts")
        _check_output(output, force, model, prompts)
        options = DumpOptions(
            model=model,
            prompts=prompts,
            max_tokens=max_tokens,
            layers=parse_layers(layers),
            decode=decode,
            queries=queries,
            device=device,
            dtype=dtype,
            check=check,
            trust_remote_code=trust_remote_code,
        )
        capture = _run(options, output, force, err)
    except SnapmlaError as exc:
        message = _as_option(one_line(exc), model)
        err.print(f"error: {escape(message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    _render(capture, output, out)
    failed = [c.layer for c in capture.checks if not c.ok]
    if failed:
        err.print(f"error: check failed for layers {', '.join(map(str, failed))}", highlight=False)
        raise typer.Exit(1)


def _as_option(message: str, model: str) -> str:
    """The capture library names its ``model`` argument as "model X: ..."; on the command line that
    argument is ``--model``, so the error names the option the user typed."""
    return f"--{message}" if message.startswith(f"model {model}") else message


def _check_output(output: Path, force: bool, model: str, prompts: Path) -> None:
    """Refuse a bad ``--output`` before loading the model (minutes), including one that would
    replace the prompt file or a file of a local checkpoint folder. An empty ``--model`` is no
    folder (``Path('')`` is the current one), and is refused with the other options."""
    local_model = Path(model) if model and Path(model).exists() else None  # else a hub id
    check_outputs([("--output", output)], force, inputs=[("--prompts", prompts), ("--model", local_model)])


def _run(options: DumpOptions, output: Path, force: bool, console: Console) -> Capture:
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rows]} rows"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("loading model", total=None, rows=0)

        def report(done: int, total: int, rows: int) -> None:
            bar.update(task, description="prompts", total=total, completed=done, rows=rows)

        return dump_model(options, output, force=force, progress=report)


def _render(capture: Capture, output: Path, console: Console) -> None:
    dump = capture.dump
    first = dump.layers[0]
    meta = dump.extra_metadata
    console.print(
        f"wrote {escape(str(output))}: {counted(len(dump.layers), 'layer')} x {counted(first.kv.shape[0], 'token')} "
        f"({len(capture.segments)} prompts), {meta.get('dtype')}, model {escape(dump.model)}",
        highlight=False,
    )
    if first.queries is not None:  # (--queries 0 captures none: no scale to report)
        console.print(
            f"queries pre-scaled by {float(meta.get('query_prescale', 'nan')):.6g} "
            f"(model scale {float(meta.get('model_softmax_scale', 'nan')):.6g} / 576**-0.5)",
            highlight=False,
        )
    if not capture.checks:
        return
    table = figure_table("attention recomputed from the dump vs the model",
                         ("layer", "queries", "tokens", "rel_l2", "max_abs", "gate", "result"))
    for c in capture.checks:
        verdict = "[green]ok[/green]" if c.ok else "[red]FAIL[/red]"
        table.add_row(
            str(c.layer),
            str(c.queries),
            str(c.tokens),
            f"{c.rel_l2:.2e}",
            f"{c.max_abs:.2e}",
            f"{c.tolerance:.2g}",  # (bf16's 1.5e-2: ".0e" printed it as 1e-02)
            verdict,
        )
    console.print(table)
