"""How a :class:`BenchReport` looks: two rich tables (throughput per layout and context; per-rank
kernel figures) and a bar chart in the style of the SnapMLA paper's Figure 1 (grouped bars per
context, BF16 vs FP8, one panel per parallel layout). Nothing here runs or measures anything."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..cache.atomic import write_atomic
from ..plot_files import check_plot_output
from ..sizes import counted, format_size
from ..tables import figure_table
from .plan import PRESETS, BenchPlan, format_bytes
from .results import BenchReport, CaseResult, format_spread, speedup
from .timing import STEADY


def _tps(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def describe_plan(plan: BenchPlan) -> str:
    """One line: model, stack, layouts, contexts and how the batch is chosen."""
    preset = PRESETS[plan.model]
    model = plan.model if (plan.heads, plan.layers) == (preset.heads, preset.layers) else f"{plan.model} (custom)"
    batch = f"batch {plan.batch}" if plan.batch is not None else "batch from the KV budget"
    budget = f", KV budget {format_bytes(plan.kv_mem)}/GPU" if plan.kv_mem is not None else ""
    return (f"{model}: {counted(plan.heads, 'head')} x {counted(plan.layers, 'MLA layer')}, s_q {plan.s_q}; "
            f"{', '.join(layout.name for layout in plan.layouts)} on {counted(plan.world, 'rank')}; ctx {','.join(format_size(c) for c in plan.contexts)}; "
            f"{batch}{budget}")


def plot_title(report: BenchReport) -> str:
    plan = report.plan
    budget = f", KV budget {format_bytes(plan.kv_mem)}/GPU" if plan.kv_mem is not None else ""
    batch = f", batch {plan.batch}/DP" if plan.batch is not None else ""
    return (f"{plan.model}: {counted(plan.heads, 'head')} x {counted(plan.layers, 'MLA layer')}, s_q {plan.s_q}{batch}{budget}"
            f"\n{_devices(report)}")


def _devices(report: BenchReport) -> str:
    names = [r.get("device", "?") for r in report.meta.get("ranks", [])]
    if not names:
        return "?"
    unique = list(dict.fromkeys(names))
    return ", ".join(f"{name} x{names.count(name)}" for name in unique)


def throughput_table(report: BenchReport) -> Table:
    plan = report.plan
    table = figure_table(
        f"snapmla bench: decode tokens/s of the attention stack, all GPUs ({describe_plan(plan)}; "
        f"{_devices(report)})",
        ("layout", "ctx", "heads/rank", "batch/DP", "BF16 tok/s", "FP8 tok/s", "x same batch",
         "batch FP8/BF16 same mem", "FP8 tok/s same mem", "x same mem", "FP8 tok/s/GPU same mem"),
        title_justify="left")
    for c in report.comparisons:
        mem = c.equal_memory
        table.add_row(
            c.layout.label, format_size(c.context), str(c.fp8.heads), str(c.fp8.batch),
            _tps(c.bf16.aggregate_tokens_per_s), _tps(c.fp8.aggregate_tokens_per_s),
            _x(c.speedup_equal_batch),
            "-" if mem is None else f"{mem[0].batch}/{mem[1].batch}",
            "-" if mem is None else _tps(mem[0].aggregate_tokens_per_s),
            _x(c.speedup_equal_memory),
            "-" if mem is None else _tps(mem[0].per_gpu_tokens_per_s),
        )
    return table


def _cases(report: BenchReport) -> list[CaseResult]:
    seen: dict[tuple, CaseResult] = {}
    for c in report.comparisons:
        for case in (c.bf16, c.fp8, c.bf16_mem, c.fp8_mem):
            if case is not None:
                seen.setdefault((case.layout, case.context, case.impl, case.batch), case)
    return list(seen.values())


def kernel_table(report: BenchReport) -> Table:
    clocks = report.meta.get("runner", {}).get("clocks", STEADY.name)
    table = figure_table(
        "per rank (mean over ranks): one step = every layer's Q-quant/append + decode; TFLOPS and "
        f"GB/s per SPEC section 7 over the whole step; {clocks} clocks; x BF16 roofline: the BF16 "
        "roofline's time for the step's decode work over the FP8 step's (no BF16 kernel can beat it); "
        "spread: the timed rounds' slowest over fastest, minus 1 (the largest over the ranks)",
        ("layout", "ctx", "format", "kernel", "batch/DP", "heads/rank", "ms/step", "us/layer",
         "TFLOPS/GPU", "GB/s/GPU", "roofline %", "x BF16 roofline", "spread", "timed"),
        left=("format", "kernel", "timed"), title_justify="left")
    for case in _cases(report):
        world = case.layout.world
        table.add_row(
            case.layout.label, format_size(case.context), case.impl.upper(), case.kernel,
            str(case.batch), str(case.heads), f"{case.step_s * 1e3:.2f}", f"{case.us_per_layer:.1f}",
            f"{case.tflops / world:.1f}", f"{case.gbs / world:.0f}",
            "-" if case.roof_pct is None else f"{case.roof_pct:.1f}",
            _x(case.vs_bf16_roofline),
            format_spread(case.spread),
            "CUDA graph" if case.graphed else "eager",
        )
    return table


def render_report(out: Console, report: BenchReport) -> None:
    out.print(throughput_table(report))
    out.print(kernel_table(report))
    plan = report.plan
    out.print(
        f"tokens/s: requests x s_q ({plan.s_q}) per step of {plan.layers} attention calls, summed "
        "over DP groups (the ranks of a TP group decode the same requests, at the pace of the "
        "slowest); attention only: no MoE/MLP, no TP all-reduce. 'same mem': each format at the "
        "batch the KV budget holds (656 vs 1152 bytes per token per layer)."
    )
    for note in report.notes:
        out.print(f"note: {note}")


def plot_report(report: BenchReport, path: Path, force: bool = False) -> None:
    """Grouped bars per context (BF16, FP8 at the same batch, FP8 at the same KV memory),
    one panel per layout, FP8/BF16 speed-ups written over the FP8 bars. Written atomically; a
    file at ``path`` is replaced only with ``force``, also one that appeared during the run."""
    plt = check_plot_output(path)
    comparisons = report.comparisons
    layouts = list(dict.fromkeys(c.layout for c in comparisons))
    fig, axes = plt.subplots(1, len(layouts), figsize=(4.8 * len(layouts), 4.2), squeeze=False,
                             constrained_layout=True)
    colors = {"bf16": "#8c8c8c", "bf16_mem": "#8c8c8c", "fp8": "#1f77b4", "fp8_mem": "#ff7f0e"}
    for ax, layout in zip(axes[0], layouts):
        rows = [c for c in comparisons if c.layout == layout]
        # same-memory bars where a context has them (none without a budget, none where both
        # formats reach the batch cap): a gap in the group elsewhere
        mem = [c.equal_memory for c in rows]
        series: list[tuple[str, str, list[float | None], list[float | None] | None]] = [
            (f"BF16 ({rows[0].bf16.kernel}), same batch", "bf16",
             [c.bf16.aggregate_tokens_per_s for c in rows], None),
            ("FP8 SnapMLA, same batch", "fp8", [c.fp8.aggregate_tokens_per_s for c in rows],
             [c.speedup_equal_batch for c in rows])]
        if any(pair is not None and pair[1].batch != c.bf16.batch for c, pair in zip(rows, mem)):
            series.append(("BF16, same KV memory", "bf16_mem",
                           [None if pair is None else pair[1].aggregate_tokens_per_s for pair in mem], None))
        if any(pair is not None for pair in mem):
            series.append(("FP8 SnapMLA, same KV memory", "fp8_mem",
                           [None if pair is None else pair[0].aggregate_tokens_per_s for pair in mem],
                           [None if pair is None else speedup(*pair) for pair in mem]))
        width = 0.8 / len(series)
        for i, (label, key, values, speedups) in enumerate(series):
            drawn = [j for j, v in enumerate(values) if v is not None]
            xs = [j + (i - (len(series) - 1) / 2) * width for j in drawn]
            bars = ax.bar(xs, [values[j] for j in drawn], width, label=label, color=colors[key],
                          hatch="//" if key.endswith("_mem") else None, edgecolor="white")
            if speedups is not None:
                for bar, s in zip(bars, [speedups[j] for j in drawn]):
                    ax.annotate(f"{s:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                                textcoords="offset points")
        ax.set_xticks(range(len(rows)), [format_size(c.context) for c in rows])
        ax.set_xlabel("context length")
        ax.set_title(f"{layout.label}: {rows[0].fp8.heads} heads/rank")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0][0].set_ylabel("decode tokens/s, attention stack, all GPUs")
    handles, labels = axes[0][0].get_legend_handles_labels()
    # at most two entries a row per panel: four in one row are wider than one panel's figure
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4, 2 * len(layouts)),
               fontsize=7)
    fig.suptitle(plot_title(report), fontsize=9)
    suffix = path.suffix.lstrip(".").lower()
    write_atomic(Path(path), lambda tmp: fig.savefig(tmp, dpi=130, format=suffix), replace=force)
    plt.close(fig)
