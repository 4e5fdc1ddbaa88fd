"""The layer-wise fidelity figure (like the SnapMLA paper's Fig. 5): one panel per metric of the
attention output, one line per configuration over layers, log-scale y. Written atomically."""

from __future__ import annotations

from pathlib import Path

from ..cache.atomic import write_atomic
from ..plot_files import check_plot_output
from .fidelity import METRICS, FidelityReport

_TITLES = {"rmse": "RMSE", "cos_diff": "cosine difference (1 - cos)", "rel_l2": "relative L2"}


def plot_fidelity(report: FidelityReport, path: Path, title: str = "", force: bool = False) -> None:
    """Write the figure to ``path`` (.png/.pdf/.svg); a file there is replaced only with
    ``force``, also one that appeared after the command checked its outputs."""
    plt = check_plot_output(path)
    from matplotlib.ticker import MaxNLocator

    layers = [layer.layer for layer in report.layers]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4), constrained_layout=True)
    for ax, metric in zip(axes, METRICS):
        exact: set[int] = set()
        for config in report.configs:
            # a zero (an all-zero layer, an exact copy) has no place on a log axis: drawn at 1e-300
            # it stretched every panel over 300 decades, so it is a gap, named in the panel
            raw = [getattr(layer.metrics["output"][config], metric) for layer in report.layers]
            exact.update(n for n, v in zip(layers, raw) if not v > 0)
            values = [v if v > 0 else float("nan") for v in raw]
            ax.plot(layers, values, marker="o", markersize=3, label="SnapMLA" if config == "snap" else f"Config {config}")
        ax.set_yscale("log")
        if exact:
            ax.text(0.02, 0.02, f"0 (not drawn) at layer {', '.join(map(str, sorted(exact)))}",
                    transform=ax.transAxes, fontsize=7, va="bottom")
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(_TITLES[metric])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    suffix = Path(path).suffix.lstrip(".").lower()
    write_atomic(Path(path), lambda tmp: fig.savefig(tmp, dpi=120, format=suffix), replace=force)
    plt.close(fig)
