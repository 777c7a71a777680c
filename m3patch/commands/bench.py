"""`m3patch bench RECIPE` (the run pipeline: apply, serve, sweep, stop, results, plots) and
`m3patch bench compare BASE NEW`.

    m3patch bench recipes/cpu_tiny_moe.yaml                  # apply+verify, serve, sweep, plots
    m3patch bench recipes/cpu_tiny_moe.yaml --resume --run-dir results/cpu_tiny_moe/RUN
    m3patch bench recipes/x.yaml --url http://127.0.0.1:8000 # sweep a server started elsewhere
    m3patch bench compare BASE NEW [--plots DIR]           # aggregate.json files or run folders
"""

from __future__ import annotations

import argparse
import re
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from m3patch.bench import compare as cmp
from m3patch.bench.aggregate import AGGREGATE_JSON, load_aggregate
from m3patch.bench.changelog_entry import HEADLINE_METRICS, changelog_entry
from m3patch.bench.plots import PlotRun, draw, have_matplotlib, run_title
from m3patch.commands.flags import (
    add_json_flags,
    add_python_flag,
    json_file,
    json_stdout,
    port_number,
)
from m3patch.errors import (
    Interrupted,
    ResultsInvalid,
    UsageError,
    interrupt,
    raise_if_interrupted,
)
from m3patch.eval import compare as eval_compare
from m3patch.fsio import write_output_json
from m3patch.output import info, printable, stdout_console, table, warn
from m3patch.patching import report_json
from m3patch.recipe.names import recipe_path
from m3patch.run.pipeline import PlotMode, RunCommand, RunPipeline, RunSpec
from m3patch.run.steps import finish, run_steps

if TYPE_CHECKING:
    from m3patch.run.pipeline import RunSpec
    from m3patch.run.steps import RunOutcome

COMPARE = "compare"
RECIPE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # fullmatch: `$` lets "\n" end it
METRICS = tuple(cmp.METRIC_LABELS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", nargs="+", metavar="RECIPE | compare BASE NEW",
                        help="a recipe to sweep, or `compare BASE NEW` (aggregate.json or run folder)")
    sweep = parser.add_argument_group("sweep (m3patch bench RECIPE)")
    sweep.add_argument("--run-dir", type=Path,
                       help="run folder (default: <recipe results>/<UTC time>; with --resume: "
                            "the bench run folder there whose cell results were written last; ci's are "
                            "never taken)")
    sweep.add_argument("--resume", action="store_true",
                       help="keep cells that already have a valid, complete result file")
    sweep.add_argument("--only", action="append", metavar="CELL_ID", default=[],
                       help="run only this cell (repeatable; ids as in `m3patch matrix`)")
    add_python_flag(sweep, what="interpreter whose vLLM serves (default: the recipe's "
                                "target.python, else this one)")
    sweep.add_argument("--port", type=port_number, help="server port (default: the recipe's)")
    sweep.add_argument("--url", metavar="BASE_URL",
                       help="sweep a server that is already running; m3patch neither starts nor "
                            "gates it, and provenance says so")
    sweep.add_argument("--seed", type=int, default=0, help="random dataset seed (default 0)")
    sweep.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    comp = parser.add_argument_group("compare (m3patch bench compare BASE NEW)")
    comp.add_argument("--metric", choices=METRICS, default="tput_per_gpu", metavar="METRIC",
                      help="value compared per cell: a throughput per GPU, "
                           "<stat>_<ttft|tpot|itl|e2el> in seconds, <stat> one of mean, median, "
                           "std, p90, p99, p99.9, or <stat>_intvty (tok/s/user; every <stat> but "
                           "std) (default: tput_per_gpu, total tok/s/GPU)")
    comp.add_argument("--plots", type=Path, metavar="DIR", help="write both PNG plots here")
    comp.add_argument("--changelog-entry", action="store_true",
                      help="print only a perf-changelog.yaml entry for NEW's recipe with the "
                           "headline deltas (append it: ... --changelog-entry >> "
                           "perf-changelog.yaml)")
    add_json_flags(parser, report="the report (compare: the comparison)", file_alias=True)


def run(args: argparse.Namespace) -> int:
    if args.what[0] == COMPARE:
        if len(args.what) != 3:
            msg = f"bench compare takes BASE and NEW, got {len(args.what) - 1} argument(s)"
            raise UsageError(msg, hint="m3patch bench compare BASE_RUN NEW_RUN")
        return _compare(Path(args.what[1]), Path(args.what[2]), args)
    if len(args.what) != 1:
        msg = f"bench takes one recipe, got {len(args.what)}: {' '.join(args.what)}"
        raise UsageError(msg, hint="m3patch bench RECIPE  (or: m3patch bench compare BASE NEW)")

    # SIGTERM (CI cancelling the job) must unwind like Ctrl-C: the `with` blocks then stop the
    # client's and the server's process groups instead of orphaning them.
    signal.signal(signal.SIGTERM, _on_sigterm)
    fields = report_json.start("bench") if json_stdout(args) else report_json.envelope("bench")
    spec = run_spec(recipe_path(args.what[0]), args)
    with RunPipeline(spec) as pipeline:
        outcome = run_steps(pipeline.steps(), lambda _result: None)
    if outcome.exit_code == 0:  # a stop a best-effort step swallowed: no result says "ok"
        raise_if_interrupted()
    report_run(fields, pipeline, outcome, spec.recipe_path)
    if json_file(args) is not None:
        report = {**fields, "exit_code": outcome.exit_code, "ok": outcome.exit_code == 0}
        write_output_json(Path(str(json_file(args))), report, flag="--json-file", sort_keys=True)
    code = finish(outcome)
    if json_stdout(args):
        report_json.finish(fields)
    return code


def report_run(fields: dict[str, Any], pipeline: RunPipeline, outcome: RunOutcome,
               recipe: Path) -> None:
    """The run's part of the --json object: recipe, run folder, steps, the tree it prepared."""
    plan = pipeline.plan
    report_json.attach_run(fields, recipe=recipe, run_dir=None if plan is None else plan.run_dir,
                           python=None if plan is None else plan.python,
                           ledger_sha256=pipeline.ledger_sha256,
                           steps=[r.to_json() for r in outcome.results])


def run_spec(recipe: Path, args: argparse.Namespace) -> RunSpec:
    return RunSpec(recipe, RunCommand.BENCH, run_dir=args.run_dir, python=args.python,
                   port=args.port, only=tuple(args.only), resume=args.resume, seed=args.seed,
                   url=args.url, plots=PlotMode.OFF if args.no_plots else PlotMode.OPTIONAL)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    msg = f"received signal {signal.Signals(signum).name}; the sweep and its server were stopped"
    interrupt(Interrupted(msg, hint="re-run with --resume to keep the finished cells"))


def _scores(sides: tuple[tuple[Path, dict[str, Any]], ...]
            ) -> tuple[tuple[eval_compare.Scores, eval_compare.Scores], str] | None:
    """Each run's scores: its aggregate's `evals` (checked when it was loaded), else the
    eval/eval.json beside it (an aggregate written before it kept them, or an eval run on its
    own after the sweep); with the file they came from, for the table's heading. None when
    neither run has scores."""
    found: list[eval_compare.Scores | None] = []
    sources = []
    for path, aggregate in sides:
        rows = aggregate.get(eval_compare.EVALS)
        record = eval_compare.record_path(path)
        if rows:
            found.append(eval_compare.scores_of(rows))
            sources.append(f"{AGGREGATE_JSON} {eval_compare.EVALS}")
        else:
            found.append(eval_compare.read_scores(record) if record else None)
            sources.append(eval_compare.RECORD.as_posix() if record else "no eval")
    if found == [None, None]:
        return None
    source = sources[0] if sources[0] == sources[1] else f"base: {sources[0]}, new: {sources[1]}"
    return (found[0] or {}, found[1] or {}), source


def _accuracy(scores: tuple[tuple[eval_compare.Scores, eval_compare.Scores], str] | None
              ) -> dict[str, object]:
    """The accuracy gate's scores beside the throughput, when either run recorded an eval;
    the heading names the file the scores were read from."""
    if scores is None:
        return {}
    (base, new), source = scores
    table(f"accuracy ({source}): base -> new", ["Task", "Metric", "Base", "New", "Change"],
          eval_compare.compare_rows(base, new))
    return {"accuracy": eval_compare.to_json(base, new)}


def _compare(base: Path, new: Path, args: argparse.Namespace) -> int:

    fields = report_json.start("bench") if json_stdout(args) else None
    if args.changelog_entry and fields is not None:  # stdout is one thing: the YAML entry
        msg = "--changelog-entry prints a YAML entry to append to perf-changelog.yaml, not JSON"
        raise UsageError(msg, hint="drop --json (or drop --changelog-entry for the comparison "
                         "as JSON)")
    if args.plots and not have_matplotlib():  # before any output: nothing half-done
        msg = "--plots DIR needs matplotlib, which is not installed"
        raise UsageError(msg, hint="pip install 'm3patch[plots]', or drop --plots")
    base_agg, new_agg = load_aggregate(base), load_aggregate(new)
    # the compared metric; for an entry, every figure it states too (in order, once)
    stated = HEADLINE_METRICS if args.changelog_entry else ()
    for metric in dict.fromkeys((args.metric, *stated)):
        cmp.check_metric(base_agg["rows"], metric, str(base))
        cmp.check_metric(new_agg["rows"], metric, str(new))
    if args.changelog_entry:
        return _changelog_entry(base_agg, new_agg, (base, new), args.metric)
    result = cmp.compare_rows(base_agg["rows"], new_agg["rows"], args.metric)
    scores = _scores(((base, base_agg), (new, new_agg)))
    if fields is not None:  # stdout is the object's alone: no tables
        fields.update(compare={"base": str(base), "new": str(new), "metric": args.metric,
                               **cmp.to_json(result),
                               **({} if scores is None else
                                  {"accuracy": eval_compare.to_json(*scores[0])})})
        _refuse_empty(result, base, new)
        _plots(base_agg, new_agg, args)
        report_json.finish(fields)
        return 0
    label = cmp.METRIC_LABELS[args.metric]
    headers, rows = ["Sequence", "Parallelism", "Concurrency", "Base", "New", "Change"], cmp.table_rows(result)
    if scores is not None:  # one run's accuracy holds for every cell: its change on each row
        headers, change = [*headers, "Accuracy"], eval_compare.change_cell(*scores[0])
        rows = [[*row, change] for row in rows]
    table(f"{label}: base {run_title(base_agg)} -> new {run_title(new_agg)}", headers, rows)
    if result.unmatched:
        table("not compared", ["Reason", "Concurrency", "Cells"],
              [[u.side, u.concurrency, u.detail] for u in result.unmatched])
    stdout_console().print(printable(cmp.summary(result)), markup=False, highlight=False)
    accuracy = _accuracy(scores)
    target = json_file(args)
    if target is not None:
        write_output_json(target, {**cmp.to_json(result), **accuracy}, flag="--json-file",
                          sort_keys=True)
        info(f"comparison written to {target}")
    _refuse_empty(result, base, new)
    _plots(base_agg, new_agg, args)
    return 0


def _changelog_entry(base_agg: dict[str, Any], new_agg: dict[str, Any],
                     paths: tuple[Path, Path], metric: str) -> int:
    """The entry alone on stdout, after one blank line: `>> perf-changelog.yaml` appends it.
    Its key is NEW's InferenceX master-config entry, what an InferenceX checkout's own check
    accepts; a run of a recipe without one is keyed by the recipe's name (m3patch's recipes/).
    An entry that states no change (no cell of the same shape) is refused, as the table is."""
    new = paths[1]
    name, entry = new_agg.get("recipe_name"), new_agg.get("inferencex_config_entry")
    key = entry if isinstance(entry, str) and entry else name
    if not isinstance(key, str) or not RECIPE_KEY.fullmatch(key):
        msg = f"{new}: NEW names no m3patch recipe ({key!r}), so the entry has no config key"
        raise UsageError(msg, hint="give an m3patch run folder or aggregate.json as NEW")
    _refuse_empty(cmp.compare_rows(base_agg["rows"], new_agg["rows"], metric), *paths)
    if key == name:
        warn(f"{new}: its recipe {name!r} names no inferencex.config-entry, so the entry's key is "
             "the m3patch recipe name; an InferenceX checkout's own check accepts only its "
             "master-config entries (set inferencex.config-entry in the recipe and re-aggregate: "
             f"m3patch bench RECIPE --resume --run-dir {new})")
    stdout_console().print("\n" + printable(changelog_entry(base_agg, new_agg, key).rstrip("\n")),
                           markup=False, highlight=False, soft_wrap=True)
    return 0


def _refuse_empty(result: cmp.Comparison, base: Path, new: Path) -> None:
    """A comparison that gave no cell a change figure checked nothing: a regression gate built
    on it must fail, never pass (ResultsInvalid, exit 17)."""
    if cmp.changed(result) == 0:
        msg = f"{base} vs {new}: {cmp.summary(result)}"
        raise ResultsInvalid(msg, hint="compare runs of the same shapes (ISL/OSL, parallelism, "
                             "concurrency); the 'not compared' table says what differs")


def _plots(base_agg: dict[str, Any], new_agg: dict[str, Any], args: argparse.Namespace) -> None:
    if args.plots:
        runs = [PlotRun("base", run_title(base_agg), tuple(base_agg["rows"])),
                PlotRun("new", run_title(new_agg), tuple(new_agg["rows"]))]
        for path in draw(runs, args.plots):
            info(f"plot written to {path}")
