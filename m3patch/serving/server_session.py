"""ServeSession: a patched, verified, marker-gated `vllm serve` for the length of a `with` block.

    from m3patch.recipe.loader import load_recipe
    from m3patch.serving.server_session import ServeSession

    recipe = load_recipe(Path("recipes/cpu_tiny_moe.yaml"))
    with ServeSession(recipe, run_dir) as server:       # apply + verify, start, ready, markers
        server.base_url, server.model, server.tokenizer   # for `vllm bench serve`
        server.check_alive()                             # between sweep cells: raises on a
                                                         # dead server, a forbidden marker, or
                                                         # the recipe's run deadline
    # leaving the block stops the whole process group (also on an exception)

Entering applies and verifies the recipe's series first; vLLM never starts on a tree that failed.
A caller that already did (the run pipeline's apply-verify step) passes `ledger_sha256=` instead.
Errors are M3PatchError subclasses (exit codes in errors.py): ServerExited 10, ReadyTimeout 11,
MarkerMissing 12, MarkerForbidden 13, RunDeadline 15, ServerDied 18. `server.log` and
`serve.json` (argv, env overrides, marker counts, timings) are written to `run_dir`.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from m3patch.errors import LaunchRejected, M3PatchError, RunDeadline, ServerDied
from m3patch.fsio import write_json_atomic
from m3patch.markers import MarkerChecker, MarkerWarning
from m3patch.output import warn
from m3patch.recipe.loader import Recipe
from m3patch.serving.launch_plan import LaunchPlan, plan_launch, prepare_tree
from m3patch.serving.supervisor import Supervisor
from m3patch.serving.vllm_parser import LaunchCheck, ParserCheck

HEALTH_PROBE_TIMEOUT_S = 5.0
READY_SETTLE_S = 1.0  # lets the log reader drain lines written just before the ready reply


class ServeSession:
    def __init__(self, recipe: Recipe, run_dir: Path, *, python: str | None = None,
                 port: int | None = None, echo: Callable[[str], None] | None = None,
                 ledger_sha256: str | None = None,
                 launch_check: LaunchCheck | None = None) -> None:
        self.recipe = recipe
        self.verified_ledger = ledger_sha256  # the tree was already ensured, with this ledger
        self.launch_check = launch_check  # the caller's check, with that ledger
        self.parser_check: ParserCheck | None = None
        self.run_dir = Path(run_dir)
        self.python = python or recipe.target.python or sys.executable
        self.port = port or recipe.port
        self.echo = echo
        self.plan: LaunchPlan | None = None
        self.supervisor: Supervisor | None = None
        self.ready_s: float | None = None
        self.exit_status: int | None = None
        self._started = 0.0
        self._last_answer: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.recipe.host}:{self.port}"

    @property
    def model(self) -> str:
        return self.recipe.model.served_name

    @property
    def tokenizer(self) -> str:
        return self.recipe.model.tokenizer

    @property
    def log_path(self) -> Path:
        return self.run_dir / "server.log"

    def ready_line(self) -> str:
        found = self.warnings()
        warned = f", {len(found)} warning marker(s)" if found else ""
        return (f"ready in {self.ready_s:.1f} s at {self.base_url} (model {self.model}); "
                f"markers ok{warned}; log {self.log_path}")

    def warnings(self) -> list[MarkerWarning]:
        """`warn` markers seen so far: reported, never a stop."""
        return [] if self.supervisor is None else self.supervisor.checker.warnings()

    def warnings_json(self) -> list[dict[str, object]]:
        return [w.to_json(str(self.log_path)) for w in self.warnings()]

    def __enter__(self) -> ServeSession:
        self._started = time.monotonic()
        ledger = self._ledger()
        self.plan = plan_launch(self.recipe, self.python, self.port, self.log_path, ledger)
        for marker_id, reason in self.recipe.marker_waivers:
            warn(f"recipe {self.recipe.path} waives series marker {marker_id!r}: {reason}")
        checker = MarkerChecker(self.plan.markers, log_name=str(self.log_path))
        self.supervisor = Supervisor(self.plan.spec, checker, echo=self.echo)
        try:
            self.parser_check = self._owed_parser_check()
            self.supervisor.start()
            self.ready_s = self._wait_ready()
            time.sleep(READY_SETTLE_S)
            self.supervisor.gate_markers(hint=self.plan.marker_hint)
            for found in self.warnings():
                warn(found.line(str(self.log_path)))
            self._last_answer = time.monotonic()  # readiness included a real completion
        except BaseException:
            self.stop()
            raise
        return self

    def _ledger(self) -> str:
        if self.verified_ledger is None:
            ledger, self.launch_check = prepare_tree(self.recipe, self.python)
            return ledger
        return self.verified_ledger  # the caller checked the model before it ensured the tree

    def _owed_parser_check(self) -> ParserCheck | None:
        """vLLM's own parser, when the launch check left it owed: a child beside the server."""
        check = self.launch_check
        if check is None or not check.parser_owed or check.tree is None:
            return None
        return ParserCheck(self.recipe, self.python, check.tree)

    def _wait_ready(self) -> float:
        """Ready, and vLLM's own parser agreeing: its rejection (24) wins over what it explains
        (the server's own exit on the same bad option, a marker the option caused)."""
        assert self.supervisor is not None
        parser = self.parser_check
        try:
            ready_s = self.supervisor.wait_ready(None if parser is None else parser.poll)
        except M3PatchError as exc:
            if parser is not None and not isinstance(exc, LaunchRejected):
                parser.verdict()
            raise
        if parser is not None:
            parser.verdict()
        return ready_s

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def check_alive(self) -> None:
        assert self.supervisor is not None, "use ServeSession as a context manager"
        self.supervisor.check_alive()
        elapsed = time.monotonic() - self._started
        if elapsed > self.recipe.deadlines.run_s:
            msg = (f"run of recipe {self.recipe.path} passed its deadline "
                   f"({elapsed:.0f} s > deadlines.run-s {self.recipe.deadlines.run_s:.0f})")
            raise RunDeadline(msg, hint="raise deadlines.run-s or shorten the sweep")

    def check_answering(self) -> None:
        """While holding a server: it must keep answering /health, not just stay alive.

        A hung engine (alive, never answering) is only caught this way. One probe may fail
        under load; the server is declared dead when nothing answered for a whole
        `deadlines.request-s`.
        """
        now = time.monotonic()
        try:
            with urllib.request.urlopen(f"{self.base_url}/health",
                                        timeout=HEALTH_PROBE_TIMEOUT_S) as reply:
                if reply.status == 200:
                    self._last_answer = now
        except (urllib.error.URLError, OSError):
            pass
        silent = now - (self._last_answer or now)
        if silent > self.recipe.deadlines.request_s:
            msg = (f"vllm serve is alive but has not answered {self.base_url}/health for "
                   f"{silent:.0f} s (deadlines.request-s {self.recipe.deadlines.request_s:.0f})")
            raise ServerDied(msg, hint=f"see {self.log_path}; then: m3patch serve {self.recipe.path}")

    def stop(self) -> None:
        if self.parser_check is not None:
            self.parser_check.stop()
        if self.supervisor is None or self.supervisor.proc is None:
            return
        if self.exit_status is None:
            self.exit_status = self.supervisor.stop()
            self._write_summary()

    def _write_summary(self) -> None:
        assert self.plan is not None and self.supervisor is not None
        checker = self.supervisor.checker
        summary = {
            "recipe": str(self.recipe.path), "pgid": self.supervisor.pgid, "argv": list(self.plan.spec.argv),
            "env": dict(self.plan.env_overrides), "base_url": self.base_url,
            "ready_s": self.ready_s, "exit_status": self.exit_status,
            "markers": {m.id: checker.counts.get(m.id, 0) for m in self.plan.markers},
            # what the server printed after m3patch's stop mark (its shutdown): never judged
            "markers_after_stop": dict(checker.after_stop),
            "warnings": self.warnings_json(),
            "violation": None if self.supervisor.violation is None
            else self.supervisor.violation.where(str(self.log_path)),
        }
        write_json_atomic(self.run_dir / "serve.json", summary)
