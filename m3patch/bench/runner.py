"""`m3patch bench RECIPE`: start the patched server (ServeSession), sweep, plot, stop.

`sweep_session(recipe, session, ...)` is the piece `m3patch serve --bench` and `m3patch ci`
call with a session they already hold: it sweeps the recipe's cells against it while the
session keeps watching the server log for forbidden markers and the run deadline.
"""

from __future__ import annotations

import argparse
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3patch.bench import spec
from m3patch.bench.cells import Cell
from m3patch.bench.client import BenchTarget, server_died
from m3patch.bench.sweep import SweepOutcome, SweepSettings, refuse_overwrite, run_sweep
from m3patch.errors import UsageError
from m3patch.recipe.loader import Recipe, load_recipe

if TYPE_CHECKING:
    from m3patch.serving.server_session import ServeSession

HEALTH_TIMEOUT_S = 5.0
PLOTS_DIR = "plots"


def select_cells(recipe: Recipe, only: Sequence[str]) -> tuple[Cell, ...]:
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
        earlier = sorted(p for p in base.glob("*/cells") if p.is_dir()) if base.is_dir() else []
        if not earlier:
            msg = f"--resume: no earlier run folder under {base}"
            raise UsageError(msg, hint="drop --resume, or pass --run-dir RUN_FOLDER")
        return earlier[-1].parent
    return base / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def run_meta(recipe: Recipe, run_dir: Path, provenance: dict[str, Any]) -> dict[str, Any]:
    return {"recipe_name": recipe.name, "recipe": str(recipe.path), "run": run_dir.name,
            "series": provenance.get("series"), "provenance": provenance}


def sweep_session(
    recipe: Recipe, python: str, target: BenchTarget, settings: SweepSettings,
    cells: Sequence[Cell], check_server: Callable[[], None], *, server: str = spec.SESSION_SERVER,
) -> SweepOutcome:
    provenance = spec.provenance(recipe, python, server)
    return run_sweep(
        cells, target, settings, provenance=provenance,
        meta=run_meta(recipe, settings.run_dir, provenance),
        deadline_for=lambda cell: spec.cell_deadline_s(recipe, cell), check_server=check_server,
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


def bench_recipe(recipe_path: Path, args: argparse.Namespace) -> int:
    recipe = load_recipe(recipe_path)
    cells = select_cells(recipe, args.only)
    run_dir = resolve_run_dir(recipe, args.run_dir, args.resume)
    python = args.python or recipe.target.python
    if python is None:
        msg = f"{recipe.path}: no interpreter for the bench client (target.python unset)"
        raise UsageError(msg, hint="pass --python PATH (the venv whose vLLM serves)")
    settings = SweepSettings(run_dir, args.resume, args.seed,
                             f"m3patch bench {recipe_path} --resume --run-dir {run_dir}")
    refuse_overwrite(settings)
    if args.resume and all_finished(run_dir, cells):
        _reaggregate(recipe, run_dir, cells)  # nothing to measure: no server start to pay
    elif args.url:
        _sweep_external(recipe, python, args.url.rstrip("/"), settings, cells)
    else:
        from m3patch.serving.server_session import ServeSession

        with ServeSession(recipe, run_dir, python=python, port=args.port) as session:
            target = BenchTarget(Path(session.python), session.base_url, session.model,
                                 session.tokenizer)
            sweep_session(recipe, session.python, target, settings, cells, session.check_alive)
    if not args.no_plots:
        plot_run(run_dir)
    return 0


def _sweep_external(recipe: Recipe, python: str, base_url: str, settings: SweepSettings,
                    cells: Sequence[Cell]) -> None:
    target = BenchTarget(Path(python), base_url, recipe.model.served_name, recipe.model.tokenizer)
    check = health_probe(base_url, f"{settings.rerun_hint} --url {base_url}")
    check()
    sweep_session(recipe, python, target, settings, cells, check,
                  server=f"external {base_url} (not started or gated by m3patch)")


def _reaggregate(recipe: Recipe, run_dir: Path, cells: Sequence[Cell]) -> None:
    from m3patch.bench.aggregate import CELLS_DIR, write_aggregate
    from m3patch.bench.results import read_cell_file
    from m3patch.output import info

    first = read_cell_file(run_dir / CELLS_DIR / f"{cells[0].cell_id}.json")
    meta = run_meta(recipe, run_dir, first["m3patch"]["provenance"])
    write_aggregate(run_dir, meta, [cell.cell_id for cell in cells])
    info(f"every cell already has a valid result; aggregated {run_dir} without a server")


def bench_in_session(recipe: Recipe, session: ServeSession, run_dir: Path,
                     *, resume: bool = False) -> int:
    """`m3patch serve RECIPE --bench`: sweep every cell against the session's server, plot."""
    cells = select_cells(recipe, ())
    settings = SweepSettings(run_dir, resume, rerun_hint=(
        f"m3patch bench {recipe.path} --resume --run-dir {run_dir}"))
    target = BenchTarget(Path(session.python), session.base_url, session.model, session.tokenizer)
    sweep_session(recipe, session.python, target, settings, cells, session.check_alive)
    plot_run(run_dir)
    return 0


def all_finished(run_dir: Path, cells: Sequence[Cell]) -> bool:
    from m3patch.bench.aggregate import CELLS_DIR
    from m3patch.bench.results import finished_cell

    return all(finished_cell(run_dir / CELLS_DIR / f"{cell.cell_id}.json", cell) for cell in cells)


def plot_run(run_dir: Path) -> list[Path]:
    """Plots of a finished run; matplotlib is optional, so a sweep without it only warns."""
    from m3patch.bench.aggregate import load_aggregate
    from m3patch.bench.plots import PlotRun, draw, have_matplotlib, run_title
    from m3patch.output import info, warn

    if not have_matplotlib():
        warn("matplotlib is not installed: no plots (pip install 'm3patch[plots]')")
        return []
    aggregate = load_aggregate(run_dir)
    paths = draw([PlotRun("run", run_title(aggregate), tuple(aggregate["rows"]))],
                 run_dir / PLOTS_DIR)
    for path in paths:
        info(f"plot written to {path}")
    return paths
