"""apply / verify / status / revert on the real vLLM 0.33.0 tree with the test series."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import REPO, CliRunner, replace_file

from m3patch import errors
from m3patch.patching.api import apply_series, revert_series, tree_status, verify_tree
from m3patch.patching.ledger import ledger_path, read_ledger
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import verify_against_record
from m3patch.patching.series import load_series

LOGGER = "vllm/logger.py"
ADDED = "vllm/m3patch_test_added.py"
DELETED = "vllm/tool_parsers/beam_tool_parser.py"


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(mtime_ns, inode) of every file under root: proves 'writes nothing'."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_mtime_ns, st.st_ino)
    return out


def test_round_trip_is_byte_identical(vllm_tree: Path, test_series: Path) -> None:
    tree, series = tree_at(vllm_tree), load_series(test_series)
    report = apply_series(tree, series)
    assert report.applied == ("version-banner", "logger-marks", "logger-followup")
    assert (vllm_tree / ADDED).is_file() and not (vllm_tree / DELETED).exists()
    assert "logger patched twice" in (vllm_tree / LOGGER).read_text()
    assert verify_tree(tree, series).ok
    ledger = read_ledger(vllm_tree)
    assert ledger is not None and ledger.patches == report.applied
    revert = revert_series(tree, series)
    assert revert.applied == report.applied
    assert verify_against_record(vllm_tree) == []
    assert not (vllm_tree / ADDED).exists() and not ledger_path(vllm_tree).exists()
    leftovers = [p for p in (vllm_tree / "vllm").rglob("*") if ".m3patch-" in p.name]
    assert leftovers == []


def test_reapply_writes_nothing(vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    first = m3patch_cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert first.returncode == 0, first.stderr
    before = snapshot(vllm_tree)
    again = m3patch_cli("apply", "--verify", "--vllm-root", str(vllm_tree),
                        "--series", str(test_series))
    assert again.returncode == 0, again.stderr
    assert "already applied" in again.stdout
    assert again.stdout.strip().splitlines()[-1] == (
        "m3patch: 0 applied, 3 already applied, 0 conflicts")
    assert snapshot(vllm_tree) == before


def test_dry_run_writes_nothing(vllm_tree: Path, test_series: Path) -> None:
    before = snapshot(vllm_tree)
    report = apply_series(tree_at(vllm_tree), load_series(test_series), dry_run=True)
    assert len(report.applied) == 3 and "would apply" in report.summary()
    assert {k: v for k, v in snapshot(vllm_tree).items() if "/.m3patch/" not in k} == before


def _half_applied_logger(pristine: bytes) -> bytes:
    """Only hunk 1 of logger-marks is in: the exact shape a grep-for-marker check accepts."""
    text = pristine.decode()
    line = '_DATE_FORMAT = "%m-%d %H:%M:%S"\n'
    return text.replace(line, line + '_M3PATCH_TEST_MARK = "m3patch[test-series]: logger patched"\n',
                        1).encode()


def test_partially_applied_file_is_refused_and_diagnosed(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    logger = vllm_tree / LOGGER
    replace_file(logger, _half_applied_logger(logger.read_bytes()))
    before = snapshot(vllm_tree)
    proc = m3patch_cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert proc.returncode == errors.PatchConflict.exit_code, proc.stderr
    assert "vllm/logger.py: partially applied" in proc.stderr
    assert "logger-marks hunk 1 @ line 31: applied" in proc.stderr
    assert "logger-marks hunk 2 @ line 419: pending" in proc.stderr
    assert "Traceback" not in proc.stderr
    after = {k: v for k, v in snapshot(vllm_tree).items() if not k.endswith("/.m3patch/lock")}
    assert after == before  # nothing written, not even version.py
    status = m3patch_cli("status", "--json", "--vllm-root", str(vllm_tree),
                         "--series", str(test_series))
    files = {f["path"]: f for f in json.loads(status.stdout)["files"]}
    assert files[LOGGER]["state"] == "partially-applied"


def test_hand_edited_file_shows_first_differing_line(vllm_tree: Path, test_series: Path) -> None:
    logger = vllm_tree / LOGGER
    text = logger.read_text().replace('_DATE_FORMAT = "%m-%d %H:%M:%S"', '_DATE_FORMAT = "%H:%M"')
    replace_file(logger, text.encode())
    with pytest.raises(errors.PatchConflict) as info:
        apply_series(tree_at(vllm_tree), load_series(test_series))
    message = info.value.message
    assert "vllm/logger.py: drifted" in message
    assert "logger-marks hunk 1 @ line 31: conflict: vllm/logger.py:33: expected" in message
    assert "'_DATE_FORMAT = \"%H:%M\"'" in message
    assert not (vllm_tree / ADDED).exists()


def test_stale_ledger_after_reinstall(vllm_tree: Path, pristine_033: Path,
                                      test_series: Path, m3patch_cli: CliRunner) -> None:
    tree, series = tree_at(vllm_tree), load_series(test_series)
    apply_series(tree, series)
    for rel in (LOGGER, "vllm/version.py", DELETED):  # what `pip install --force-reinstall` does
        replace_file(vllm_tree / rel, (pristine_033 / rel).read_bytes())
    (vllm_tree / ADDED).unlink()
    report = verify_tree(tree, series)
    assert not report.ok
    assert any("stale ledger" in note for note in report.notes)
    status = m3patch_cli("status", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert "stale ledger" in status.stdout and "pending" in status.stdout
    again = apply_series(tree, series)
    # logger.py is back to pristine, so both patches on it are re-applied; the .json was not
    assert again.applied == ("version-banner", "logger-marks", "logger-followup")
    assert verify_tree(tree, series).ok


def test_wrong_vllm_version(vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    version = vllm_tree / "vllm" / "_version.py"
    replace_file(version, version.read_text().replace("'0.33.0'", "'0.32.0'").encode())
    proc = m3patch_cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert proc.returncode == errors.VersionMismatch.exit_code
    assert "vLLM 0.32.0, but the series targets 0.33.0" in proc.stderr


def test_verify_catches_a_patched_file_that_no_longer_compiles(
        vllm_tree: Path, test_series: Path) -> None:
    tree, series = tree_at(vllm_tree), load_series(test_series)
    apply_series(tree, series)
    replace_file(vllm_tree / "vllm/version.py", b"def broken(:\n")
    report = verify_tree(tree, series)
    # m3patch wrote this file (the ledger says so): an edit since is "modified after apply"
    assert not report.ok and "vllm/version.py: modified after apply" in "\n".join(report.problems)
    with pytest.raises(errors.VerifyFailed):
        report.raise_for_failure()


def test_only_refuses_a_file_shared_with_an_unselected_patch(
        vllm_tree: Path, test_series: Path) -> None:
    tree, series = tree_at(vllm_tree), load_series(test_series)
    with pytest.raises(errors.UsageError, match="also changed by"):
        apply_series(tree, series, only=["logger-marks"])
    report = apply_series(tree, series, only=["version-banner"])
    assert report.applied == ("version-banner",)
    states = {p["id"]: p["state"] for p in tree_status(tree, series).patches}
    assert states == {"version-banner": "applied", "logger-marks": "pending",
                      "logger-followup": "pending"}


def test_offset_mode_reports_every_offset(
        vllm_tree: Path, test_series: Path) -> None:
    logger = vllm_tree / LOGGER
    replace_file(logger, b"# two lines a nightly added\n\n" + logger.read_bytes())
    tree, series = tree_at(vllm_tree), load_series(test_series)
    with pytest.raises(errors.PatchConflict):
        apply_series(tree, series)  # strict: the file matches no pin
    report = apply_series(tree, series, mode="offset")
    assert any("logger-marks hunk 2 applied at line 421 (offset +2)" in o for o in report.offsets)
    assert verify_tree(tree, series).ok  # offset ledger records the post-images it wrote
    assert "logger patched twice" in logger.read_text()


def test_offset_mode_refuses_context_found_twice(vllm_tree: Path, test_series: Path) -> None:
    logger = vllm_tree / LOGGER
    block = ('    "[%(fileinfo)s:%(lineno)d] %(message)s"\n)\n_DATE_FORMAT = "%m-%d %H:%M:%S"\n'
             '_vllm_process_info: tuple[str, int] | None = None\n\n\n')
    replace_file(logger, logger.read_bytes() + b"\n" + block.encode())
    with pytest.raises(errors.PatchConflict, match="matches in 2 places"):
        apply_series(tree_at(vllm_tree), load_series(test_series), mode="offset")


def test_already_applied_is_decided_without_parsing_a_patch(
        vllm_tree: Path, test_series: Path) -> None:
    """The fast path (hashes vs the lock, then the ledger) never imports unidiff or the engine;
    a tree that is not exactly applied still takes the full, locked path."""
    apply_series(tree_at(vllm_tree), load_series(test_series))
    probe = ("import sys; from m3patch.main import main; "
             f"rc = main(['apply', '--verify', '--vllm-root', {str(vllm_tree)!r}, "
             f"'--series', {str(test_series)!r}]); "
             "print(sorted(m for m in ('unidiff', 'm3patch.patching.engine', 'm3patch.patching.writer') "
             "if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
    ledger_path(vllm_tree).unlink()  # files applied, ledger gone: the locked path rewrites it
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "ledger was missing or stale: rewritten" in proc.stderr
    # the full path: classified by the engine (its patches parsed, or taken from the parse memo)
    assert "'m3patch.patching.engine'" in proc.stdout.strip().splitlines()[-1]


def test_an_offset_applied_tree_is_first_class(vllm_tree: Path, pristine_033: Path,
                                               m3patch_cli: CliRunner) -> None:
    """After `apply --offset` (a line inserted near the top of modelopt.py), the ledger records
    the offset post-images: plain apply (serve's and ci's path, with and without --verify),
    verify, status and a second --offset run all agree it is applied; revert restores."""
    modelopt = "vllm/model_executor/layers/quantization/modelopt.py"
    args = ("--vllm-root", str(vllm_tree), "--series", str(REPO / "patches" / "vllm-0.33.0"))
    drifted = b"# a line a nightly added\n" + (pristine_033 / modelopt).read_bytes()
    replace_file(vllm_tree / modelopt, drifted)
    first = m3patch_cli("apply", "--offset", "--verify", *args)
    assert first.returncode == 0, first.stderr
    assert "(offset +1)" in first.stderr
    patched = {p: p.stat().st_mtime_ns for p in (vllm_tree / "vllm").rglob("*.py")}
    for extra in ((), ("--verify",), ("--offset",)):
        again = m3patch_cli("apply", *extra, *args)
        assert again.returncode == 0, (extra, again.stderr)
        assert "already applied" in again.stdout, (extra, again.stdout)
    assert {p: p.stat().st_mtime_ns for p in patched} == patched  # nothing rewritten
    assert m3patch_cli("verify", *args).returncode == 0
    status = m3patch_cli("status", "--json", *args)
    assert status.returncode == 0, status.stderr
    assert {f["path"]: f["state"] for f in json.loads(status.stdout)["files"]}[modelopt] == \
        "applied-offset"
    assert m3patch_cli("revert", *args).returncode == 0
    assert (vllm_tree / modelopt).read_bytes() == drifted


@pytest.mark.parametrize("loss", ["deleted", "corrupt"])
def test_a_rebuilt_ledger_lets_revert_remove_the_folders_apply_made(
        loss: str, vllm_tree: Path, m3patch_cli: CliRunner) -> None:
    """The shipped series applied, then its ledger deleted or corrupted: apply rebuilt it with no
    folders for the added tuned tables, so revert left an empty configs/m3patch/ behind. A
    folder holding only files the series adds was made by its apply and is recorded again."""
    args = ("--vllm-root", str(vllm_tree), "--series", str(REPO / "patches" / "vllm-0.33.0"))
    assert m3patch_cli("apply", *args).returncode == 0
    configs = vllm_tree / "vllm/model_executor/layers/fused_moe/configs/m3patch"
    assert configs.is_dir()
    if loss == "deleted":
        ledger_path(vllm_tree).unlink()
    else:
        ledger_path(vllm_tree).write_text("{not json")
    rebuilt = m3patch_cli("apply", *args)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "rewritten" in rebuilt.stderr
    reverted = m3patch_cli("revert", *args)
    assert reverted.returncode == 0, reverted.stderr
    assert not configs.exists()
    assert verify_against_record(vllm_tree) == []
