"""`m3patch serve RECIPE`: apply + verify the series, then run `vllm serve` behind a marker gate.

Runs in the foreground until Ctrl-C (exit 130), `--hold` seconds pass, or, with
`--stop-after-ready`, right after the server is ready and every required marker was seen.
`--bench` runs the run pipeline instead (m3patch.run.pipeline, as `m3patch bench` does, with
this command's run folder and live log): every cell, results, plots, then stop.

A recipe with a `topology:` runs a multi-node set: `--role R --rank K` runs one node (what a
Slurm task runs: m3patch.cluster.node); without them every node runs on this host under the set
supervisor (m3patch.cluster.local_launcher). Both share the run folder's rendezvous.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from m3patch.cluster import rendezvous as rv
from m3patch.cluster.local_launcher import run_set
from m3patch.cluster.node import NodeRun
from m3patch.cluster.node_plan import require_node, require_topology
from m3patch.cluster.slurm import sbatch_script
from m3patch.commands.flags import add_python_flag, port_number
from m3patch.commands.recipe import show_plan
from m3patch.errors import Interrupted, UsageError, interrupt, raise_if_interrupted
from m3patch.fsio import write_output
from m3patch.output import info
from m3patch.patching import report_json
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path
from m3patch.run.pipeline import RunCommand, RunPipeline, RunSpec, default_run_dir, echo_server_line
from m3patch.run.steps import finish, run_steps
from m3patch.serving.launch_plan import prepare_tree
from m3patch.serving.server_session import ServeSession

HEALTH_PROBE_EVERY_S = 10.0  # a hung engine stays alive; only /health shows it
WATCH_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_path,
                        help="recipe YAML or shipped recipe name (e.g. cpu_tiny_moe)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the launch with the target vLLM's own parser, print the argv, env and "
                             "markers; apply and start nothing")
    add_python_flag(parser, what="interpreter whose vLLM tree is patched and launched "
                                 "(default: the recipe's target.python, else this one)")
    parser.add_argument("--allow-other-vllm", action="store_true",
                        help="with --dry-run: check with --python's vLLM parser even when it is "
                             "not the version the recipe's series targets (else exit 4), and "
                             "against the series' shipped spec too")
    parser.add_argument("--port", type=port_number, help="override server.port")
    parser.add_argument("--run-dir", type=Path,
                        help="folder for server.log and serve.json (default: RESULTS/serve-TIME)")
    parser.add_argument("--stop-after-ready", action="store_true",
                        help="stop (exit 0) once ready with every required marker seen")
    parser.add_argument("--hold", type=float, metavar="SECONDS",
                        help="serve this long after ready, watching markers, then stop (exit 0)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the server log")
    parser.add_argument("--role", help="topology recipes: run this role's node only (with --rank)")
    parser.add_argument("--rank", type=int, help="topology recipes: the node's rank in its role "
                                                 "(0-based; with --role)")
    parser.add_argument("--set-id", help="topology recipes: the set's identity, the same on "
                                          "every node (default: M3PATCH_SET_ID, else the Slurm "
                                          "job id; the local launcher makes a fresh one)")
    parser.add_argument("--write-sbatch", type=Path, metavar="FILE",
                        help="topology recipes: write the Slurm job (one serve --role/--rank task "
                             "per node, then the sweep from the batch step) to FILE; start nothing")
    parser.add_argument("--bench", action="store_true",
                        help="once ready: run the recipe's sweep (as `m3patch bench`) into the "
                             "run folder, plot, then stop")
    parser.add_argument("--json", action="store_true",
                        help="when the server has stopped (or on an error): one JSON object on "
                             "stdout (docs/json-schema.md)")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM (Slurm's step kill after srun forwarded the first) must not break
    # the stop ladder this one starts; a SIGKILL still ends a stop that hangs.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    msg = f"received signal {signal.Signals(signum).name}; the server was stopped"
    interrupt(Interrupted(msg, hint="re-run the same `m3patch serve` command"))


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        show_plan(args.recipe, args.python, args.port, check=True,
                  other_vllm=args.allow_other_vllm)
        return 0
    if args.allow_other_vllm:
        msg = "--allow-other-vllm is for --dry-run: apply refuses a vLLM the series does not target"
        raise UsageError(msg, hint=f"m3patch serve {args.recipe} --dry-run --allow-other-vllm")
    signal.signal(signal.SIGTERM, _on_sigterm)  # SIGINT already raises KeyboardInterrupt (130)
    if (args.role is None) != (args.rank is None):
        msg = "--role and --rank go together"
        raise UsageError(msg, hint="e.g. --role head --rank 0")
    recipe = load_recipe(args.recipe)
    if args.role is not None or recipe.topology is not None or args.write_sbatch is not None:
        return _serve_topology(args)
    if args.bench:
        return _serve_bench(args)
    return _serve(args)


def _serve_bench(args: argparse.Namespace) -> int:
    """The run pipeline with this command's server settings: every cell, plots, then stop."""

    fields = report_json.start("serve") if args.json else None
    spec = RunSpec(args.recipe, RunCommand.SERVE, run_dir=args.run_dir, python=args.python,
                   port=args.port, echo=not args.quiet)
    with RunPipeline(spec) as pipeline:
        outcome = run_steps(pipeline.steps(), lambda _result: None)
    if fields is not None:
        plan = pipeline.plan
        report_json.attach_run(fields, recipe=args.recipe,
                               run_dir=None if plan is None else plan.run_dir,
                               python=None if plan is None else plan.python,
                               ledger_sha256=pipeline.ledger_sha256,
                               steps=[r.to_json() for r in outcome.results])
    code = finish(outcome)
    if fields is not None:
        report_json.finish(fields)
    return code


def _serve(args: argparse.Namespace) -> int:

    fields = report_json.start("serve") if args.json else None
    recipe = load_recipe(args.recipe)
    run_dir = args.run_dir or default_run_dir(recipe, RunCommand.SERVE, resume=False)
    python = args.python or recipe.target.python or sys.executable  # as ServeSession picks it
    ledger, checked = None, None
    if fields is not None:  # prepared here, so an error from the server still names the tree
        report_json.attach_run(fields, recipe=args.recipe, run_dir=run_dir, python=python,
                               ledger_sha256=None, steps=[])
        ledger, checked = prepare_tree(recipe, python)
        report_json.attach_run(fields, recipe=args.recipe, run_dir=run_dir, python=python,
                               ledger_sha256=ledger, steps=[])
    session = ServeSession(recipe, run_dir, python=python, port=args.port,
                           echo=None if args.quiet else echo_server_line, ledger_sha256=ledger,
                           launch_check=checked)
    with session:
        info(session.ready_line())
        if fields is not None:
            fields.update(ready=session.ready_line(), base_url=session.base_url,
                          log=str(session.log_path))
        if not args.stop_after_ready:
            _watch(session, args.hold)
    info(f"stopped; log {session.log_path}")
    if fields is not None:
        report_json.finish(fields)
    return 0


def _watch(session: ServeSession, hold: float | None) -> None:
    """Until `hold` seconds pass (or forever): the server alive, and answering every so often."""
    end = None if hold is None else time.monotonic() + hold
    next_probe = time.monotonic() + HEALTH_PROBE_EVERY_S
    while end is None or time.monotonic() < end:
        session.check_alive()
        if time.monotonic() >= next_probe:
            session.check_answering()
            next_probe = time.monotonic() + HEALTH_PROBE_EVERY_S
        raise_if_interrupted()  # a stop signal a best-effort step swallowed still stops serving
        time.sleep(WATCH_S)


def _serve_topology(args: argparse.Namespace) -> int:
    """One node (--role/--rank), or every node of the set on this host."""
    recipe = load_recipe(args.recipe)
    if args.bench or args.port is not None:
        msg = "--bench and --port are single-server options; a topology sets its own ports"
        raise UsageError(msg, hint=f"m3patch recipe show {args.recipe}")
    run_dir = args.run_dir or default_run_dir(recipe, RunCommand.SERVE, resume=False)
    if args.write_sbatch is not None:
        require_topology(recipe)
        # Slurm opens the job's --output file in RUN/logs before the script runs: it must exist.
        try:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            msg = f"cannot create the job's log folder {run_dir / 'logs'}: {exc.strerror}"
            raise UsageError(msg, hint="pass a writable --run-dir on a file system every node "
                                       "shares") from None
        write_output(args.write_sbatch, sbatch_script(recipe, run_dir.resolve()).encode(),
                     flag="--write-sbatch")
        info(f"wrote {args.write_sbatch}: submit with `sbatch {args.write_sbatch}` (RUN {run_dir} "
             "must be on a file system every node shares)")
        return 0
    set_id = rv.set_identity(args.set_id)
    if args.role is None:
        return run_set(recipe, run_dir, args.python, args.hold, args.stop_after_ready, set_id)
    node = require_node(recipe, args.role, args.rank)
    if set_id is None:
        msg = (f"node {node} has no set identity: every node of one set must carry the same one, "
               "so that records of another set or an earlier run are never taken for its own")
        raise UsageError(msg, hint=f"export {rv.SET_ID_VAR}={rv.fresh_set_id()} on every node "
                                   "(a Slurm job uses its job id), or pass --set-id")
    python = args.python or recipe.target.python or sys.executable
    runner = NodeRun(recipe, node, run_dir, python, set_id,
                     echo=None if args.quiet else echo_server_line)
    return runner.run(args.hold, args.stop_after_ready)
