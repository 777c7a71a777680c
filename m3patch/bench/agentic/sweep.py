"""Run an agentic-coding sweep's cells against a ready server and write the run folder.

Each cell: the server's /metrics scraped, AIPerf started in its own process group (bench.client:
the one start helper, polled against the cell deadline and the server's health, stopped through
the one stop ladder whatever ends the wait), the gauges sampled while it runs, /metrics scraped
again; AIPerf's records scored (agentic.scoring) and the cell file written with its export.

    cells/<cell_id>.json   the scored cell (agentic.results)
    trace/dataset.jsonl    an agentic-code trace as this run replayed it (agentic.synthesize)
    hub-view/              a local tokenizer laid out as a hub cache for AIPerf (agentic.aiperf)
    raw/<cell_id>/         AIPerf's artifacts (profile_export*.json/.jsonl/.csv, server metrics)
    logs/<cell_id>.log     AIPerf's output
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from m3patch.bench.agentic import metrics as scrape
from m3patch.bench.agentic import synthesize
from m3patch.bench.agentic.aiperf import (
    AgenticTarget,
    aiperf_argv,
    check_client,
    client_env,
    tokenizer_view,
)
from m3patch.bench.agentic.results import cell_document, finished
from m3patch.bench.agentic.scoring import score
from m3patch.bench.aggregate import CELLS_DIR, write_aggregate
from m3patch.bench.cells import AgenticCell
from m3patch.bench.client import log_tail, run_client
from m3patch.bench.results import read_json_object, write_result
from m3patch.bench.sweep import LOGS_DIR, RAW_DIR, SweepOutcome, SweepSettings, prepare_run_dir
from m3patch.errors import AgenticClientError, ResultsInvalid
from m3patch.output import info, progress
from m3patch.recipe.agentic import AgenticScenario

EXPORT_JSON = "profile_export_aiperf.json"
RECORDS_JSONL = "profile_export.jsonl"
SERVER_METRICS_JSON = "server_metrics_export.json"
TOKENIZER_VIEW = "hub-view"  # a local tokenizer, as AIPerf's offline mode finds one (aiperf.py)


def run_agentic_sweep(
    cells: Sequence[AgenticCell], scenario: AgenticScenario, target: AgenticTarget,
    settings: SweepSettings, *, provenance: dict[str, Any], meta: dict[str, Any],
    deadline_for: Callable[[AgenticCell], float], check_server: Callable[[], None],
    print_rows: Callable[[Sequence[dict[str, Any]], str], None],
) -> SweepOutcome:
    version = check_client(scenario.client_python)
    prepare_run_dir(settings)
    # A synthesized trace: replayed from the run's own checked copy, its sha256 in every cell.
    scenario, trace_record = synthesize.for_run(scenario, settings.run_dir)
    if trace_record:
        provenance = {**provenance, "agentic_trace": trace_record}
    target, view = tokenizer_view(target, scenario.trace, settings.run_dir / TOKENIZER_VIEW,
                                  os.environ)
    measured, skipped = [], []
    with progress(len(cells), "agentic sweep") as advance:
        for cell in cells:
            cell_file = settings.run_dir / CELLS_DIR / f"{cell.cell_id}.json"
            if settings.resume and finished(cell_file, cell, trace_record.get("key")):
                skipped.append(cell.cell_id)
                advance(f"{cell.cell_id} (kept)")
                continue
            check_server()
            document = measure(cell, scenario, target, settings, deadline_for(cell), check_server,
                               view)
            document["m3patch"].update(provenance=provenance, aiperf_version=version)
            document["allocated_cpu_dram_gb"] = (
                scenario.dram_budget_gb(cell.parallelism.gpu_count)
                if cell.kv_offload.tier == "dram" else 0)
            write_result(cell_file, document)
            measured.append(cell.cell_id)
            advance(cell.cell_id)
    rows = write_aggregate(settings.run_dir, meta, [cell.cell_id for cell in cells])
    print_rows(rows, f"{meta.get('recipe_name', 'sweep')}: agentic-coding results (AIPerf)")
    info(f"{len(measured)} cell(s) measured, {len(skipped)} kept; results in {settings.run_dir}")
    return SweepOutcome(tuple(measured), tuple(skipped), tuple(rows))


def measure(cell: AgenticCell, scenario: AgenticScenario, target: AgenticTarget,
            settings: SweepSettings, deadline_s: float, check_server: Callable[[], None],
            view: Path | None = None) -> dict[str, Any]:
    """One cell: scrape, replay, scrape; the scored document (provenance filled by the caller)."""
    run_dir = settings.run_dir
    artifacts = run_dir / RAW_DIR / cell.cell_id
    shutil.rmtree(artifacts, ignore_errors=True)  # a stale export must never pass for this run's
    log_path = run_dir / LOGS_DIR / f"{cell.cell_id}.log"
    cell_metrics = scrape.CellMetrics(scrape.scrape(target.base_url))
    argv = aiperf_argv(scenario.client_python, target, cell, scenario, artifacts, settings.seed)
    run = run_client(argv, cell_id=cell.cell_id, log_path=log_path, deadline_s=deadline_s,
                     check_server=scrape.sampling(target.base_url, cell_metrics, check_server),
                     env=client_env(view), client="aiperf profile")
    check_server()  # a server that died at the very end must not leave a plausible result
    cell_metrics.after = scrape.scrape(target.base_url)
    cell_metrics.sample(cell_metrics.after)
    if run.returncode != 0:
        msg = (f"cell {cell.cell_id}: aiperf profile exited with status {run.returncode} "
               f"(log {log_path}); last lines:\n{log_tail(log_path)}")
        raise AgenticClientError(msg, hint=settings.rerun_hint)
    export = _export(artifacts, cell.cell_id)
    fields = score(_records(artifacts / RECORDS_JSONL, cell.cell_id), cell.parallelism.gpu_count)
    if not fields["num_requests_successful"]:
        accounting = fields["request_accounting"]
        msg = (f"cell {cell.cell_id}: no profiled request succeeded ({accounting}); "
               f"AIPerf log {log_path}")
        raise AgenticClientError(msg, hint=settings.rerun_hint)
    fields.update(cell_metrics.fields())
    fields["server_metrics_scrape"] = {"before": dict(scrape.series(cell_metrics.before)),
                                       "after": dict(scrape.series(cell_metrics.after))}
    _check_aiperf_scrape(artifacts / SERVER_METRICS_JSON, cell.cell_id)
    return cell_document(cell, fields, export, provenance={}, client_seconds=run.seconds,
                         aiperf_version="", artifacts=f"{RAW_DIR}/{cell.cell_id}", dram_gb=0)


def _export(artifacts: Path, cell_id: str) -> dict[str, Any]:
    path = artifacts / EXPORT_JSON
    if not path.is_file():
        msg = f"cell {cell_id}: AIPerf wrote no {EXPORT_JSON} in {artifacts}"
        raise AgenticClientError(msg, hint="see the cell's log under logs/")
    try:
        return read_json_object(path)
    except ResultsInvalid as exc:
        raise AgenticClientError(exc.message, hint=exc.hint) from None


def _records(path: Path, cell_id: str) -> list[dict[str, Any]]:
    """AIPerf's per-request records; a line that is not a JSON object makes the export invalid."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        msg = f"cell {cell_id}: cannot read AIPerf's records {path}: {exc}"
        raise AgenticClientError(msg, hint="see the cell's log under logs/") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            msg = f"{path}:{number}: not JSON ({exc.msg})"
            raise AgenticClientError(msg, hint="rerun the cell (--resume)") from None
        if not isinstance(record, dict):
            msg = f"{path}:{number}: expected a JSON object per line"
            raise AgenticClientError(msg, hint="rerun the cell (--resume)")
        records.append(record)
    return records


def _check_aiperf_scrape(path: Path, cell_id: str) -> None:
    """InferenceX's gate on AIPerf's own scrape: the export holds a `vllm:` metric."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    if f'"{scrape.PREFIX}' not in text:
        msg = (f"cell {cell_id}: AIPerf's server-metrics export {path} holds no "
               f"{scrape.PREFIX} metric (InferenceX requires one)")
        raise AgenticClientError(msg, hint="the server must answer /metrics on its base URL")
