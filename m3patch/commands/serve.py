"""`m3patch serve RECIPE`: apply + verify the series, then run `vllm serve` behind a marker gate.

Runs in the foreground until Ctrl-C (exit 130), `--hold` seconds pass, or, with
`--stop-after-ready`, right after the server is ready and every required marker was seen.
`--bench` runs the run pipeline instead (m3patch.run.pipeline, as `m3patch bench` does, with
this command's run folder and live log): every cell, results, plots, then stop.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from types import FrameType

from m3patch.commands.recipe import show_plan
from m3patch.errors import Interrupted
from m3patch.output import info
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path
from m3patch.run.pipeline import RunCommand, RunPipeline, RunSpec, default_run_dir, echo_server_line
from m3patch.run.steps import finish, run_steps
from m3patch.serving.server_session import ServeSession

HEALTH_PROBE_EVERY_S = 10.0  # a hung engine stays alive; only /health shows it
WATCH_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_path,
                        help="recipe YAML or shipped recipe name (e.g. cpu_tiny_moe)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the launch with the target vLLM's own parser, print the argv, env and "
                             "markers; apply and start nothing")
    parser.add_argument("--python", help="interpreter whose vLLM tree is patched and launched "
                                         "(default: the recipe's target.python, else this one)")
    parser.add_argument("--port", type=int, help="override server.port")
    parser.add_argument("--run-dir", type=Path,
                        help="folder for server.log and serve.json (default: RESULTS/serve-TIME)")
    parser.add_argument("--stop-after-ready", action="store_true",
                        help="stop (exit 0) once ready with every required marker seen")
    parser.add_argument("--hold", type=float, metavar="SECONDS",
                        help="serve this long after ready, watching markers, then stop (exit 0)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the server log")
    parser.add_argument("--bench", action="store_true",
                        help="once ready: run the recipe's sweep (as `m3patch bench`) into the "
                             "run folder, plot, then stop")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    msg = f"received signal {signal.Signals(signum).name}; the server was stopped"
    raise Interrupted(msg, hint="re-run the same `m3patch serve` command")


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        show_plan(args.recipe, args.python, args.port, check=True)
        return 0
    signal.signal(signal.SIGTERM, _on_sigterm)  # SIGINT already raises KeyboardInterrupt (130)
    if args.bench:
        return _serve_bench(args)
    return _serve(args)


def _serve_bench(args: argparse.Namespace) -> int:
    """The run pipeline with this command's server settings: every cell, plots, then stop."""

    spec = RunSpec(args.recipe, RunCommand.SERVE, run_dir=args.run_dir, python=args.python,
                   port=args.port, echo=not args.quiet)
    with RunPipeline(spec) as pipeline:
        outcome = run_steps(pipeline.steps(), lambda _result: None)
    return finish(outcome)


def _serve(args: argparse.Namespace) -> int:

    recipe = load_recipe(args.recipe)
    run_dir = args.run_dir or default_run_dir(recipe, RunCommand.SERVE, resume=False)
    session = ServeSession(recipe, run_dir, python=args.python, port=args.port,
                           echo=None if args.quiet else echo_server_line)
    with session:
        info(session.ready_line())
        if args.stop_after_ready:
            return 0
        end = None if args.hold is None else time.monotonic() + args.hold
        next_probe = time.monotonic() + HEALTH_PROBE_EVERY_S
        while end is None or time.monotonic() < end:
            session.check_alive()
            if time.monotonic() >= next_probe:
                session.check_answering()
                next_probe = time.monotonic() + HEALTH_PROBE_EVERY_S
            time.sleep(WATCH_S)
    info(f"stopped; log {session.log_path}")
    return 0
