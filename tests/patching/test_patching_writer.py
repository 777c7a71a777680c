"""Transactions: SIGKILL at every write step, injected I/O errors, 8 concurrent ranks.

The fault hook (M3PATCH_FAULT, test-only, documented in m3patch/patching/writer.py) stops the real apply
at a chosen write step; a real process cannot be made to die at an exact step otherwise.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import REPO, CliRunner, replace_file

from m3patch import errors
from m3patch.patching.api import apply_series, revert_series, verify_tree
from m3patch.patching.ledger import read_ledger, state_dir
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import verify_against_record
from m3patch.patching.series import load_series


def leftovers(root: Path) -> list[Path]:
    return [p for p in (root / "vllm").rglob("*") if ".m3patch-" in p.name]


@pytest.mark.slow
def test_sigkill_at_every_write_step_then_rerun_completes(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    args = ("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    tree, series = tree_at(vllm_tree), load_series(test_series)
    killed_at = []
    for step in range(1, 60):
        fault = m3patch_cli(*args, env={"M3PATCH_FAULT": f"kill-after:{step}"})
        if fault.returncode == 0:
            break  # the apply has fewer write steps than `step`: every one was covered
        assert fault.returncode == -signal.SIGKILL, fault.stderr
        killed_at.append(step)
        journal = (state_dir(vllm_tree) / "journal.json").exists()
        rerun = apply_series(tree, series)  # the next run, in-process to keep the test quick
        assert journal == any("interrupted transaction" in n for n in rerun.notes), step
        assert verify_tree(tree, series).ok, step
        assert leftovers(vllm_tree) == [] and read_ledger(vllm_tree) is not None
        assert not (state_dir(vllm_tree) / "journal.json").exists()
        revert_series(tree, series)
        assert verify_against_record(vllm_tree) == [], step
    # journal, 4 backup links + 4 staged files, journal, 5 renames, ledger, cleanup, unlink
    assert killed_at == list(range(1, 19))


@pytest.mark.slow
def test_sigkill_at_every_write_step_of_a_revert_then_rerun_reverts(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    args = ("revert", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    tree, series = tree_at(vllm_tree), load_series(test_series)
    killed_at = []
    for step in range(1, 60):
        apply_series(tree, series)
        assert verify_tree(tree, series).ok
        fault = m3patch_cli(*args, env={"M3PATCH_FAULT": f"kill-after:{step}"})
        if fault.returncode == 0:
            break  # the revert has fewer write steps than `step`: every one was covered
        assert fault.returncode == -signal.SIGKILL, fault.stderr
        killed_at.append(step)
        journal = (state_dir(vllm_tree) / "journal.json").exists()
        rerun = m3patch_cli(*args)  # the next run is a real CLI run, as a job would do it
        assert rerun.returncode == 0, (step, rerun.stderr)
        assert journal == ("interrupted transaction" in rerun.stderr), step
        assert verify_against_record(vllm_tree) == [], step
        assert not (vllm_tree / "vllm/m3patch_test_added.py").exists(), step
        assert leftovers(vllm_tree) == [] and read_ledger(vllm_tree) is None, step
        assert not (state_dir(vllm_tree) / "journal.json").exists(), step
    # journal, 4 backup links + 4 staged pre-images, journal, 5 renames/unlinks, ledger removal,
    # cleanup, journal removal
    assert killed_at == list(range(1, 19))
    assert verify_against_record(vllm_tree) == []


@pytest.mark.parametrize("step", [1, 2, 5, 9, 10, 12, 15])
def test_io_error_mid_apply_restores_every_file(
        vllm_tree: Path, test_series: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M3PATCH_FAULT", f"fail-after:{step}")
    with pytest.raises(errors.TreeIOError, match="every file restored"):
        apply_series(tree_at(vllm_tree), load_series(test_series))
    assert verify_against_record(vllm_tree) == []
    assert not (vllm_tree / "vllm/m3patch_test_added.py").exists()
    assert leftovers(vllm_tree) == [] and read_ledger(vllm_tree) is None
    assert not (state_dir(vllm_tree) / "journal.json").exists()


def test_eight_concurrent_ranks(vllm_tree: Path, test_series: Path) -> None:
    cmd = [sys.executable, "-m", "m3patch", "apply", "--vllm-root", str(vllm_tree),
           "--series", str(test_series)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(8)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [rc for rc, _, _ in results] == [0] * 8, [err for _, _, err in results]
    lasts = sorted(out.strip().splitlines()[-1] for _, out, _ in results)
    assert lasts == ["m3patch: 0 applied, 3 already applied, 0 conflicts"] * 7 + [
        "m3patch: 3 applied, 0 already applied, 0 conflicts"]
    tree, series = tree_at(vllm_tree), load_series(test_series)
    assert verify_tree(tree, series).ok


def test_lock_timeout(vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    from m3patch.patching.writer import tree_lock

    with tree_lock(vllm_tree):  # hold the lock in this process; the CLI must give up
        proc = m3patch_cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series),
                           env={"M3PATCH_LOCK_TIMEOUT": "0.3"})
    assert proc.returncode == errors.LockTimeout.exit_code, proc.stderr
    assert "held the lock" in proc.stderr


def _journal(root: Path, body: dict[str, object]) -> None:
    state_dir(root).mkdir(exist_ok=True)
    (state_dir(root) / "journal.json").write_text(json.dumps(body))


def _entry(path: str, **over: object) -> dict[str, object]:
    name = path.rsplit("/", 1)[-1]
    return {"path": path, "pre": None, "post": "a" * 64, "stage": f".{name}.m3patch-new",
            "backup": None, **over}


def _files(folder: Path) -> dict[Path, bytes]:
    """Every file's bytes but the tree lock, which apply and revert create (documented)."""
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != "lock"}


HOSTILE_JOURNALS = {
    "stage phase deletes a file outside": (
        {"phase": "stage", "entries": [{"path": "../victim.txt", "pre": None, "post": "x",
                                        "stage": None, "backup": None}], "ledger": None}, 9),
    "commit phase swaps onto a file outside": (
        {"phase": "commit", "entries": [_entry("../victim.txt")], "ledger": None}, 9),
    "absolute path": ({"phase": "stage", "entries": [_entry("/etc/passwd")], "ledger": None}, 9),
    "state folder": ({"phase": "stage", "entries": [_entry("vllm/.m3patch/ledger.json")],
                      "ledger": None}, 9),
    "folder not above the file": (
        {"phase": "stage", "entries": [_entry("vllm/new/x.py", made_dirs=["vllm/model_executor"])],
         "ledger": None}, 7),
    "malformed hash": ({"phase": "stage", "entries": [_entry("vllm/x.py", post="x")],
                        "ledger": None}, 7),
    "stage name elsewhere": ({"phase": "commit", "entries": [_entry("vllm/logger.py",
                              stage="../../victim.txt")], "ledger": None}, 7),
    "unknown phase": ({"phase": "swap", "entries": [], "ledger": None}, 7),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_JOURNALS))
def test_hostile_journal_is_refused_and_nothing_outside_changes(
        case: str, vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    """The engine's own journal is untrusted: status only reports it, apply/revert refuse it
    before acting on any entry, and nothing inside or outside the tree changes."""
    body, code = HOSTILE_JOURNALS[case]
    victim = vllm_tree.parent / "victim.txt"
    victim.write_text("precious\n")
    _journal(vllm_tree, body)
    before = _files(vllm_tree.parent)
    args = ("--vllm-root", str(vllm_tree), "--series", str(test_series))
    status = m3patch_cli("status", *args)
    assert status.returncode == errors.PatchConflict.exit_code, status.stderr
    assert "interrupted transaction" in status.stderr
    for command in ("apply", "revert"):
        proc = m3patch_cli(command, *args)
        assert proc.returncode == code, (command, proc.stderr)
        assert "journal" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert _files(vllm_tree.parent) == before and victim.read_text() == "precious\n"


def test_ledger_folders_not_above_their_file_are_never_removed(
        vllm_tree: Path, test_series: Path) -> None:
    """A ledger naming a folder that is not above its own file is corrupt: revert ignores it
    (files win) and removes no folder it names."""
    tree, series = tree_at(vllm_tree), load_series(test_series)
    apply_series(tree, series)
    keep = vllm_tree / "vllm" / "empty_folder_of_the_user"
    keep.mkdir()
    ledger = json.loads((state_dir(vllm_tree) / "ledger.json").read_text())
    ledger["files"][0]["dirs"] = ["vllm/empty_folder_of_the_user"]
    (state_dir(vllm_tree) / "ledger.json").write_text(json.dumps(ledger))
    revert_series(tree, series)
    assert keep.is_dir()
    assert verify_against_record(vllm_tree) == []


def test_the_ledger_written_with_one_row_per_file_is_the_same_document() -> None:
    """The ledger's rows are written by json's C encoder, one line per file, around an indented
    head; the document must be the one the indented encoder gives, whatever a value holds
    (the mark that stands for the rows included)."""
    import json
    from dataclasses import asdict

    from m3patch.patching.ledger import LedgerFile, new_ledger, parse_ledger
    from m3patch.patching.states import Mode

    rows = (LedgerFile("vllm/x/a.py", None, "a" * 64, ("vllm/x",)),
            LedgerFile("vllm/b.py", "b" * 64, None))
    for files in ((), rows):
        ledger = new_ledger(series="s", mode=Mode.STRICT, vllm_version="0.33.0",
                            vllm_commit=None, version_note='\x00files\x00 "files": [',
                            patches=("p1",), files=files)
        data = ledger.to_bytes()
        assert json.loads(data) == json.loads(json.dumps(asdict(ledger), indent=2))
        assert data.count(b"\n") == 14 + len(files) + (1 if files else 0)  # a row a line
        assert parse_ledger(data, "ledger.json") == ledger


@pytest.mark.parametrize("step", [5, 12])
def test_a_hand_edit_after_an_interrupted_transaction_is_never_overwritten(
        step: int, vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    """An apply killed while preparing (step 5: rolled back) or committing (step 12: finished),
    then vllm/logger.py edited by hand. Before: the next run put the backup (or the staged
    post-image) over the edit, exit 0. Now 5 naming the file, the edit and the journal kept;
    once the file is restored the same command finishes or undoes the transaction."""
    args = ("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    logger = vllm_tree / "vllm" / "logger.py"
    original = logger.read_bytes()
    fault = m3patch_cli(*args, env={"M3PATCH_FAULT": f"kill-after:{step}"})
    assert fault.returncode == -signal.SIGKILL, fault.stderr
    journal = state_dir(vllm_tree) / "journal.json"
    assert journal.exists()
    replace_file(logger, b"# my own logger\n")  # never through the cache's hard link
    refused = m3patch_cli(*args)
    assert refused.returncode == errors.PatchConflict.exit_code, refused.stderr
    assert "logger.py: changed after an interrupted transaction" in refused.stderr
    assert logger.read_bytes() == b"# my own logger\n" and journal.exists()
    status = m3patch_cli("status", *args[1:])  # read-only: the same refusal, not "apply completes"
    assert status.returncode == errors.PatchConflict.exit_code, status.stderr
    assert "logger.py: changed after an interrupted transaction" in status.stderr
    command = refused.stderr.split("`")[1]  # the hint's way on, followed as a user would
    assert command.startswith("mv ") and command.endswith(str(logger)), refused.stderr
    subprocess.run(command, shell=True, check=True)
    assert logger.read_bytes() == original
    rerun = m3patch_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert "interrupted transaction" in rerun.stderr and not journal.exists()
    assert leftovers(vllm_tree) == []
    assert verify_tree(tree_at(vllm_tree), load_series(test_series)).ok
