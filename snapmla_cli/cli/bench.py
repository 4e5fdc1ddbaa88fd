"""``snapmla bench``: decode throughput of an MLA model's attention stack, FP8 (SnapMLA) against
BF16, on one GPU or many (DP/TP ranks through torch.distributed), like the paper's Figure 1.

Parses and checks every argument, then hands the plan to ``bench.launch`` (which spawns the ranks
or joins torchrun's), renders rank 0's report, and writes ``--json`` / ``--plot``. Errors are
one line on stderr and exit code 2, also when this command is mounted on an app of its own.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from ..bench.launch import RunnerSpec, preflight, run_benchmark, torchrun_env
from ..bench.plan import (
    DEFAULT_CONTEXTS,
    LAYOUT_PRESETS,
    PRESETS,
    BenchPlan,
    Layout,
    make_plan,
    parse_bytes,
    parse_layouts,
)
from ..bench.timing import CLOCKS, STEADY
from ..cache.atomic import check_outputs, committed_together, naming
from ..errors import SnapmlaError
from ..sizes import MAX_BATCH, MAX_QUERY_TOKENS, parse_size_list
from .common import (
    file_path,
    one_line,
    output_option,
    report_console,
    require_at_least,
    seed_option,
    write_json_file,
    write_json_stdout,
    wrote_lines,
)

# --model: the names of bench.plan's presets (one table, so the option cannot drift)
Model = Enum("Model", {name: name for name in PRESETS}, type=str)  # type: ignore[misc]  # members from a table
MODEL_HELP = "Model preset: " + ", ".join(
    f"{name} ({preset.heads} heads, {preset.layers} MLA layers)" for name, preset in PRESETS.items()) + "."
DEFAULT_MODEL = Model("deepseek-v3")


class Bf16Impl(str, Enum):
    auto = "auto"
    snapmla = "snapmla"
    flashmla = "flashmla"


# --clocks: the names of bench.timing's clock states (one list, so the option cannot drift)
ClockState = Enum("ClockState", {name: name for name in CLOCKS}, type=str)  # type: ignore[misc]  # members from a table
DEFAULT_CLOCKS = ClockState(STEADY.name)


def print_progress(message: str) -> None:
    """Rank 0's progress, one line per timed case, on stderr (picklable: sent to spawned ranks)."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


def build_plan(
    model: str, heads: int | None, layers: int | None, mtp: int, ctx: str, batch: int | None,
    kv_mem: str | None, dp: int | None, tp: int | None, layout: str | None, seed: int,
) -> BenchPlan:
    """The checked plan from the command line's strings (raises a one-line SnapmlaError)."""
    if layout is not None and (dp is not None or tp is not None):
        raise SnapmlaError("--layout and --dp/--tp both given: use one or the other")
    if layout is not None:
        layouts = parse_layouts(layout)
    else:
        require_at_least("--dp", dp)
        require_at_least("--tp", tp)
        layouts = (Layout(dp or 1, tp or 1),)
    return make_plan(
        model=model, heads=heads, layers=layers, mtp=mtp,
        contexts=parse_size_list(ctx, "--ctx"), layouts=layouts, batch=batch,
        kv_mem=None if kv_mem is None else parse_bytes(kv_mem, "--kv-mem"), seed=seed,
        from_layout_option=layout is not None,
    )


def bench_command(
    model: Annotated[Model, typer.Option(help=MODEL_HELP)] = DEFAULT_MODEL,
    heads: Annotated[int | None, typer.Option(help="Query heads of the model (overrides the preset); split over --tp.")] = None,
    layers: Annotated[int | None, typer.Option(help="Attention calls per decoded token (overrides the preset).")] = None,
    mtp: Annotated[int, typer.Option(help=f"Query tokens per request and step, s_q (MTP: 2), 1..{MAX_QUERY_TOKENS}.")] = 1,
    ctx: Annotated[str, typer.Option(help="Context lengths, comma-separated: 16k,32k,64k,128k.")] = DEFAULT_CONTEXTS,
    batch: Annotated[int | None, typer.Option(help=f"Requests per DP group for both formats, at most {MAX_BATCH} (default: what --kv-mem holds in BF16).")] = None,
    kv_mem: Annotated[str | None, typer.Option(help="KV-cache budget per GPU for all layers, e.g. 60GiB (default 60GiB without --batch); sizes the equal-memory batches.")] = None,
    dp: Annotated[int | None, typer.Option(help="Data-parallel groups (independent batches) [default: 1].")] = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel ranks per group (heads / tp per rank) [default: 1].")] = None,
    layout: Annotated[str | None, typer.Option(help=f"Layouts instead of --dp/--tp, comma-separated, same GPU count: {', '.join(LAYOUT_PRESETS)} or any dpNtpM.")] = None,
    steps: Annotated[int, typer.Option(help="Timed steps per case (median of 5 rounds); a round of short steps gets at least 1 ms of them.")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed steps before timing.")] = 3,
    graphs: Annotated[bool, typer.Option("--graphs/--no-graphs", help="Time CUDA-graph replays of one step (eager when capture fails).")] = True,
    bf16_impl: Annotated[Bf16Impl, typer.Option(help="BF16 baseline: FlashMLA if importable (auto), or forced.")] = Bf16Impl.auto,
    roofline: Annotated[bool, typer.Option("--roofline/--no-roofline", help="Measure GEMM/copy ceilings for the roofline column.")] = True,
    clocks: Annotated[ClockState, typer.Option(help="GPU clock state of the timings and ceilings: steady (after 0.2 s of work, power-capped: what a busy server gets) or burst (the boost clock: 1 s idle first, then as few steps as the median needs; a step too long to share one 25 ms window idles before each of the 5 rounds).")] = DEFAULT_CLOCKS,
    seed: Annotated[int, seed_option(help="Seed of the random caches, queries and page layout.")] = 0,
    json_path: Annotated[Path | None, output_option("--json", help="Write the report as JSON (atomic).")] = None,
    plot: Annotated[Path | None, output_option("--plot", help="Write a Figure-1-style bar chart (.png/.pdf/.svg; needs the plot extra, matplotlib).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the --json / --plot files.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--quiet", help="One line per timed case on stderr.")] = True,
    cpu_fake: Annotated[bool, typer.Option("--cpu-fake", hidden=True, help="CI: run the orchestration on the CPU with a tiny fake workload.")] = False,
) -> None:
    """Decode throughput, FP8 (SnapMLA) vs BF16, per parallel layout and context.

    Times one decode step of the model's attention stack (per layer: Q-quant, K-append of the new
    token, decode) on every rank, at the same batch for both formats and, where a KV budget sizes
    the batches (not both at the 4096 cap), at the same KV memory (FP8 holds 1.76x more tokens).
    --dp/--tp ranks are spawned one per GPU, or started by torchrun (multi-node); rank 0 prints
    the tables."""
    try:
        if model.value not in PRESETS:
            raise SnapmlaError(f"--model: {model.value!r} is not one of {', '.join(PRESETS)}")
        plan = build_plan(model.value, heads, layers, mtp, ctx, batch, kv_mem, dp, tp, layout, seed)
        spec = RunnerSpec(kind="cpu-fake" if cpu_fake else "gpu", steps=steps, warmup=warmup, graphs=graphs,
                          bf16_impl=bf16_impl.value, roofline=roofline, clocks=clocks.value)
        _bench(plan, spec, json_path, plot, force, progress)
    except BrokenPipeError:  # the reader of the tables left: the app ends quietly
        raise
    except (SnapmlaError, OSError) as exc:
        typer.echo(f"error: {one_line(exc)}", err=True)
        raise typer.Exit(2) from None


def _bench(plan: BenchPlan, spec: RunnerSpec, json_path: Path | None, plot: Path | None, force: bool,
           progress: bool) -> None:
    """Run the plan on every rank; rank 0 prints the tables and writes the files."""
    check_outputs((("--json", file_path(json_path)), ("--plot", plot)), force)
    if plot is not None:
        from ..plot_files import check_plot_output

        check_plot_output(plot)
    from ..bench.render import describe_plan, plot_report, render_report

    env = torchrun_env()
    preflight(plan, spec, env)  # no GPU, too few GPUs, torchrun's world size: fail before output
    if progress and (env is None or env.rank == 0):
        print_progress(describe_plan(plan))
    report = run_benchmark(plan, spec, progress=print_progress if progress else None)
    if report is None:  # a torchrun rank other than 0: rank 0 prints
        return
    report.meta["argv"] = ["snapmla", *sys.argv[1:]]
    # the files before the tables, as quantize: a reader of stdout that leaves early (| head)
    # ends the command at its next print, which must not cost the files of a long run
    with committed_together():  # both files, or neither
        write_json_file(json_path, report.to_dict, force)
        if plot is not None:
            with naming("--plot"):
                plot_report(report, plot, force=force)
    out = report_console(json_path)
    render_report(out, report)
    write_json_stdout(json_path, report.to_dict)  # after the plot landed: none for failed outputs
    for line in wrote_lines(json_path, plot):
        out.print(line)
