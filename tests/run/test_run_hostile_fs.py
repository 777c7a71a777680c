"""serve, bench and ci (the real entry points, in a child process) on a hostile file system: the
real 0.33.0 tree behind a read-only bind mount or on a full disk, the run folder on a full disk,
and a revert racing the preflight's apply --verify. Each ends in its documented code (7 for a
tree or run folder the disk refuses, 10 once the tree is ready: this interpreter has no vLLM, so
the real serve step fails when it starts the server) with one message, no traceback, no 70, and
nothing half-written. Tests that mount skip, saying why, where the sandbox cannot."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from core_helpers import (
    REPO,
    TEST_SERIES,
    fill,
    mounted,
    read_only_view,
    revert_before_first_verify,
)

from m3patch import errors
from m3patch.main import main
from m3patch.patching.ledger import ledger_path
from m3patch.patching.pristine import verify_against_record

TREE_IO = errors.TreeIOError.exit_code
SERVER_EXITED = errors.ServerExited.exit_code
# the files the test series touches (a tree small enough for a 1 MiB tmpfs)
TOUCHED = ("vllm/__init__.py", "vllm/_version.py", "vllm/version.py", "vllm/logger.py",
           "vllm/tool_parsers/beam_tool_parser.py",
           "vllm/model_executor/layers/quantization/utils/configs/"
           "N=7168,K=256,device_name=NVIDIA_L20,dtype=fp8_w8a8,block_shape=[128,128].json")


def recipe(tmp_path: Path) -> Path:
    """The shipped CPU recipe on the 0.33.0 test series, a model folder the pre-apply check
    accepts, and this interpreter (no vLLM: the server start fails after the tree is ready)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["series"] = str(TEST_SERIES)
    data["target"].update({"vllm-version": "0.33.0", "python": sys.executable})
    data["model"]["source"] = str(model)
    data.pop("eval", None)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def m3patch(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    env.update(M3PATCH_VLLM_ROOT=str(root), M3PATCH_CRASH_DIR=str(root.parent / "crash"))
    return subprocess.run([sys.executable, "-m", "m3patch", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, check=False, timeout=120)


def entry_points(recipe_path: Path, runs: Path) -> dict[str, list[str]]:
    return {"ci": ["ci", str(recipe_path), "--run-dir", str(runs / "ci")],
            "bench": ["bench", str(recipe_path), "--run-dir", str(runs / "bench")],
            "serve": ["serve", str(recipe_path), "--run-dir", str(runs / "serve"),
                      "--stop-after-ready"]}


def assert_one_message(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert done.stderr.count("m3patch: error: ") == 1, done.stderr
    for needle in needles:
        assert needle in done.stderr, done.stderr


def ci_steps(run: Path) -> dict[str, tuple[str, int]]:
    summary = json.loads((run / "ci.json").read_text())
    return {s["name"]: (s["status"], s["exit_code"]) for s in summary["steps"]}


def no_partial_files(folder: Path) -> list[str]:
    """Staging and temporary names a half-finished write would leave."""
    return [str(p) for p in folder.rglob("*") if ".tmp" in p.name
            or p.name.endswith((".m3patch-new", ".m3patch-pre")) or p.name == "journal.json"]


def small_tree(pristine: Path, root: Path) -> None:
    for rel in TOUCHED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pristine / rel, root / rel)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "lock"}


# ------------------------------------------------------------- the tree on a read-only mount


def test_serve_bench_ci_on_a_read_only_unpatched_tree_exit_7(vllm_tree: Path,
                                                            tmp_path: Path) -> None:
    """The preflight's apply cannot write: 7 naming the mount's error, before any server; ci
    records apply-verify failed (7) and the serve step skipped; the dry run needs no write (0)."""
    path = recipe(tmp_path)
    with read_only_view(vllm_tree, tmp_path / "ro") as ro:
        for name, argv in entry_points(path, tmp_path / "runs").items():
            done = m3patch(ro, *argv)
            assert_one_message(done, TREE_IO, "Read-only file system", "vllm/.m3patch")
            assert not (tmp_path / "runs" / name / "server.log").exists(), name
        assert ci_steps(tmp_path / "runs" / "ci")["apply-verify"] == ("failed", TREE_IO)
        assert ci_steps(tmp_path / "runs" / "ci")["serve-sweep"] == ("skipped", 0)
        dry = m3patch(ro, "serve", str(path), "--dry-run")
        assert dry.returncode == 0, dry.stderr
    assert verify_against_record(vllm_tree) == [] and not (vllm_tree / "vllm/.m3patch").exists()


def test_ci_on_a_read_only_patched_tree_gets_past_apply_verify(vllm_tree: Path,
                                                              tmp_path: Path) -> None:
    """An image patched at build time, mounted read-only at run time: already applied and
    verified without the lock, the run's ledger is the tree's, the server step runs (10)."""
    path = recipe(tmp_path)
    assert m3patch(vllm_tree, "apply", "--verify", "--series", str(TEST_SERIES)).returncode == 0
    with read_only_view(vllm_tree, tmp_path / "ro") as ro:
        done = m3patch(ro, "ci", str(path), "--run-dir", str(tmp_path / "run"))
        assert_one_message(done, SERVER_EXITED, "vllm serve exited")
        steps = ci_steps(tmp_path / "run")
        assert steps["apply-verify"] == ("ok", 0) and steps["serve-sweep"] == ("failed", 10)
        assert "3 already applied" in done.stderr
    assert (tmp_path / "run" / "ledger.json").read_bytes() == ledger_path(vllm_tree).read_bytes()


# ------------------------------------------------------------- a full disk


def test_serve_bench_ci_with_the_tree_on_a_full_disk_restore_every_file(
        pristine_033: Path, tmp_path: Path) -> None:
    """The preflight's apply hits ENOSPC staging: 7, every file restored, no staging name or
    journal left; after space is freed the same ci gets past apply-verify."""
    path = recipe(tmp_path)
    with mounted("-t", "tmpfs", "-o", "size=1m", "tmpfs", target=tmp_path / "small") as fs:
        root = fs / "site-packages"
        small_tree(pristine_033, root)
        before = tree_bytes(root)
        filler = fill(fs, 8192)  # room for the lock and journal, not for the staged files
        for argv in entry_points(path, tmp_path / "runs").values():
            done = m3patch(root, *argv)
            assert_one_message(done, TREE_IO, "No space left on device", "every file restored")
            assert tree_bytes(root) == before and no_partial_files(root) == []
        assert ci_steps(tmp_path / "runs" / "ci")["apply-verify"] == ("failed", TREE_IO)
        filler.unlink()
        done = m3patch(root, "ci", str(path), "--run-dir", str(tmp_path / "again"))
        assert ci_steps(tmp_path / "again")["apply-verify"] == ("ok", 0), done.stderr


@pytest.mark.parametrize("leave", [4096, 16384])
def test_serve_bench_ci_with_the_run_folder_on_a_full_disk(vllm_tree: Path, tmp_path: Path,
                                                           leave: int) -> None:
    """Before: ci's job log (tee) and the server-log reader thread raised OSError: two
    tracebacks on stderr and the serve step recorded as an internal error (70). Now: 7 naming
    the run folder's file, no traceback, no temporary file left, the tree applied and verified."""
    path = recipe(tmp_path)
    with mounted("-t", "tmpfs", "-o", "size=1m", "tmpfs", target=tmp_path / "small") as fs:
        fill(fs, leave)
        for name, argv in entry_points(path, fs / "runs").items():
            done = m3patch(vllm_tree, *argv)
            assert_one_message(done, TREE_IO, "No space left on device", str(fs / "runs" / name))
            assert no_partial_files(fs) == [], name
            if (fs / "runs" / name / "ci.json").exists():  # written only when it fits
                assert all(code in (0, TREE_IO) for _, code in ci_steps(fs / "runs" / name).values())
    assert m3patch(vllm_tree, "verify", "--series", str(TEST_SERIES)).returncode == 0


def test_a_server_log_the_disk_refuses_fails_the_gate(tmp_path: Path) -> None:
    """The log is the marker gate's record: a log write the disk refuses ends the wait with 7
    naming the log, while the pipe is still drained (a blocked pipe would hang the server)."""
    from m3patch.markers import MarkerChecker
    from m3patch.serving.supervisor import LaunchSpec, Supervisor

    with mounted("-t", "tmpfs", "-o", "size=64k", "tmpfs", target=tmp_path / "small") as fs:
        fill(fs, 0)
        code = "import sys\nfor i in range(20000): print('line', i)\nsys.exit(3)\n"
        spec = LaunchSpec(argv=(sys.executable, "-c", code), env=dict(os.environ),
                          log_path=fs / "server.log", base_url="http://127.0.0.1:9",
                          served_model="m", ready_deadline_s=30, request_deadline_s=1,
                          fix_hint="m3patch serve R")
        supervisor = Supervisor(spec, MarkerChecker(()))
        supervisor.start()
        with pytest.raises(errors.TreeIOError, match="cannot write the server log: No space left"):
            supervisor.wait_ready()
        supervisor.stop()
        assert supervisor.proc is not None and supervisor.proc.returncode == 3  # ran to its end


# ------------------------------------------------------------- a revert racing the preflight


def test_ci_with_reverts_racing_its_apply_verify(vllm_tree: Path, tmp_path: Path) -> None:
    """Reverts in a loop while ci runs: its apply-verify (the lock-free try, then the retry
    under the tree lock) ends ok every time, with the ledger of a verified tree; never 6 or 7."""
    path = recipe(tmp_path)
    series = ["--series", str(TEST_SERIES)]
    assert m3patch(vllm_tree, "apply", *series).returncode == 0
    stop = threading.Event()
    reverts: list[int] = []

    def revert_loop() -> None:
        while not stop.is_set():
            reverts.append(m3patch(vllm_tree, "revert", *series).returncode)

    racer = threading.Thread(target=revert_loop)
    racer.start()
    try:
        runs = [m3patch(vllm_tree, "ci", str(path), "--run-dir", str(tmp_path / f"run{i}"))
                for i in range(4)]
    finally:
        stop.set()
        racer.join()
    for index, done in enumerate(runs):
        assert_one_message(done, SERVER_EXITED, "vllm serve exited")
        assert ci_steps(tmp_path / f"run{index}")["apply-verify"] == ("ok", 0)
        ledger = json.loads((tmp_path / f"run{index}" / "ledger.json").read_text())
        assert ledger["series"] == "test-series-0.33.0", ledger
    assert reverts and set(reverts) == {0}, reverts  # the racer really ran, and cleanly
    assert no_partial_files(vllm_tree) == []


def test_ci_with_a_revert_between_apply_and_verify_retries_under_the_lock(
        vllm_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race made certain: a revert lands between ci's lock-free apply and its verify. The
    apply-verify step re-runs holding the tree lock and ends ok, the run's ledger the tree's."""
    path = recipe(tmp_path)
    assert m3patch(vllm_tree, "apply", "--series", str(TEST_SERIES)).returncode == 0
    calls = revert_before_first_verify(monkeypatch)
    monkeypatch.setenv("M3PATCH_VLLM_ROOT", str(vllm_tree))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["ci", str(path), "--run-dir", str(tmp_path / "run")])
    assert code == SERVER_EXITED, err.getvalue()
    assert len(calls) == 2 and ci_steps(tmp_path / "run")["apply-verify"] == ("ok", 0)
    assert (tmp_path / "run" / "ledger.json").read_bytes() == ledger_path(vllm_tree).read_bytes()
