"""Run a sweep's cells against a ready server and write the run folder.

Run folder layout (what CI uploads):
    cells/<cell_id>.json   vLLM's result + provenance (m3patch.bench.results)
    raw/<cell_id>.json     vLLM's result as its client saved it
    logs/<cell_id>.log     the client's output
    prompts/<cell_id>.jsonl  a chat cell's prompt bodies (the client adds the chat template)
    aggregate.json, aggregate.csv   (m3patch.bench.aggregate), once every cell passed
A cell stops the sweep when it fails (fail closed); the cells already done stay valid for
`--resume`, which re-measures only what has no valid, complete per-cell file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.bench import results as res
from m3patch.bench.aggregate import CELLS_DIR, table_of, write_aggregate
from m3patch.bench.cells import Cell
from m3patch.bench.chat_prompts import write_prompts
from m3patch.bench.client import BenchTarget, bench_argv, log_tail, run_client
from m3patch.errors import BenchFailed, UsageError
from m3patch.eval.compare import EvalRow, evals_of_run
from m3patch.fsio import owned_dir
from m3patch.output import info, progress, table

RAW_DIR = "raw"
PROMPTS_DIR = "prompts"  # a chat cell's prompt bodies (bench.chat_prompts)
LOGS_DIR = "logs"
DEFAULT_SEED = 0


@dataclass(frozen=True)
class SweepSettings:
    run_dir: Path
    resume: bool
    seed: int = DEFAULT_SEED
    rerun_hint: str = "m3patch bench RECIPE --resume --run-dir RUN_DIR"
    # ci: a kept cell must come from a gated server of exactly this recipe (its sha256)
    gated: str | None = None


@dataclass(frozen=True)
class SweepOutcome:
    measured: tuple[str, ...]
    skipped: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]


def refuse_overwrite(settings: SweepSettings) -> None:
    """Without --resume, earlier results are never overwritten (checked before any server starts)."""
    cells_dir = settings.run_dir / CELLS_DIR
    if not settings.resume and cells_dir.is_dir() and any(cells_dir.glob("*.json")):
        msg = f"{settings.run_dir} already holds per-cell results"
        raise UsageError(msg, hint="keep them: add --resume; or start a new run with --run-dir NEW")


def prepare_run_dir(settings: SweepSettings) -> None:
    refuse_overwrite(settings)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    for sub in (CELLS_DIR, RAW_DIR, LOGS_DIR):  # a link planted there is never written through
        owned_dir(settings.run_dir / sub, create=True)


def run_sweep(
    cells: Sequence[Cell],
    target: BenchTarget,
    settings: SweepSettings,
    *,
    provenance: dict[str, Any],
    meta: dict[str, Any],
    deadline_for: Callable[[Cell], float],
    check_server: Callable[[], None],
    print_rows: Callable[[Sequence[dict[str, Any]], str], None] | None = None,
) -> SweepOutcome:
    prepare_run_dir(settings)
    measured, skipped = [], []
    with progress(len(cells), "sweep") as advance:
        for cell in cells:
            cell_file = settings.run_dir / CELLS_DIR / f"{cell.cell_id}.json"
            if settings.resume and res.finished_cell(cell_file, cell, settings.gated):
                skipped.append(cell.cell_id)
                advance(f"{cell.cell_id} (kept)")
                continue
            check_server()
            _measure(cell, target, settings, provenance, deadline_for(cell), check_server)
            measured.append(cell.cell_id)
            advance(cell.cell_id)
    # Only this plan's cells: a resumed folder may hold cells of an earlier, wider plan.
    rows = write_aggregate(settings.run_dir, meta, [cell.cell_id for cell in cells])
    title = f"{meta.get('recipe_name', 'sweep')}: per-GPU results"
    if print_rows is None:
        print_results(rows, title, evals_of_run(settings.run_dir))
    else:
        print_rows(rows, title)
    info(f"{len(measured)} cell(s) measured, {len(skipped)} kept; results in {settings.run_dir}")
    return SweepOutcome(tuple(measured), tuple(skipped), tuple(rows))


def print_results(rows: Sequence[dict[str, Any]], title: str,
                  evals: Sequence[EvalRow] = ()) -> None:
    """The table users read first: InferenceX's per-GPU throughput and latency per cell, and the
    run's accuracy scores beside them when its eval has run."""
    columns, lines = table_of(rows, evals)
    table(title, columns, lines)


def _measure(
    cell: Cell,
    target: BenchTarget,
    settings: SweepSettings,
    provenance: dict[str, Any],
    deadline_s: float,
    check_server: Callable[[], None],
) -> None:
    run_dir = settings.run_dir
    raw_path = run_dir / RAW_DIR / f"{cell.cell_id}.json"
    raw_path.unlink(missing_ok=True)  # a stale file must never pass for this run's result
    log_path = run_dir / LOGS_DIR / f"{cell.cell_id}.log"
    prompts = None
    if cell.chat:
        prompts = run_dir / PROMPTS_DIR / f"{cell.cell_id}.jsonl"
        write_prompts(target.python, target.tokenizer, cell, settings.seed, prompts,
                      settings.rerun_hint)
    argv = bench_argv(target, cell, raw_path.parent, raw_path.name, settings.seed, prompts)
    run = run_client(argv, cell_id=cell.cell_id, log_path=log_path, deadline_s=deadline_s,
                     check_server=check_server)
    check_server()  # a server that died at the very end must not leave a plausible result
    if run.returncode != 0:
        msg = (f"cell {cell.cell_id}: vllm bench serve exited with status {run.returncode} "
               f"(log {log_path}); last lines:\n{log_tail(log_path)}")
        raise BenchFailed(msg, hint=settings.rerun_hint)
    data = res.read_json_object(raw_path)
    res.check_vllm_result(data, raw_path)
    problems = res.cell_failures(data, cell)
    if problems:
        msg = f"cell {cell.cell_id}: {'; '.join(problems)} ({raw_path}, client log {log_path})"
        raise BenchFailed(msg, hint=settings.rerun_hint)
    document = res.cell_document(data, cell, provenance, run.seconds)
    res.write_result(run_dir / CELLS_DIR / f"{cell.cell_id}.json", document)
