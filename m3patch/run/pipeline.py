"""The one run pipeline that `serve --bench`, `bench` and `ci` compose.

    RunSpec (frozen: recipe, run folder, python, cells, resume, url, plots, ...)
      -> recipe        load and validate the recipe, pick the cells and the run folder
      -> apply-verify  patching.api.ensure_series on the tree `python` imports; RUN/ledger.json
      -> serve         ServeSession: start vLLM, ready, marker gate (or an external --url server)
      -> sweep         every cell against it (bench.sweep); the server stops when this ends
      -> results       every cell file and aggregate.json read back; the plots (bench.runner)
      -> eval          the recipe's accuracy gate (m3patch.eval) on the same server: after the
                       results (the sweep's files are kept when it fails), or before the sweep
                       (`eval.when: before-sweep`); no step when the recipe has no eval section
      => StepResults (run.steps), reduced once to the exit code

The recipe step decides where the server comes from (ServerSource): a resumed run whose cells
are all finished skips apply-verify and serve (nothing to measure: no server start to pay, no
tree touched); `--url` skips apply-verify (not a tree m3patch patches). Each step method returns
a StepDone or raises; what a step leaves for the next is typed (RunPlan, ServerHandle).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from types import TracebackType

from m3patch.bench import spec as bench_spec
from m3patch.bench.agentic.lmcache import row_servers
from m3patch.bench.agentic.preflight import preflight as agentic_preflight
from m3patch.bench.agentic.synthesize import trace_key
from m3patch.bench.aggregate import AGGREGATE_JSON, attach_evals
from m3patch.bench.cells import AgenticCell, AnyCell
from m3patch.bench.client import BenchTarget
from m3patch.bench.results import gated_by
from m3patch.bench.runner import (
    all_finished,
    check_results,
    health_probe,
    plot_run,
    reaggregate,
    resolve_run_dir,
    select_cells,
    sweep_session,
)
from m3patch.bench.sweep import DEFAULT_SEED, SweepSettings, print_results, refuse_overwrite
from m3patch.errors import M3PatchError, ResultsInvalid, UsageError
from m3patch.eval.compare import EVALS, gate_text, read_evals, record_path
from m3patch.eval.harness import Endpoint
from m3patch.eval.runner import EVAL_DIR, evaluate, preflight
from m3patch.fsio import read_json, write_bytes_atomic
from m3patch.output import info, table
from m3patch.patching.ledger import digest
from m3patch.patching.locate import VllmTree
from m3patch.recipe.agentic import AGENTIC_CODING, KvOffload, lmcache_transfer_mode
from m3patch.recipe.evals import EvalWhen
from m3patch.recipe.loader import Recipe, load_recipe
from m3patch.recipe.model_files import require_present
from m3patch.recipe.server_groups import ServerGroup, server_groups
from m3patch.run.steps import Step, StepDone, StepStatus
from m3patch.serving.launch_plan import ensure_tree
from m3patch.serving.server_session import ServeSession
from m3patch.serving.vllm_parser import LaunchCheck, check_launch

LEDGER_COPY = "ledger.json"
SERVERS_DIR = "servers"  # one folder per server group (server.log, serve.json) when regions split


class RunCommand(str, Enum):
    """Who composes the run: it names the default run folder and the interpreter fallback."""

    BENCH = "bench"
    SERVE = "serve"
    CI = "ci"


class ServerSource(str, Enum):
    """Where the sweep's server comes from; decided once, by the recipe step."""

    LAUNCHED = "launched"  # m3patch applies, verifies, starts and gates it
    EXTERNAL = "external"  # --url: started elsewhere, only watched through /health
    NONE = "none"  # resumed and every cell already has a valid result: nothing to measure


SKIP_REASONS = {
    ServerSource.EXTERNAL: "--url: a server m3patch neither patches nor starts",
    ServerSource.NONE: "every cell already has a valid result: no server needed",
}


class PlotMode(str, Enum):
    REQUIRED = "required"  # ci: the plots are artifacts; no matplotlib fails the results step
    OPTIONAL = "optional"  # bench, serve --bench: no matplotlib only warns
    OFF = "off"  # --no-plots


@dataclass(frozen=True)
class RunSpec:
    recipe_path: Path
    command: RunCommand
    run_dir: Path | None = None  # None: the command's default folder under the recipe's results
    python: str | None = None  # None: the recipe's target.python
    port: int | None = None
    only: tuple[str, ...] = ()  # cell ids; empty: every cell
    resume: bool = False
    seed: int = DEFAULT_SEED
    url: str | None = None  # sweep a server m3patch neither starts nor gates
    plots: PlotMode = PlotMode.OPTIONAL
    echo: bool = False  # echo the server log live


@dataclass(frozen=True)
class RunPlan:
    """What the recipe step decided, read by every later step."""

    recipe: Recipe
    run_dir: Path
    python: str
    cells: tuple[AnyCell, ...]
    settings: SweepSettings
    source: ServerSource


@dataclass(frozen=True)
class ServerHandle:
    """The server the sweep talks to and how it is watched between cells."""

    target: BenchTarget
    check: Callable[[], None]
    label: str  # provenance's `server`
    warnings: tuple[dict[str, object], ...] = ()  # `warn` markers seen by readiness


def warning_note(warnings: tuple[dict[str, object], ...]) -> str:
    """The run summary's mention of `warn` markers: id and fix, never a failure."""
    parts = [f"{w['id']}" + (f" (fix: {w['fix']})" if w.get("fix") else "") for w in warnings]
    return f"; WARNING: {', '.join(parts)}" if parts else ""


def echo_server_line(line: str) -> None:
    print(f"  | {line}", file=sys.stderr, flush=True)


def show_scores(name: str, run_dir: Path, *, after_sweep: bool) -> None:
    """After the sweep: aggregate.json takes the eval's scores and the results table prints
    once, with them beside its rows. Before it: the scores alone (the sweep's table will carry
    them; a failed gate stops the run before any sweep)."""
    if after_sweep and (run_dir / AGGREGATE_JSON).is_file():
        aggregate = attach_evals(run_dir)
        rows = aggregate["rows"]
        kind = ("agentic-coding results (AIPerf)" if rows and all(
            r.get("scenario_type") == AGENTIC_CODING for r in rows) else "per-GPU results")
        print_results(rows, f"{name}: {kind}", aggregate[EVALS])
        return
    path = record_path(run_dir)
    if path is not None:
        table(f"{name}: accuracy", ["Task", "Metric", "Score", "Samples", "Gate"],
              [[r["task"], r["metric"], f"{r['score']:.4f}", str(r["n_eff"]), gate_text(r)]
               for r in read_evals(path)])


def default_run_dir(recipe: Recipe, command: RunCommand, *, resume: bool) -> Path:
    """Under the recipe's results: serve-TIME, ci-NAME-TIME, or bench's UTC time (--resume:
    the newest earlier run)."""
    if command is RunCommand.SERVE:
        return recipe.results_dir / time.strftime("serve-%Y%m%d-%H%M%S")
    if command is RunCommand.CI:
        return recipe.results_dir / f"ci-{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return resolve_run_dir(recipe, None, resume)


def resolve_python(recipe: Recipe, spec: RunSpec) -> str:
    python = spec.python or recipe.target.python
    if python is None and spec.command in (RunCommand.SERVE, RunCommand.CI):
        # Inside a pinned image m3patch is installed into the Python that runs vLLM; ci has
        # always applied to the tree that interpreter imports, serve has always served from it.
        return sys.executable
    if python is None:
        msg = f"{recipe.path}: no interpreter for the bench client (target.python unset)"
        raise UsageError(msg, hint="pass --python PATH (the venv whose vLLM serves)")
    return python


def plan_run(spec: RunSpec) -> RunPlan:
    """The recipe step's decisions; refuses to overwrite results before anything is touched."""
    recipe = load_recipe(spec.recipe_path)
    cells = select_cells(recipe, spec.only)
    run_dir = spec.run_dir or default_run_dir(recipe, spec.command, resume=spec.resume)
    python = resolve_python(recipe, spec)
    rerun = f"m3patch bench {spec.recipe_path} --resume --run-dir {run_dir}"
    # ci's pass vouches for a gated server of this recipe: a resumed ci keeps only such cells
    gated = digest(Path(recipe.path).read_bytes()) if spec.command is RunCommand.CI else None
    settings = SweepSettings(run_dir, spec.resume, spec.seed, rerun, gated)
    refuse_overwrite(settings)
    return RunPlan(recipe, run_dir, python, cells, settings,
                   server_source(spec, recipe, run_dir, cells, gated))


def server_source(spec: RunSpec, recipe: Recipe, run_dir: Path, cells: tuple[AnyCell, ...],
                  gated: str | None) -> ServerSource:
    """NONE only when nothing is left to measure or judge: every cell kept, and where the run
    has an eval step, a recorded eval that passed on a gated server of this recipe."""
    agentic = recipe.sweep.agentic
    key = trace_key(agentic.trace) if agentic is not None else None
    if (spec.resume and all_finished(run_dir, cells, gated, key)
            and not _eval_left(spec, recipe, run_dir)):
        return ServerSource.NONE
    return ServerSource.EXTERNAL if spec.url else ServerSource.LAUNCHED


def _eval_left(spec: RunSpec, recipe: Recipe, run_dir: Path) -> bool:
    """The run's eval step still has to run: a failed, foreign or unreadable eval/eval.json is
    never carried over as a pass (the gate runs again on a server)."""
    if spec.command is RunCommand.BENCH or recipe.eval is None:
        return False
    try:
        record = read_json(run_dir / EVAL_DIR / "eval.json", error=ResultsInvalid, hint="",
                           expect=dict)
    except ResultsInvalid:
        return True
    sha = digest(Path(recipe.path).read_bytes())
    return not (record.get("passed") is True and gated_by(record.get("provenance"), sha))


class RunPipeline:
    """One run's steps; use as a context manager so a started server is always stopped."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.plan: RunPlan | None = None
        self.ledger_sha256: str | None = None
        self.located: VllmTree | None = None  # the tree the launch check found; apply patches it
        self.checks: tuple[LaunchCheck, ...] = ()  # each server group's launch check, in order
        self.server: ServerHandle | None = None
        self._held = contextlib.ExitStack()  # the ServeSession, from serve to the end of sweep
        self.warnings: list[dict[str, object]] = []  # `warn` markers of every server started
        self._made_run_dir: Path | None = None  # the run folder, when this run created it

    def __enter__(self) -> RunPipeline:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._held.close()
        finally:
            self._drop_unused_run_dir()

    @property
    def planned(self) -> RunPlan:
        assert self.plan is not None, "the recipe step runs first"
        return self.plan

    def steps(self) -> list[Step]:
        steps: list[Step] = [("recipe", self.load), ("apply-verify", self.apply_verify),
                             ("serve", self.serve), ("sweep", self.sweep), ("results", self.results)]
        when = self.eval_when()
        if when is EvalWhen.BEFORE_SWEEP:
            steps.insert(3, ("eval", self.eval))
        elif when is EvalWhen.AFTER_SWEEP:
            steps.append(("eval", self.eval))
        return steps

    def eval_when(self) -> EvalWhen | None:
        """Where the eval step goes (serve --bench and ci; bench only sweeps); a recipe that
        does not load fails in the recipe step."""
        if self.spec.command is RunCommand.BENCH:
            return None
        try:
            spec = load_recipe(self.spec.recipe_path).eval
        except M3PatchError:
            return None
        return spec.when if spec is not None else None

    def _evaluates_after_sweep(self) -> bool:
        spec = self.planned.recipe.eval
        return (self.spec.command is not RunCommand.BENCH and spec is not None
                and spec.when is EvalWhen.AFTER_SWEEP)

    def load(self) -> StepDone:
        self.plan = plan_run(self.spec)
        where = f"{self.plan.recipe.name} (series {self.plan.recipe.series_dir}"
        scenario = self.plan.recipe.sweep.agentic
        if scenario is not None and self.plan.source is not ServerSource.NONE:
            # First, being cheap: AIPerf at its pin, the trace offline, LMCache at its pin.
            where += "; " + agentic_preflight(scenario, self.plan.recipe.path, self.plan.python)
        if self.plan.source is ServerSource.LAUNCHED:
            # Before apply-verify: a node without the weights fails here with the tree untouched.
            require_present(self.plan.recipe)
            # vLLM's own parser, before the tree changes or the node loads anything: every
            # server form the sweep will start.
            first, *rest = self.groups()
            checks = [check_launch(first.recipe, self.plan.python, defer=True)]
            self.located = checks[0].tree
            checks += [check_launch(g.recipe, self.plan.python, located=self.located, defer=True)
                       for g in rest]
            self.checks = tuple(checks)  # in group order; a ServeSession runs what each owes
            where += f"; model files on disk; launch checked by {checks[0].checked_by}"
            if len(checks) > 1:
                where += f" ({len(checks)} server groups)"
        if (self.plan.recipe.eval is not None and self.plan.source is not ServerSource.NONE
                and self.spec.command is not RunCommand.BENCH):
            # Before any server time: lm-eval installed, every eval dataset cached (offline).
            preflight(self.plan.recipe.eval, self.plan.recipe.path)
        self._make_run_dir(self.plan.run_dir)  # only now: a refused run leaves no folder behind
        return StepDone(where + ")")

    def _make_run_dir(self, run_dir: Path) -> None:
        if not run_dir.is_dir():
            self._made_run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)

    def _drop_unused_run_dir(self) -> None:
        """The run folder this run made, when a later step failed before writing anything into
        it: an empty folder would pass for a run (`bench --resume` looks for the newest)."""
        if self._made_run_dir is None:
            return
        with contextlib.suppress(OSError):  # not empty (or gone): it is the run's, kept
            self._made_run_dir.rmdir()

    def _kv_offload(self, group: ServerGroup) -> KvOffload | None:
        """The KV-offload tier of an agentic group's cells (one tier per server form)."""
        tiers = {c.kv_offload for c in self.planned.cells
                 if isinstance(c, AgenticCell) and c.cell_id in group.cell_ids}
        return tiers.pop() if len(tiers) == 1 else None

    def groups(self) -> tuple[ServerGroup, ...]:
        """The servers this run starts: one per distinct server form among its cells."""
        plan = self.planned
        return server_groups(plan.recipe, plan.cells)

    def apply_verify(self) -> StepDone:
        plan = self.planned
        if plan.source is not ServerSource.LAUNCHED:
            return StepDone(SKIP_REASONS[plan.source], status=StepStatus.SKIPPED)
        ensured = ensure_tree(plan.recipe, plan.python, self.located)
        write_bytes_atomic(plan.run_dir / LEDGER_COPY, ensured.ledger_bytes)
        self.ledger_sha256 = ensured.ledger_sha256
        summary = ensured.report.summary().removeprefix("m3patch: ")
        info(summary)
        return StepDone(summary, (LEDGER_COPY,))

    def serve(self) -> StepDone:
        plan = self.planned
        if plan.source is ServerSource.NONE:
            return StepDone(SKIP_REASONS[plan.source], status=StepStatus.SKIPPED)
        if plan.source is ServerSource.EXTERNAL:
            assert self.spec.url is not None
            self.server = self._external(self.spec.url.rstrip("/"))
            return StepDone(f"{self.server.target.base_url}/health answers")
        groups = self.groups()
        if len(groups) > 1:
            return StepDone(f"{len(groups)} server groups: the sweep step starts, gates and stops "
                            "one server per group")
        session = self._start(groups[0], plan.run_dir)
        target = BenchTarget(Path(session.python), session.base_url, session.model, session.tokenizer)
        warnings = tuple(session.warnings_json())
        self.warnings += warnings
        self.server = ServerHandle(target, session.check_alive, bench_spec.SESSION_SERVER, warnings)
        info(session.ready_line())
        return StepDone(session.ready_line() + warning_note(warnings), ("server.log", "serve.json"))

    def _start(self, group: ServerGroup, run_dir: Path) -> ServeSession:
        recipe = group.recipe
        kv = self._kv_offload(group)
        if kv is not None and kv.backend == "lmcache":
            # One LMCache server per TP rank, healthy before vLLM starts; stopped after it.
            scenario = recipe.sweep.agentic
            assert scenario is not None
            tp = recipe.parallelism.tp
            logs = self._held.enter_context(row_servers(
                kv, scenario.dram_budget_gb(tp), tp, self.planned.python, run_dir,
                lmcache_transfer_mode(recipe.target.platform)))
            info(f"{len(logs)} LMCache server(s) healthy (logs {run_dir})")
        if 1 <= group.index <= len(self.checks):
            checked = self.checks[group.index - 1]  # what the recipe step's check left owed
        else:  # a server no group planned (the eval server's): checked the same way, now
            checked = check_launch(recipe, self.planned.python, located=self.located, defer=True)
        return self._held.enter_context(ServeSession(
            recipe, run_dir, python=self.planned.python, port=self.spec.port,
            echo=echo_server_line if self.spec.echo else None, ledger_sha256=self.ledger_sha256,
            launch_check=checked))

    def _sweep_groups(self, groups: tuple[ServerGroup, ...]) -> StepDone:
        """One server per group: started, gated, swept, stopped; then one aggregate of all."""
        plan = self.planned
        measured = kept = 0
        for group in groups:
            cells = tuple(c for c in plan.cells if c.cell_id in group.cell_ids)
            folder = plan.run_dir / SERVERS_DIR / f"group-{group.index}"
            with self._held:
                session = self._start(group, folder)
                warnings = tuple(session.warnings_json())
                self.warnings += warnings
                info(f"group {group.index}/{len(groups)}: {session.ready_line()}"
                     + warning_note(warnings))
                target = BenchTarget(Path(session.python), session.base_url, session.model,
                                     session.tokenizer)
                # The folder's only results are this run's earlier groups (plan_run refused any
                # others before a server started): keep them, as a resume would.
                settings = plan.settings if group.index == 1 else replace(plan.settings,
                                                                          resume=True)
                outcome = sweep_session(group.recipe, plan.python, target, settings, cells,
                                        session.check_alive, server_warnings=warnings)
            measured, kept = measured + len(outcome.measured), kept + len(outcome.skipped)
        reaggregate(plan.recipe, plan.run_dir, plan.cells,
                    note=f"aggregated {len(plan.cells)} cells of {len(groups)} server groups")
        return StepDone(f"{len(groups)} server groups, each gated; {measured} cell(s) measured, "
                        f"{kept} kept", ("cells", "aggregate.json", "aggregate.csv", SERVERS_DIR))

    def _eval_server(self) -> ServerHandle:
        plan = self.planned
        group = ServerGroup(0, plan.recipe, ())
        session = self._start(group, plan.run_dir / SERVERS_DIR / "eval")
        info(f"eval server: {session.ready_line()}")
        target = BenchTarget(Path(session.python), session.base_url, session.model,
                             session.tokenizer)
        return ServerHandle(target, session.check_alive, bench_spec.SESSION_SERVER)

    def _external(self, base_url: str) -> ServerHandle:
        plan = self.planned
        model = plan.recipe.model
        check = health_probe(base_url, f"{plan.settings.rerun_hint} --url {base_url}")
        check()
        target = BenchTarget(Path(plan.python), base_url, model.served_name, model.tokenizer)
        return ServerHandle(target, check, f"external {base_url} (not started or gated by m3patch)")

    def sweep(self) -> StepDone:
        """Sweep the cells; the server is stopped when the sweep ends, passed or not."""
        plan = self.planned
        # An eval after the sweep needs the same server: the eval step stops it then.
        keep = (self._evaluates_after_sweep() and plan.source is not ServerSource.NONE
                and plan.recipe.sweep.agentic is None)  # agentic: the eval starts its own
        with contextlib.nullcontext() if keep else self._held:
            if plan.source is ServerSource.NONE:
                reaggregate(plan.recipe, plan.run_dir, plan.cells)
                return StepDone(f"{len(plan.cells)} cell(s) kept; aggregated without a server")
            groups = self.groups() if plan.source is ServerSource.LAUNCHED else ()
            if len(groups) > 1:
                return self._sweep_groups(groups)
            assert self.server is not None, "the serve step runs first"
            outcome = sweep_session(plan.recipe, plan.python, self.server.target, plan.settings,
                                    plan.cells, self.server.check, server=self.server.label,
                                    server_warnings=self.server.warnings,
                                    show_table=not self._evaluates_after_sweep())
        return StepDone(f"{len(outcome.measured)} cell(s) measured, {len(outcome.skipped)} kept",
                        ("cells", "aggregate.json", "aggregate.csv"))

    def results(self) -> StepDone:
        run_dir = self.planned.run_dir
        cells, aggregate = check_results(run_dir)
        plots = ([] if self.spec.plots is PlotMode.OFF
                 else plot_run(run_dir, aggregate, required=self.spec.plots is PlotMode.REQUIRED))
        names = tuple(p.relative_to(run_dir).as_posix() for p in (*cells, *plots))
        return StepDone(f"{len(cells)} cells, aggregate ok, {len(plots)} plots",
                        ("aggregate.json", "aggregate.csv", *names))

    def eval(self) -> StepDone:
        """The accuracy gate on the sweep's server; the server stops when this ends."""
        plan = self.planned
        assert plan.recipe.eval is not None, "only recipes with an eval section have this step"
        own = self._evaluates_after_sweep() or plan.recipe.sweep.agentic is not None
        with self._held if own else contextlib.nullcontext():
            if plan.source is ServerSource.NONE:
                return StepDone(SKIP_REASONS[plan.source], status=StepStatus.SKIPPED)
            if self.server is None and plan.recipe.sweep.agentic is not None:
                # The agentic servers ran the sweep's form (per concurrency, synthetic
                # acceptance): the gate gets the recipe's own server, with real verification,
                # as InferenceX's EVAL_ONLY job does.
                self.server = self._eval_server()
            assert self.server is not None, "the serve step runs first"
            target = self.server.target
            provenance = bench_spec.provenance(plan.recipe, plan.python, self.server.label)
            endpoint = Endpoint(target.base_url, target.served_model, plan.recipe.deadlines.request_s)
            after_sweep = self._evaluates_after_sweep()
            try:
                outcome = evaluate(plan.recipe.eval, plan.run_dir, endpoint,
                                   check_server=self.server.check, provenance=provenance)
            except BaseException:
                # The gate's own failure is the run's answer: a table that cannot be shown
                # (an aggregate made unreadable meanwhile) must not replace it.
                with contextlib.suppress(ResultsInvalid):
                    show_scores(plan.recipe.name, plan.run_dir, after_sweep=after_sweep)
                raise
            show_scores(plan.recipe.name, plan.run_dir, after_sweep=after_sweep)
        return StepDone(outcome.summary(), (f"{EVAL_DIR}/eval.json",))
