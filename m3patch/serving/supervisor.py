"""Run `vllm serve` as a supervised child: own process group, full log, marker gate, clean stop.

- The server starts in a new session, so its whole tree (API server, EngineCore, workers) shares
  one process group that `stop()` signals together: SIGINT, then SIGTERM, then SIGKILL
  (serving.processes.stop_group, with this module's grace periods).
- A reader thread copies every byte of output to the run's log file, feeds the marker checker,
  echoes lines for the live view, and on a forbidden marker interrupts the server at once.
- `stop()` first writes the stop mark (markers.STOP_MARK) into the log, under the same lock as
  the reader, so what the shutdown prints (vLLM logs EngineDeadError when its in-flight requests
  are aborted) is never judged: not live, not in serve.json, not by `markers check` later.
- Ready means `/health` answers 200 AND one real completion succeeds: on CPU, bf16 + eager passes
  `/health` and then dies on the first request, so health alone proves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from m3patch.errors import (
    ReadyTimeout,
    ServerDied,
    ServerExited,
    TreeIOError,
    UsageError,
    raise_if_interrupted,
)
from m3patch.markers import MarkerChecker, MarkerHit, forbidden_error
from m3patch.serving.processes import StopRung, start_group, stop_group

POLL_S = 0.5
TAIL_LINES = 15
STOP_GRACE_S = (20.0, 10.0, 5.0)  # after SIGINT, after SIGTERM, after SIGKILL
STOP_LADDER = tuple(StopRung(sig, grace) for sig, grace in zip(
    (signal.SIGINT, signal.SIGTERM, signal.SIGKILL), STOP_GRACE_S, strict=True))


@dataclass(frozen=True)
class LaunchSpec:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path
    base_url: str
    served_model: str
    ready_deadline_s: float
    request_deadline_s: float
    fix_hint: str  # the command that re-runs this launch, for error messages
    # more ports the process binds: (host, port, what binds it, how to move it)
    also_binds: tuple[tuple[str, int, str, str], ...] = ()


class Supervisor:
    """One server process tree. Use `start()`, `wait_ready()`, `check_alive()`, `stop()`."""

    def __init__(self, spec: LaunchSpec, checker: MarkerChecker,
                 echo: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.checker = checker
        self.echo = echo
        self.proc: subprocess.Popen[bytes] | None = None
        self.violation: MarkerHit | None = None
        self.log_error: OSError | None = None  # the server log the disk refused (then: 7)
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._log: BinaryIO | None = None  # open while the reader copies output into it
        self._stopping = False  # after we ask it to stop, shutdown noise is not a violation
        checker.on_line = self._on_line
        checker.marks_in_stream = False  # only the mark stop() writes ends the judging

    @property
    def pgid(self) -> int:
        assert self.proc is not None, "start() first"
        return self.proc.pid  # start_new_session makes the child its group's leader

    def start(self) -> None:
        _require_free_port(self.spec.base_url)
        for host, port, what, move in self.spec.also_binds:
            _require_free_bind(host, port, what, move)
        try:
            self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self.spec.log_path.open("wb")
        except OSError as exc:
            msg = f"{self.spec.log_path}: cannot write the server log: {exc.strerror}"
            raise TreeIOError(msg, hint="choose a writable results folder (--run-dir)") from None
        try:
            self.proc = start_group(
                self.spec.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=dict(self.spec.env))
        except OSError as exc:
            log.close()
            msg = f"cannot start {self.spec.argv[0]}: {exc.strerror}"
            raise ServerExited(msg, hint=self.spec.fix_hint) from None
        self._log = log
        self._reader = threading.Thread(target=self._pump, args=(log,), daemon=True)
        self._reader.start()

    def _pump(self, log: BinaryIO) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            with self._lock:  # the log and the checker see the same bytes in one order
                self._write_log(log, chunk)
                self._record(self.checker.feed(chunk))
        with self._lock:
            self._record(self.checker.finish())
            self._log = None
        with contextlib.suppress(OSError):  # a failed write was kept in log_error
            log.close()

    def _write_log(self, log: BinaryIO, chunk: bytes) -> None:
        """Keep reading the pipe when the disk refuses the log (a blocked pipe would hang the
        server): the first failure is kept, and the gate fails on it (the log is the record)."""
        if self.log_error is not None:
            return
        try:
            log.write(chunk)
            log.flush()
        except OSError as exc:
            self.log_error = exc

    def _mark_stop(self) -> None:
        """The stop mark, into the log and the checker together (nothing once output ended)."""
        with self._lock:
            if self._log is None:
                return
            data = self.checker.mark_stop()
            self._write_log(self._log, data)  # a full disk must not keep the server running

    def _on_line(self, line: str) -> None:
        self.tail.append(line)
        if self.echo is not None:
            self.echo(line)

    def _record(self, hits: list[MarkerHit]) -> None:
        if hits and self.violation is None and not self._stopping:
            self.violation = hits[0]
            self._signal(signal.SIGINT)  # the run is invalid: stop burning time on it

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def _tail_text(self) -> str:
        with self._lock:
            return "\n".join(self.tail)

    def raise_if_violation(self) -> None:
        if self.log_error is not None:
            msg = (f"{self.spec.log_path}: cannot write the server log: "
                   f"{self.log_error.strerror or self.log_error}; the server was stopped")
            raise TreeIOError(msg, hint=f"free space in {self.spec.log_path.parent} or choose "
                                        f"another --run-dir, then: {self.spec.fix_hint}")
        if self.violation is not None:
            raise forbidden_error(self.violation, str(self.spec.log_path),
                                  hint=f"fix the launch, then: {self.spec.fix_hint}")

    def gate_markers(self, *, hint: str) -> None:
        """At readiness: no forbidden marker so far, every required one seen (right count)."""
        with self._lock:
            self.checker.raise_if_forbidden(hint=hint)
            self.checker.raise_if_missing(hint=hint)

    def wait_ready(self, while_waiting: Callable[[], None] | None = None) -> float:
        """Seconds from start to ready; raises on exit, deadline or a forbidden marker, or what
        `while_waiting` (called every poll) raises."""
        start = time.monotonic()
        deadline = start + self.spec.ready_deadline_s
        while True:
            self.raise_if_violation()
            if while_waiting is not None:
                while_waiting()
            code = self.exit_code()
            if code is not None:
                self._join_reader()
                self.raise_if_violation()
                msg = (f"vllm serve exited with status {code} before it was ready "
                       f"(log {self.spec.log_path}); last lines:\n{self._tail_text()}")
                raise ServerExited(msg, hint=f"fix the error above, then: {self.spec.fix_hint}")
            if time.monotonic() >= deadline:
                msg = (f"vllm serve was not ready after {self.spec.ready_deadline_s:.0f} s "
                       f"(log {self.spec.log_path}); last lines:\n{self._tail_text()}")
                raise ReadyTimeout(msg, hint="raise deadlines.ready-s in the recipe, or fix the "
                                             f"start-up, then: {self.spec.fix_hint}")
            if self._probe(deadline):
                return time.monotonic() - start
            raise_if_interrupted()  # a stop signal a best-effort step swallowed
            time.sleep(POLL_S)

    def _probe(self, deadline: float) -> bool:
        timeout = max(0.5, min(self.spec.request_deadline_s, deadline - time.monotonic()))
        if not _ok(f"{self.spec.base_url}/health", min(timeout, 5.0)):
            return False
        body = {"model": self.spec.served_model, "prompt": "m3patch readiness probe",
                "max_tokens": 4, "temperature": 0}
        reply = _http(f"{self.spec.base_url}/v1/completions", body, timeout)
        return bool(reply and isinstance(reply.get("choices"), list) and reply["choices"])

    def complete(self, prompt: str, timeout_s: float) -> bool:
        """One 4-token greedy completion of `prompt`; whether it came back with a choice."""
        body = {"model": self.spec.served_model, "prompt": prompt, "max_tokens": 4,
                "temperature": 0}
        reply = _http(f"{self.spec.base_url}/v1/completions", body, timeout_s)
        return bool(reply and isinstance(reply.get("choices"), list) and reply["choices"])

    def answers(self, timeout_s: float) -> bool:
        """One liveness probe: /health and a 4-token greedy completion, each bounded by
        `timeout_s`. A hung engine keeps /health at 200; only a completion shows it."""
        return self._probe(time.monotonic() + timeout_s)

    def check_alive(self) -> None:
        """During a sweep: a forbidden marker or a dead server ends the run."""
        self.raise_if_violation()
        code = self.exit_code()
        if code is not None:
            self._join_reader()
            self.raise_if_violation()
            msg = (f"vllm serve died after it was ready (status {code}, log "
                   f"{self.spec.log_path}); last lines:\n{self._tail_text()}")
            raise ServerDied(msg, hint=f"fix the error above, then: {self.spec.fix_hint}")

    def stop(self) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL to the whole group; returns the leader's status."""
        if self.proc is None:
            return None
        self._stopping = True
        if self.proc.poll() is None:
            self._mark_stop()
        status = stop_group(self.proc, STOP_LADDER)
        self._join_reader()
        return status

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=10.0)


def _require_free_port(base_url: str) -> None:
    """Someone else's server on our port would answer our readiness probe: refuse to start."""
    parsed = urllib.parse.urlsplit(base_url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        if sock.connect_ex((host, port)) != 0:
            return
    msg = f"{host}:{port} is already in use by another process; vllm serve could not bind it"
    raise UsageError(msg, hint=f"stop that process, or pass --port N (e.g. --port {port + 1})")


def _require_free_bind(host: str, port: int, what: str, move: str) -> None:
    """A port the process binds besides its own: taken, the process would fail at start (a
    second vllm-router panics on its metrics port) with its reason deep in its log."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        if sock.connect_ex((host, port)) != 0:
            return
    msg = f"{host}:{port} is already in use by another process; {what} could not bind it"
    raise UsageError(msg, hint=f"stop that process, or {move}")


def _ok(url: str, timeout: float) -> bool:
    """GET answered 200, whatever the body (vLLM's /health is empty, vllm-router's plain text)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _http(url: str, body: dict[str, object] | None, timeout: float) -> dict[str, object] | None:
    """GET (body None) or POST JSON on loopback; the parsed reply on 200, else None."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            if reply.status != 200:
                return None
            raw = reply.read()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        parsed = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else {}
