"""A series that rewrites vllm/_version.py (as every real release diff does) stays re-appliable:
the file's pinned image plus this series' ledger prove the tree is ours, so apply, status, verify
and revert agree instead of the live version check refusing every later apply (exit 4). A tree of
another vLLM version is exit 4 for every command, and the hint never advises a downgrade."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from core_helpers import REPO, CliRunner, make_series, replace_file

from m3patch import errors
from m3patch.patching.ledger import read_ledger

VERSION = "vllm/_version.py"


def bump_diff(root: Path) -> str:
    old = (root / VERSION).read_text().splitlines(keepends=True)
    new = [line.replace("'0.33.0'", "'0.34.0'").replace("(0, 33, 0)", "(0, 34, 0)")
           .replace("g4ba787ec9", "g1234567890") for line in old]
    diff = difflib.unified_diff(old, new, f"a/{VERSION}", f"b/{VERSION}")
    return f"diff --git a/{VERSION} b/{VERSION}\n" + "".join(diff)


def run(cli: CliRunner, command: str, root: Path, series: Path, *extra: str) -> tuple[int, str]:
    proc = cli(command, *extra, "--vllm-root", str(root), "--series", str(series))
    return proc.returncode, proc.stdout + proc.stderr


def test_a_series_that_rewrites_the_version_file_is_reapplied_verified_and_reverted(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    series = make_series(tmp_path / "bump", pristine_033, [bump_diff(pristine_033)])
    pristine_bytes = (vllm_tree / VERSION).read_bytes()
    assert run(m3patch_cli, "apply", vllm_tree, series)[0] == 0
    assert "'0.34.0'" in (vllm_tree / VERSION).read_text()
    ledger_before = read_ledger(vllm_tree)
    for command, extra in [("apply", ()), ("apply", ("--verify",)), ("apply", ("--dry-run",)),
                           ("status", ()), ("verify", ())]:
        code, out = run(m3patch_cli, command, vllm_tree, series, *extra)
        assert code == 0, (command, extra, out)
    code, out = run(m3patch_cli, "apply", vllm_tree, series, "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["already_applied"] == ["p1"] and report["files_written"] == []
    ledger = read_ledger(vllm_tree)
    assert ledger is not None and ledger_before is not None
    assert (ledger.vllm_version, ledger.vllm_commit) == ("0.33.0", "4ba787ec9")  # applied on
    assert ledger.time == ledger_before.time  # re-apply wrote nothing, not even the ledger
    assert run(m3patch_cli, "revert", vllm_tree, series)[0] == 0
    assert (vllm_tree / VERSION).read_bytes() == pristine_bytes
    assert read_ledger(vllm_tree) is None
    assert run(m3patch_cli, "status", vllm_tree, series)[0] == 0


def test_the_version_file_at_a_later_image_without_this_series_ledger_is_a_mismatch(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """The post-image alone is not proof: a genuine 0.34.0 file could equal it. Without the
    ledger of this series the live version decides (exit 4, the same for every command)."""
    series = make_series(tmp_path / "bump", pristine_033, [bump_diff(pristine_033)])
    assert run(m3patch_cli, "apply", vllm_tree, series)[0] == 0
    (vllm_tree / "vllm/.m3patch/ledger.json").unlink()
    for command in ("apply", "status", "verify", "revert"):
        code, out = run(m3patch_cli, command, vllm_tree, series)
        assert code == errors.VersionMismatch.exit_code, (command, out)
        assert "vLLM 0.34.0, but the series targets 0.33.0" in out


def test_another_versions_series_is_exit_4_everywhere_and_never_advises_a_downgrade(
        vllm_tree: Path, m3patch_cli: CliRunner) -> None:
    older = REPO / "patches" / "vllm-0.32.0"
    for command, extra in [("status", ()), ("status", ("--json",)), ("verify", ()),
                           ("apply", ()), ("revert", ())]:
        code, out = run(m3patch_cli, command, vllm_tree, older, *extra)
        assert code == errors.VersionMismatch.exit_code, (command, out)
        assert "vLLM 0.33.0, but the series targets 0.32.0" in out
        assert "vllm==0.32.0" not in out  # no downgrade
        assert "(--series vllm-0.33.0)" in out  # the name `series list` prints: it works
    code, out = run(m3patch_cli, "status", vllm_tree, older, "--json")
    assert json.loads(out[:out.rindex("}") + 1])["error"]["type"] == "VersionMismatch"


def test_an_offset_port_to_another_version_is_accepted_by_every_command(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """`apply --offset` ports a series onto another release (a note, not a refusal); the offset
    ledger then lets status, verify, plain apply and revert agree on that tree."""
    rel = "vllm/logger.py"
    series = make_series(tmp_path / "s", pristine_033, [
        "".join(difflib.unified_diff(
            (pristine_033 / rel).read_text().splitlines(keepends=True),
            [*(pristine_033 / rel).read_text().splitlines(keepends=True), "# ported\n"],
            f"a/{rel}", f"b/{rel}"))])
    text = (vllm_tree / VERSION).read_text().replace("'0.33.0'", "'0.33.5'")
    replace_file(vllm_tree / VERSION, text.encode())
    assert run(m3patch_cli, "apply", vllm_tree, series)[0] == errors.VersionMismatch.exit_code
    code, out = run(m3patch_cli, "apply", vllm_tree, series, "--offset")
    assert code == 0 and "offset mode" in out, out
    for command in ("apply", "status", "verify"):
        assert run(m3patch_cli, command, vllm_tree, series)[0] == 0, command
    assert run(m3patch_cli, "revert", vllm_tree, series)[0] == 0
    assert (vllm_tree / rel).read_bytes() == (pristine_033 / rel).read_bytes()


def test_a_run_killed_after_replacing_the_version_file_is_recovered_by_the_next(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """Killed after vllm/_version.py was replaced and before the ledger was written: the
    version image of this series and no ledger. The next apply (and revert) finishes or rolls
    back the journal before the version check, instead of exit 4 for ever."""
    series = make_series(tmp_path / "bump", pristine_033, [bump_diff(pristine_033)])
    pristine_bytes = (vllm_tree / VERSION).read_bytes()
    # steps: journal, backup link, staged file, commit journal, the rename (5), ledger (6)
    for command, then in (("apply", "apply"), ("apply", "revert")):
        killed = m3patch_cli(command, "--vllm-root", str(vllm_tree), "--series", str(series),
                             env={"M3PATCH_FAULT": "kill-after:5"})
        assert killed.returncode == -9, killed.stderr
        assert "'0.34.0'" in (vllm_tree / VERSION).read_text()
        assert read_ledger(vllm_tree) is None
        for read_only in ("status", "verify"):  # never recover: they say how to
            code, out = run(m3patch_cli, read_only, vllm_tree, series)
            assert code == errors.VersionMismatch.exit_code, out
            assert "interrupted transaction is pending" in out and "fix: m3patch apply" in out
        code, out = run(m3patch_cli, then, vllm_tree, series)
        assert code == 0, out
        assert "completed an interrupted transaction" in out
        assert not (vllm_tree / "vllm/.m3patch/journal.json").exists()
        if then == "apply":
            assert run(m3patch_cli, "verify", vllm_tree, series)[0] == 0
            assert run(m3patch_cli, "revert", vllm_tree, series)[0] == 0
        assert (vllm_tree / VERSION).read_bytes() == pristine_bytes


def test_a_recovered_revert_leaves_the_applied_on_version_in_the_next_ledger(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """A revert killed after its commit journal, then apply: the ledger still says the series
    was applied on 0.33.0 (the version the version file said before any patch), never the
    series' own 0.34.0 image that was in place when the command started."""
    series = make_series(tmp_path / "bump", pristine_033, [bump_diff(pristine_033)])
    assert run(m3patch_cli, "apply", vllm_tree, series)[0] == 0
    killed = m3patch_cli("revert", "--vllm-root", str(vllm_tree), "--series", str(series),
                         env={"M3PATCH_FAULT": "kill-after:4"})  # the commit journal is written
    assert killed.returncode == -9, killed.stderr
    code, out = run(m3patch_cli, "apply", vllm_tree, series)
    assert code == 0, out
    ledger = read_ledger(vllm_tree)
    assert ledger is not None
    assert (ledger.vllm_version, ledger.vllm_commit) == ("0.33.0", "4ba787ec9")


def test_a_command_refused_before_the_version_check_leaves_a_pending_journal_alone(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """A killed run's journal is recovered only by a command that gets as far as the version
    check: an unlocked series (2) touches nothing; a series the half-done tree's version refuses
    (4) recovers it first, checks again and says so in the refusal."""
    series = make_series(tmp_path / "bump", pristine_033, [bump_diff(pristine_033)])
    killed = m3patch_cli("apply", "--vllm-root", str(vllm_tree), "--series", str(series),
                         env={"M3PATCH_FAULT": "kill-after:5"})
    assert killed.returncode == -9, killed.stderr
    journal = vllm_tree / "vllm/.m3patch/journal.json"
    assert journal.exists()
    unlocked = make_series(tmp_path / "unlocked", None, [bump_diff(pristine_033)])
    code, out = run(m3patch_cli, "apply", vllm_tree, unlocked)
    assert code == errors.UsageError.exit_code, out
    assert journal.exists() and read_ledger(vllm_tree) is None
    added = ("diff --git a/vllm/m3patch_other.py b/vllm/m3patch_other.py\nnew file mode 100644\n"
             "--- /dev/null\n+++ b/vllm/m3patch_other.py\n@@ -0,0 +1 @@\n+x = 1\n")
    other = make_series(tmp_path / "other", None, [added])  # 0.33.0, _version.py not pinned
    (other / "series.yaml").write_text((other / "series.yaml").read_text().replace(
        "id: made", "id: other"))
    locked = m3patch_cli("series", "lock", "--series", str(other), "--tree", str(pristine_033))
    assert locked.returncode == 0, locked.stderr
    code, out = run(m3patch_cli, "apply", vllm_tree, other)
    assert code == errors.VersionMismatch.exit_code, out
    assert "checked after: completed an interrupted transaction" in out
    assert not journal.exists()
