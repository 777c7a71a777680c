"""`m3patch status` exit codes: 0 for a pristine or (partly) applied tree, 5 for a file that
neither apply nor revert can take; the report is printed in both cases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from core_helpers import REPO, CliRunner, replace_file

from m3patch import errors
from m3patch.patching.api import apply_series
from m3patch.patching.locate import tree_at
from m3patch.patching.series import load_series
from m3patch.patching.writer import tree_lock

LOGGER = "vllm/logger.py"


def status(cli: CliRunner, root: Path, series: Path, *extra: str) -> tuple[int, str, str]:
    proc = cli("status", *extra, "--vllm-root", str(root), "--series", str(series))
    return proc.returncode, proc.stdout, proc.stderr


def test_pristine_partly_and_fully_applied_trees_exit_0(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    assert status(m3patch_cli, vllm_tree, test_series)[0] == 0
    tree, series = tree_at(vllm_tree), load_series(test_series)
    apply_series(tree, series, only=["version-banner"])  # one patch in, two pending: consistent
    code, out, err = status(m3patch_cli, vllm_tree, test_series, "--json")
    assert code == 0, err
    assert json.loads(out)["conflicts"] == []
    apply_series(tree, series)
    assert status(m3patch_cli, vllm_tree, test_series)[0] == 0


def test_partially_applied_file_exits_5_after_printing_the_report(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    logger = vllm_tree / LOGGER
    line = '_DATE_FORMAT = "%m-%d %H:%M:%S"\n'
    mark = '_M3PATCH_TEST_MARK = "m3patch[test-series]: logger patched"\n'
    replace_file(logger, logger.read_text().replace(line, line + mark, 1).encode())
    code, out, err = status(m3patch_cli, vllm_tree, test_series)
    assert code == errors.PatchConflict.exit_code, err
    assert "logger-marks hunk 2 @ line 419: pending" in out
    assert "1 file(s) that neither apply nor revert can take: vllm/logger.py" in err
    assert "fix: restore them with `pip install --force-reinstall" in err
    code, out, _ = status(m3patch_cli, vllm_tree, test_series, "--json")
    assert code == errors.PatchConflict.exit_code
    assert json.loads(out)["conflicts"] == [LOGGER]


def test_drifted_file_exits_5(vllm_tree: Path, test_series: Path,
                              m3patch_cli: CliRunner) -> None:
    version = vllm_tree / "vllm/version.py"
    replace_file(version, version.read_bytes() + b"# edited by hand\n")
    code, _, err = status(m3patch_cli, vllm_tree, test_series)
    assert code == errors.PatchConflict.exit_code, err
    assert "vllm/version.py" in err and "Traceback" not in err


def test_offset_applied_tree_is_applied_not_drifted(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    logger = vllm_tree / LOGGER
    replace_file(logger, b"# two lines a nightly added\n\n" + logger.read_bytes())
    apply_series(tree_at(vllm_tree), load_series(test_series), mode="offset")
    code, out, err = status(m3patch_cli, vllm_tree, test_series, "--json")
    assert code == 0, err
    files = {f["path"]: f["state"] for f in json.loads(out)["files"]}
    assert files[LOGGER] == "applied-offset"


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_status_and_verify_report_an_interrupted_transaction_and_write_nothing(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    """A real apply killed mid-commit leaves a journal; the read side only reports it (exit 5,
    exit 6), and the tree, journal included, is byte-identical afterwards; apply recovers."""
    args = ("--vllm-root", str(vllm_tree), "--series", str(test_series))
    killed = m3patch_cli("apply", *args, env={"M3PATCH_FAULT": "kill-after:12"})
    assert killed.returncode < 0, killed.stderr
    before = _tree_bytes(vllm_tree)
    assert "vllm/.m3patch/journal.json" in before
    code, out, err = status(m3patch_cli, vllm_tree, test_series, "--json")
    assert code == errors.PatchConflict.exit_code, err
    assert json.loads(out)["interrupted"] is True and "interrupted transaction" in err
    verify = m3patch_cli("verify", *args)
    assert verify.returncode == errors.VerifyFailed.exit_code, verify.stderr
    assert "interrupted transaction is pending" in verify.stderr
    assert _tree_bytes(vllm_tree) == before
    rerun = m3patch_cli("apply", "--verify", *args)
    assert rerun.returncode == 0 and "interrupted transaction" in rerun.stderr, rerun.stderr
    assert status(m3patch_cli, vllm_tree, test_series)[0] == 0


def test_dry_runs_take_no_lock_and_create_nothing(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    args = ("--vllm-root", str(vllm_tree), "--series", str(test_series))
    before = _tree_bytes(vllm_tree)
    dry = m3patch_cli("apply", "--dry-run", *args)
    assert dry.returncode == 0 and "would write vllm/logger.py" in dry.stdout, dry.stderr
    assert not (vllm_tree / "vllm/.m3patch").exists()
    assert _tree_bytes(vllm_tree) == before
    assert m3patch_cli("apply", *args).returncode == 0
    before = _tree_bytes(vllm_tree)
    dry = m3patch_cli("revert", "--dry-run", *args)
    assert dry.returncode == 0 and "would restore vllm/logger.py" in dry.stdout, dry.stderr
    assert _tree_bytes(vllm_tree) == before


MODELOPT = "vllm/model_executor/layers/quantization/modelopt.py"
FUSED_MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
# written by one patch only (fused_moe.py is written by two: the table lookup and split-K)
MTP = "vllm/models/minimax_m3/amd/mtp.py"


def test_a_missing_patched_file_is_named_and_exits_5(
        vllm_tree: Path, m3patch_cli: CliRunner) -> None:
    """Status comes from the files, never from absence: with the shipped 0.33.0 series, a deleted
    patched file is "missing" (exit 5, named) on a patched tree and on a pristine tree without a
    ledger; verify agrees (exit 6)."""
    series = str(REPO / "patches" / "vllm-0.33.0")
    args = ("--vllm-root", str(vllm_tree), "--series", series)
    for applied in (True, False):
        if applied:
            assert m3patch_cli("apply", *args).returncode == 0
        before = (vllm_tree / MODELOPT).read_bytes()
        (vllm_tree / MODELOPT).unlink()
        code, out, err = status(m3patch_cli, vllm_tree, Path(series), "--json")
        assert code == errors.PatchConflict.exit_code, err
        report = json.loads(out)
        assert report["conflicts"] == [MODELOPT]
        state = next(f["state"] for f in report["files"] if f["path"] == MODELOPT)
        assert state == "missing" and MODELOPT in err
        verify = m3patch_cli("verify", *args)
        assert verify.returncode == errors.VerifyFailed.exit_code
        assert f"{MODELOPT}: missing" in verify.stderr
        assert m3patch_cli("revert", *args).returncode == errors.PatchConflict.exit_code
        replace_file(vllm_tree / MODELOPT, before)
        assert m3patch_cli("revert", *args).returncode == 0


def test_a_file_edited_after_apply_is_modified_not_upstreamed(
        vllm_tree: Path, m3patch_cli: CliRunner) -> None:
    """A hand edit outside every hunk of a file m3patch wrote leaves each hunk's new lines in
    place, which alone reads as "upstreamed, can drop". The ledger says m3patch wrote the file:
    it is "modified after apply", never droppable, and apply/verify/status all refuse it."""
    series = REPO / "patches" / "vllm-0.33.0"
    args = ("--vllm-root", str(vllm_tree), "--series", str(series))
    assert m3patch_cli("apply", *args).returncode == 0
    edited = vllm_tree / MTP
    replace_file(edited, b"# edited by hand after apply\n" + edited.read_bytes())
    code, out, err = status(m3patch_cli, vllm_tree, series, "--json")
    assert code == errors.PatchConflict.exit_code, err
    report = json.loads(out)
    assert {f["path"]: f["state"] for f in report["files"]}[MTP] == "modified-after-apply"
    mtp = next(p for p in report["patches"] if p["id"] == "minimax-m3-mtp-fse")
    assert mtp["can_drop"] is False and mtp["state"] == "conflict"
    assert not any("re-applies" in n for n in report["notes"])
    verify = m3patch_cli("verify", *args)
    assert verify.returncode == errors.VerifyFailed.exit_code
    assert f"{MTP}: modified after apply" in verify.stderr
    again = m3patch_cli("apply", *args)
    assert again.returncode == errors.PatchConflict.exit_code
    assert f"{MTP}: modified after apply" in again.stderr
    (vllm_tree / "vllm/.m3patch/ledger.json").unlink()  # no record of who wrote it
    code, out, _ = status(m3patch_cli, vllm_tree, series, "--json")
    report = json.loads(out)
    assert {f["path"]: f["state"] for f in report["files"]}[MTP] == "upstreamed"
    mtp = next(p for p in report["patches"] if p["id"] == "minimax-m3-mtp-fse")
    assert mtp["can_drop"] is True and code == errors.PatchConflict.exit_code


def test_process_edges_end_in_documented_codes(
        vllm_tree: Path, m3patch_cli: CliRunner) -> None:
    """A closed stdout pipe (141), an ASCII locale (exit as usual, escaped text), a bad
    $M3PATCH_LOCK_TIMEOUT (usage, 2) and SIGTERM (130): never 70, never a traceback."""
    series = str(REPO / "patches" / "vllm-0.33.0")
    args = ("--vllm-root", str(vllm_tree), "--series", series)
    for bad in ("abc", "nan", "-1"):
        proc = m3patch_cli("apply", *args, env={"M3PATCH_LOCK_TIMEOUT": bad})
        assert proc.returncode == errors.UsageError.exit_code, proc.stderr
        assert "$M3PATCH_LOCK_TIMEOUT" in proc.stderr
    assert m3patch_cli("apply", *args).returncode == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("M3PATCH_", "LC_", "PYTHONIO"))}
    ascii_env = {**env, "LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    cmd = [sys.executable, "-m", "m3patch", "status", *args]
    proc = subprocess.run(cmd, capture_output=True, env=ascii_env, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr  # the table's ellipsis used to end in 70
    closed = subprocess.Popen([*cmd, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env, cwd=REPO)
    assert closed.stdout is not None and closed.stderr is not None
    closed.stdout.close()  # the reader is gone before the first byte is written
    stderr = closed.stderr.read().decode()
    assert closed.wait(timeout=60) == 141, stderr
    assert "Traceback" not in stderr and "internal error" not in stderr
    with tree_lock(vllm_tree):  # the CLI waits for the lock; then the job is cancelled
        waiting = subprocess.Popen([sys.executable, "-m", "m3patch", "revert", *args],
                                   stderr=subprocess.PIPE, env=env, cwd=REPO, text=True)
        time.sleep(3)
        waiting.send_signal(signal.SIGTERM)
        _, stderr = waiting.communicate(timeout=60)
    assert waiting.returncode == errors.Interrupted.exit_code, stderr
    assert "received signal SIGTERM" in stderr and "Traceback" not in stderr
