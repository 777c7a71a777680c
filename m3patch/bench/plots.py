"""PNG plots of one or two runs: throughput/GPU vs concurrency, interactivity vs throughput/GPU.

matplotlib is an optional dependency (`pip install m3patch[plots]`), imported only here and only
when a plot is drawn, with the Agg backend so no display is needed. One line per run and shape
(ISL/OSL + parallelism); base is dashed, new is solid, so overlaid curves stay readable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.bench.compare import seq_label
from m3patch.errors import UsageError

THROUGHPUT_PNG = "throughput_per_gpu.png"
INTERACTIVITY_PNG = "interactivity_vs_throughput.png"
PARETO_PNG = "throughput_vs_e2e_interactivity.png"  # agentic runs: InferenceX's Pareto axes
LINE_STYLES = ("--", "-")  # base, new


@dataclass(frozen=True)
class PlotRun:
    role: str  # 'base' | 'new' | 'run'
    title: str  # recipe and series, e.g. "cpu_tiny_moe / vllm-0.32.0"
    rows: tuple[dict[str, Any], ...]


def run_title(aggregate: dict[str, Any]) -> str:
    recipe = aggregate.get("recipe_name") or "unknown recipe"
    series = aggregate.get("series") or "unpatched"
    run = f" ({aggregate['run']})" if aggregate.get("run") else ""
    return f"{recipe} / {series}{run}"


def _series_of(run: PlotRun) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped per shape, each group sorted by concurrency."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in run.rows:
        groups.setdefault(f"{seq_label(row)} {row['parallelism']}", []).append(row)
    return {key: sorted(rows, key=lambda r: r["concurrency"]) for key, rows in groups.items()}


def have_matplotlib() -> bool:
    # deferred: lazy by design
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    try:
        # deferred: matplotlib: only plotting needs it (optional extra)
        import matplotlib
    except ImportError:
        msg = "plots need matplotlib, which is not installed"
        raise UsageError(msg, hint="pip install 'm3patch[plots]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    # deferred: matplotlib: only plotting needs it (optional extra)
    import matplotlib.pyplot as plt

    return plt


def draw(runs: Sequence[PlotRun], out_dir: Path) -> list[Path]:
    """Write both PNGs into out_dir; return their paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    heading = " vs ".join(f"{run.role}: {run.title}" for run in runs)
    paths = []
    for name, x_key, y_key, x_label, y_label, log_x, log_y in _figures(runs):
        fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
        for style, run in zip(LINE_STYLES if len(runs) > 1 else ("-",), runs, strict=False):
            _plot_run(ax, run, x_key, y_key, style)
        if log_x:
            ax.set_xscale("log", base=2)
            concs = sorted({r["concurrency"] for run in runs for r in run.rows})
            ax.set_xticks(concs, [str(c) for c in concs])
        if log_y:
            ax.set_yscale("log")
            plain = plt.FuncFormatter(lambda value, _pos: f"{value:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.set_title(heading, fontsize=10)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:  # every cell n/a (burst): say so instead of an empty frame and a legend warning
            ax.text(0.5, 0.5, "n/a: no cell has this figure (see decode_na in aggregate.json)",
                    transform=ax.transAxes, ha="center", va="center")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _figures(runs: Sequence[PlotRun]) -> tuple[tuple[str, str, str, str, str, bool, bool], ...]:
    """(file, x, y, x label, y label, log x, log y) per figure. An agentic run's second figure
    is InferenceX's Pareto plot: E2E-normalised interactivity (1 / P90 of E2EL / OSL) on x,
    throughput per GPU on y."""
    throughput = (THROUGHPUT_PNG, "concurrency", "tput_per_gpu",
                  "concurrency (requests in flight)", "total throughput per GPU (tok/s/GPU)",
                  True, False)
    if any(row.get("scenario_type") == "agentic-coding" for run in runs for row in run.rows):
        return throughput, (PARETO_PNG, "p90_e2e_norm_intvty", "tput_per_gpu",
                            "E2E-normalised interactivity, 1 / P90(E2EL / OSL) (tok/s/user)",
                            "total throughput per GPU (tok/s/GPU)", False, False)
    # Log y: a server that flushes tokens in bursts has a near-zero median TPOT, and one such
    # cell would flatten every other point onto the axis.
    return throughput, (INTERACTIVITY_PNG, "tput_per_gpu", "median_intvty",
                        "total throughput per GPU (tok/s/GPU)",
                        "interactivity, 1000 / median TPOT (tok/s/user, log)", False, True)


def _plot_run(ax: Any, run: PlotRun, x_key: str, y_key: str, style: str) -> None:
    for shape, rows in _series_of(run).items():
        points = [(r[x_key], r[y_key]) for r in rows if r[x_key] is not None and r[y_key] is not None]
        if not points:
            continue
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        line = ax.plot(xs, ys, style, marker="o", label=f"{run.role}: {shape}")[0]
        if x_key != "concurrency":
            for row in rows:
                if row[x_key] is not None and row[y_key] is not None:
                    ax.annotate(f"c{row['concurrency']}", (row[x_key], row[y_key]), fontsize=7,
                                textcoords="offset points", xytext=(4, 4), color=line.get_color())
