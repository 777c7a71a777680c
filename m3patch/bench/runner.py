"""The bench pieces the run pipeline (m3patch.run.pipeline) composes: cells, run folder, sweep,
re-aggregation, the results check and the plots.

`sweep_session` sweeps the recipe's cells against a server the pipeline holds (a ServeSession,
whose `check_alive` keeps watching the log for forbidden markers and the run deadline, or an
external server watched through `/health`). `plot_run` is the one place a run's plots are drawn.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from m3patch.bench import spec
from m3patch.bench.agentic.aiperf import AgenticTarget
from m3patch.bench.agentic.results import finished as agentic_finished
from m3patch.bench.agentic.sweep import run_agentic_sweep
from m3patch.bench.aggregate import (
    CELLS_DIR,
    cell_files,
    load_aggregate,
    read_any_cell,
    write_aggregate,
)
from m3patch.bench.cells import AgenticCell, AnyCell, Cell
from m3patch.bench.client import BenchTarget, server_died
from m3patch.bench.plots import PlotRun, draw, have_matplotlib, run_title
from m3patch.bench.results import finished_cell
from m3patch.bench.sweep import SweepOutcome, SweepSettings, print_results, run_sweep
from m3patch.errors import ResultsInvalid, UsageError
from m3patch.eval.compare import evals_of_run
from m3patch.output import info, warn
from m3patch.recipe.loader import Recipe

HEALTH_TIMEOUT_S = 5.0
PLOTS_DIR = "plots"
# What `m3patch ci` writes into its run folder beside the sweep's cells: such a folder is ci's,
# gated and summarised, never one `bench --resume` picks up (commands.ci names them from here).
CI_SUMMARY, CI_SERVE_LOG, CI_EVAL_LOG = "ci.json", "ci-serve.log", "ci-eval.log"


def select_cells(recipe: Recipe, only: Sequence[str]) -> tuple[AnyCell, ...]:
    cells = spec.recipe_cells(recipe)
    if not only:
        return cells
    known = {cell.cell_id for cell in cells}
    unknown = [cell_id for cell_id in only if cell_id not in known]
    if unknown:
        msg = f"{recipe.path}: no sweep cell {unknown[0]} (cells: {', '.join(sorted(known))})"
        raise UsageError(msg, hint=f"m3patch matrix {recipe.path} lists the cell ids")
    return tuple(cell for cell in cells if cell.cell_id in only)


def resolve_run_dir(recipe: Recipe, run_dir: Path | None, resume: bool) -> Path:
    if run_dir is not None:
        return run_dir
    base = recipe.results_dir
    if resume:
        runs = [(p, _bench_cells(p)) for p in base.glob("*")] if base.is_dir() else []
        earlier = sorted((_written_at(cells), p.name, p) for p, cells in runs if cells)
        if not earlier:
            msg = f"--resume: no earlier bench run folder with per-cell results under {base}"
            raise UsageError(msg, hint="drop --resume, or pass --run-dir RUN_FOLDER")
        return earlier[-1][2]
    return base / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _bench_cells(folder: Path) -> list[Path]:
    """A bench run's cell results; none for any other folder. Only a folder holding a cell's
    result is a run to resume (one a refused or cut short run left without any would hide the
    earlier run whose cells --resume keeps), and not ci's: the recipe's results hold serve-,
    eval- and ci- runs too, whatever their names."""
    if any((folder / name).exists() for name in (CI_SUMMARY, CI_SERVE_LOG, CI_EVAL_LOG)):
        return []
    return list(cell_files(folder))


def _written_at(cells: list[Path]) -> int:
    """When the run last wrote a cell's result: a folder's name is no time (--run-dir names
    it), and the folder's own mtime moves whenever anything is added."""
    try:
        return max(cell.stat().st_mtime_ns for cell in cells)
    except OSError:  # removed while listed: no run to resume first
        return 0


def run_meta(recipe: Recipe, run_dir: Path, provenance: dict[str, Any]) -> dict[str, Any]:
    # The InferenceX master-config entry, kept so that a changelog entry written from this run
    # anywhere (an InferenceX checkout holds no m3patch recipe) names what InferenceX knows.
    entry = recipe.inferencex.config_entry if recipe.inferencex is not None else None
    return {"recipe_name": recipe.name, "recipe": str(recipe.path), "run": run_dir.name,
            "series": provenance.get("series"), "inferencex_config_entry": entry,
            "provenance": provenance}


def sweep_session(
    recipe: Recipe, python: str, target: BenchTarget, settings: SweepSettings,
    cells: Sequence[AnyCell], check_server: Callable[[], None], *, server: str = spec.SESSION_SERVER,
    server_warnings: Sequence[dict[str, object]] = (), show_table: bool = True,
) -> SweepOutcome:
    """show_table=False: the run's eval follows the sweep and prints the results table with its
    scores beside the rows, once."""
    def print_rows(rows: Sequence[dict[str, Any]], title: str) -> None:
        if show_table:
            print_results(rows, title, evals_of_run(settings.run_dir))
    provenance = spec.provenance(recipe, python, server)
    # `warn` markers the server logged by readiness: reported beside every number they touch.
    provenance["server_warnings"] = list(server_warnings)
    meta = run_meta(recipe, settings.run_dir, provenance)
    if recipe.sweep.agentic is not None:
        agentic = AgenticTarget(target.base_url, target.served_model, target.tokenizer)
        return run_agentic_sweep(
            [c for c in cells if isinstance(c, AgenticCell)], recipe.sweep.agentic, agentic,
            settings, provenance=provenance, meta=meta,
            deadline_for=lambda cell: spec.cell_deadline_s(recipe, cell),
            check_server=check_server, print_rows=print_rows)
    return run_sweep(
        [c for c in cells if isinstance(c, Cell)], target, settings, provenance=provenance,
        meta=meta, deadline_for=lambda cell: spec.cell_deadline_s(recipe, cell),
        check_server=check_server, print_rows=print_rows,
    )


def health_probe(base_url: str, rerun: str) -> Callable[[], None]:
    """check_server for a server m3patch did not start: it must keep answering /health."""
    def check() -> None:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=HEALTH_TIMEOUT_S) as reply:
                if reply.status != 200:
                    msg = f"{base_url}/health answered {reply.status}"
                    raise server_died(msg, rerun)
        except (urllib.error.URLError, OSError) as exc:
            msg = f"{base_url}/health: {exc}"
            raise server_died(msg, rerun) from None
    return check


def reaggregate(recipe: Recipe, run_dir: Path, cells: Sequence[AnyCell], *,
                note: str | None = None) -> None:
    """aggregate.json over every cell's file (a resumed run, or one swept group by group)."""
    first = read_any_cell(run_dir / CELLS_DIR / f"{cells[0].cell_id}.json")
    meta = run_meta(recipe, run_dir, first["m3patch"]["provenance"])
    write_aggregate(run_dir, meta, [cell.cell_id for cell in cells])
    info(note or f"every cell already has a valid result; aggregated {run_dir} without a server")


def all_finished(run_dir: Path, cells: Sequence[AnyCell], gated: str | None = None,
                 trace_key: str | None = None) -> bool:
    return all(cell_finished(run_dir / CELLS_DIR / f"{cell.cell_id}.json", cell, gated,
                             trace_key) for cell in cells)


def cell_finished(path: Path, cell: AnyCell, gated: str | None = None,
                  trace_key: str | None = None) -> bool:
    """For --resume: a valid, complete file for exactly this cell (either scenario); with
    `gated`, a fixed-length cell only when measured on a gated server of that recipe hash;
    with `trace_key`, an agentic cell only when it replayed that synthesized trace."""
    if isinstance(cell, AgenticCell):
        return agentic_finished(path, cell, trace_key)
    return finished_cell(path, cell, gated)


def check_results(run_dir: Path) -> tuple[list[Path], dict[str, Any]]:
    """Every per-cell file and aggregate.json read back and validated; (cell files, aggregate)."""
    cells = cell_files(run_dir)
    if not cells:
        msg = f"{run_dir}: no per-cell result files under cells/"
        raise ResultsInvalid(msg, hint=f"m3patch ci RECIPE --resume --run-dir {run_dir}")
    for path in cells:
        read_any_cell(path)
    return cells, load_aggregate(run_dir)


def plot_run(run_dir: Path, aggregate: dict[str, Any], *, required: bool) -> list[Path]:
    """The run's plots in RUN/plots. matplotlib is optional: without it a run that does not
    require plots only warns; one that does fails (UsageError from plots.draw)."""
    if not required and not have_matplotlib():
        warn("matplotlib is not installed: no plots (pip install 'm3patch[plots]')")
        return []
    paths = draw([PlotRun("run", run_title(aggregate), tuple(aggregate["rows"]))],
                 run_dir / PLOTS_DIR)
    for path in paths:
        info(f"plot written to {path}")
    return paths
