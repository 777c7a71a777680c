"""`series port` on real drift: the shipped vLLM 0.33.0 series onto the real 0.32.0 and 0.31.0
trees (the PyPI wheels' files), the 0.32.0 series onto 0.33.0, and one case per outcome built
from real files (an upstreamed patch, a moved hunk, a changed context line, an ambiguous one)."""

from __future__ import annotations

import json
import py_compile
import shutil
from pathlib import Path

import pytest
import yaml
from core_helpers import REPO, CliRunner, replace_file

from m3patch.commands.series import lint_series_on
from m3patch.errors import PortConflict, UsageError
from m3patch.patching.api import apply_series, verify_tree
from m3patch.patching.diffs import parse_patch
from m3patch.patching.hunks import apply_file
from m3patch.patching.locate import tree_at
from m3patch.patching.port_output import INCOMPLETE, REPORT_JSON, REPORT_MD, port_series
from m3patch.patching.pristine import cache_root, copy_tree, pristine_tree
from m3patch.patching.series import Series, load_series

SERIES_033 = REPO / "patches" / "vllm-0.33.0"
SERIES_032 = REPO / "patches" / "vllm-0.32.0"
LAUNCHER = "vllm/entrypoints/launchers/launcher.py"
MTP = "vllm/models/minimax_m3/amd/mtp.py"
ORACLE = "vllm/model_executor/layers/fused_moe/oracle/mxfp8.py"
MODELOPT = "vllm/model_executor/layers/quantization/modelopt.py"


def no_lint(series: Series, root: Path) -> None:
    """For plan-only cases; the cases that write a series run the real lint (`real_lint`)."""


def real_lint(series: Series, root: Path) -> None:
    lint_series_on(series, root)


def subset(tmp_path: Path, source: Path, drop: set[str]) -> Path:
    """A copy of a shipped series without the patches in `drop` (no lock: port reads none)."""
    out = tmp_path / f"src-{source.name}"
    shutil.copytree(source, out)
    (out / "series.lock.json").unlink()
    raw = yaml.safe_load((out / "series.yaml").read_text(encoding="utf-8"))
    raw["patches"] = [p for p in raw["patches"] if p["id"] not in drop]
    (out / "series.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return out


def outcomes(doc: dict[str, object]) -> dict[str, str]:
    patches = doc["patches"]
    assert isinstance(patches, list)
    return {p["id"]: p["outcome"] for p in patches}


def assert_applies_verifies_compiles(series_dir: Path, root: Path, tmp_path: Path) -> None:
    """Independently of the port's own proof: apply + verify on a fresh copy, py_compile."""
    series = load_series(series_dir)
    copy = copy_tree(root, tmp_path / "check-tree")
    tree = tree_at(copy)
    report = apply_series(tree, series)
    verify_tree(tree, series, contents=report.contents).raise_for_failure()
    for pin in series.require_lock().patches:
        for f in pin.files:
            if f.path.endswith(".py") and f.post is not None:
                py_compile.compile(str(copy / f.path), doraise=True,
                                   cfile=str(tmp_path / "pyc" / (f.path.replace("/", "_") + "c")))


# ---- real drift ---------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["0.32.0", "0.31.0"])
def test_shipped_033_on_older_vllm_conflicts_on_the_launcher_hunk(
        version: str, m3patch_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "ported"
    proc = m3patch_cli("series", "port", str(SERIES_033), "--tree", str(pristine_tree(version)),
                       "--out", str(out), timeout=600)
    assert proc.returncode == 22, proc.stderr
    assert f"provenance: {LAUNCHER} hunk 1" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [INCOMPLETE, REPORT_JSON, REPORT_MD]
    doc = json.loads((out / REPORT_JSON).read_text())
    assert doc["status"] == "conflict"
    found = outcomes(doc)
    assert found["provenance"] == "conflict"
    assert found["block-fp8-moe"] == "offset"  # the MoE code moved, the context did not change
    conflict = doc["patches"][0]["files"][1]["hunks"][0]["conflict"]
    assert "    init_parser_plugin(args)" in conflict["old-upstream"]
    assert "    init_parser_plugin(args)" not in conflict["new-upstream"]
    assert any(line.startswith("-    init_parser_plugin") for line in conflict["changed"])
    markdown = (out / REPORT_MD).read_text()
    assert f"#### conflict: {LAUNCHER} hunk 1" in markdown
    assert "new upstream (from line" in markdown


def test_pristine_031_is_fetched_once_and_cached() -> None:
    root = pristine_tree("0.31.0")
    assert (root / ".m3patch-pristine-ok").is_file()
    assert root.parent == cache_root()
    assert pristine_tree("0.31.0") == root
    assert list((cache_root() / "wheels").glob("vllm-0.31.0-*.whl"))


def test_shipped_032_on_033_conflicts_on_the_launcher_hunk(tmp_path: Path) -> None:
    with pytest.raises(PortConflict, match=f"provenance: {LAUNCHER} hunk 1"):
        port_series(SERIES_032, pristine_tree("0.33.0"), tmp_path / "o", command="t", lint=no_lint)
    assert not (tmp_path / "o" / "series.yaml").exists()


@pytest.mark.parametrize("version", ["0.32.0", "0.31.0"])
def test_clean_and_offset_patches_apply_verify_compile_on_the_older_tree(
        version: str, tmp_path: Path) -> None:
    source = subset(tmp_path, SERIES_033, {"provenance"})
    root = pristine_tree(version)
    out = tmp_path / "ported"
    result = port_series(source, root, out, command="t", lint=real_lint)
    assert result.written == out
    assert set(outcomes(result.doc).values()) <= {"clean", "offset"}
    assert "offset" in outcomes(result.doc).values()
    ported = load_series(out)
    assert ported.id == f"vllm-{version}" and ported.target_version == version
    raw = yaml.safe_load((out / "series.yaml").read_text())
    assert raw["ported-from"]["series"] == "vllm-0.33.0"
    assert raw["ported-from"]["vllm-version"] == "0.33.0"
    assert {p["id"]: p["outcome"] for p in raw["ported-from"]["patches"]} == outcomes(result.doc)
    assert (out / REPORT_MD).is_file() and not (out / INCOMPLETE).exists()
    assert_applies_verifies_compiles(out, root, tmp_path)


# ---- one case per outcome, from real files ------------------------------------------------------

def upstreamed(tmp_path: Path, patch: str, only: str | None = None) -> Path:
    """A copy of the 0.33.0 tree where upstream already made `patch` (or its `only` file)."""
    root = copy_tree(pristine_tree("0.33.0"), tmp_path / "new-tree")
    parsed = parse_patch((SERIES_033 / patch).read_bytes(), patch)
    for fp in parsed.files:
        if only is not None and fp.path != only:
            continue
        data = (root / fp.path).read_bytes() if (root / fp.path).is_file() else None
        after = apply_file(fp, data, patch)
        assert after is not None
        replace_file(root / fp.path, after)
    return root


def test_same_tree_is_all_clean_and_regenerates_the_committed_patches(tmp_path: Path) -> None:
    result = port_series(SERIES_033, pristine_tree("0.33.0"), None, command="t", lint=no_lint)
    assert set(outcomes(result.doc).values()) == {"clean"}
    for patch in result.plan.patches:
        regenerated = parse_patch(patch.diff.encode(), "regenerated")
        committed = parse_patch((SERIES_033 / patch.file).read_bytes(), patch.file)
        assert [(f.path, f.kind, [(h.old_start, h.old_lines, h.new_lines) for h in f.hunks])
                for f in regenerated.files] == [
            (f.path, f.kind, [(h.old_start, h.old_lines, h.new_lines) for h in f.hunks])
            for f in committed.files]


def test_an_upstreamed_patch_is_dropped_with_its_drop_when(tmp_path: Path) -> None:
    root = upstreamed(tmp_path, "0003-minimax-m3-mtp-fse.patch")
    out = tmp_path / "ported"
    result = port_series(SERIES_033, root, out, command="t", lint=real_lint)
    found = outcomes(result.doc)
    assert found["minimax-m3-mtp-fse"] == "fully-upstream"
    assert {v for k, v in found.items() if k != "minimax-m3-mtp-fse"} == {"clean"}
    ported = load_series(out)
    assert "minimax-m3-mtp-fse" not in [p.id for p in ported.patches]
    assert not (out / "0003-minimax-m3-mtp-fse.patch").exists()
    assert "drop-when: vLLM >= 0.34.0 or amd/mtp.py" in (out / REPORT_MD).read_text()
    assert_applies_verifies_compiles(out, root, tmp_path)


def test_a_partly_upstreamed_patch_keeps_only_the_rest(tmp_path: Path) -> None:
    root = upstreamed(tmp_path, "0002-mxfp8-block-fp8-moe.patch", only=ORACLE)
    result = port_series(SERIES_033, root, tmp_path / "ported", command="t", lint=real_lint)
    patch = next(p for p in result.plan.patches if p.id == "block-fp8-moe")
    assert patch.outcome == "partly-upstream"
    assert {f.path: {h.outcome for h in f.hunks} for f in patch.files}[ORACLE] == {"upstream"}
    assert f"+++ b/{ORACLE}" not in patch.diff and f"+++ b/{MODELOPT}" in patch.diff
    assert_applies_verifies_compiles(tmp_path / "ported", root, tmp_path)


def test_moved_code_is_an_offset(tmp_path: Path) -> None:
    root = copy_tree(pristine_tree("0.33.0"), tmp_path / "new-tree")
    data = (root / MTP).read_bytes()
    replace_file(root / MTP, b"# one\n# two\n# three\n" + data)
    result = port_series(SERIES_033, root, tmp_path / "ported", command="t", lint=real_lint)
    mtp = next(p for p in result.plan.patches if p.id == "minimax-m3-mtp-fse")
    assert mtp.outcome == "offset"
    assert {h.offset for f in mtp.files for h in f.hunks} == {3}
    assert "@@ -65,6 +65,7 @@" in mtp.diff  # regenerated at the new lines
    assert_applies_verifies_compiles(tmp_path / "ported", root, tmp_path)


def test_a_changed_context_line_is_a_conflict_naming_the_hunk(tmp_path: Path) -> None:
    root = copy_tree(pristine_tree("0.33.0"), tmp_path / "new-tree")
    lines = (root / MTP).read_bytes().split(b"\n")
    original = list(lines)
    patch = parse_patch((SERIES_033 / "0003-minimax-m3-mtp-fse.patch").read_bytes(), "p")
    hunk2 = patch.files[0].hunks[1]
    target = hunk2.old_start - 1  # the hunk's first context line
    assert lines[target].decode() + "\n" == hunk2.old_lines[0]
    lines[target] = lines[target] + b"  # changed upstream"
    replace_file(root / MTP, b"\n".join(lines))
    out = tmp_path / "ported"
    with pytest.raises(PortConflict, match=f"minimax-m3-mtp-fse: {MTP} hunk 2"):
        port_series(SERIES_033, root, out, command="t", lint=no_lint)
    assert (out / INCOMPLETE).is_file() and not (out / "series.yaml").exists()
    doc = json.loads((out / REPORT_JSON).read_text())
    hunk = doc["patches"][2]["files"][0]["hunks"][1]
    assert hunk["outcome"] == "conflict"
    assert hunk["conflict"]["new-upstream-line"] == hunk2.old_start
    assert any("# changed upstream" in line for line in hunk["conflict"]["changed"])
    assert [h["outcome"] for h in doc["patches"][2]["files"][0]["hunks"]] == [
        "clean", "conflict", "clean", "clean"]
    # a clean hunk's line is the new file's own (before the patch's earlier hunks moved it)
    placed = doc["patches"][2]["files"][0]["hunks"][2]
    assert placed["new-line"] == patch.files[0].hunks[2].old_start
    assert sum(len(h.new_lines) - len(h.old_lines) for h in patch.files[0].hunks[:1]) != 0
    # the workflow the hint gives: edit the hunk in a copy of the source series (here: the
    # file edited back), port again into the same --out, whose report is replaced
    with pytest.raises(PortConflict) as caught:
        port_series(SERIES_033, root, out, command="t", lint=no_lint)
    assert f"--out {out}`: the same --out" in str(caught.value.hint)
    replace_file(root / MTP, b"\n".join(original))
    result = port_series(SERIES_033, root, out, command="t", lint=no_lint)
    assert result.written == out and (out / "series.yaml").is_file()
    assert not (out / INCOMPLETE).exists()
    (out / "mine.txt").write_text("keep")  # a folder with anything else is still refused
    with pytest.raises(UsageError, match="not empty"):
        port_series(SERIES_033, root, out, command="t", lint=no_lint)


def test_context_found_twice_away_from_its_place_is_a_conflict(tmp_path: Path) -> None:
    root = copy_tree(pristine_tree("0.33.0"), tmp_path / "new-tree")
    patch = parse_patch((SERIES_033 / "0004-tuned-moe-tables.patch").read_bytes(), "p")
    fp = patch.files[0]
    hunk = fp.hunks[0]
    data = (root / fp.path).read_bytes()
    block = "".join(hunk.old_lines).encode()
    replace_file(root / fp.path, b"# moved\n" + data + b"\n" + block)
    result = port_series(SERIES_033, root, None, command="t", lint=no_lint)
    tuned = next(p for p in result.plan.patches if p.id == "tuned-moe-tables")
    assert tuned.outcome == "conflict"
    conflict = tuned.files[0].hunks[0].conflict
    assert conflict is not None and "matches in 2 places" in conflict.why


# ---- the command ------------------------------------------------------------------------------

def test_dry_run_writes_nothing_and_prints_the_report(m3patch_cli: CliRunner,
                                                      tmp_path: Path) -> None:
    before = sorted(tmp_path.iterdir())
    proc = m3patch_cli("series", "port", str(SERIES_033), "--tree",
                       str(pristine_tree("0.32.0")), "--dry-run", timeout=600)
    assert proc.returncode == 22, proc.stderr
    assert "| 2 | block-fp8-moe | offset |" in proc.stdout
    assert sorted(tmp_path.iterdir()) == before


def test_port_refuses_a_non_empty_out(tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("keep")
    with pytest.raises(UsageError, match="not empty"):
        port_series(SERIES_033, pristine_tree("0.33.0"), tmp_path / "o", command="t",
                    lint=no_lint)


def test_a_conflicts_lines_are_the_files_own(tmp_path: Path) -> None:
    """Before: what changed upstream was headed `@@ -3,4 +3,4 @@` (lines of the excerpt) and the
    hunk list showed the conflict's new line as a dash."""
    old_root, new_root = pristine_tree("0.33.0"), pristine_tree("0.32.0")
    result = port_series(SERIES_033, new_root, None, command="t", lint=no_lint)
    provenance = next(p for p in result.plan.patches if p.id == "provenance")
    hunk = next(h for f in provenance.files if f.path == LAUNCHER for h in f.hunks)
    assert hunk.conflict is not None
    changed = hunk.conflict.changed
    assert changed[0] == "@@ -368,4 +381,4 @@"
    old_lines = (old_root / LAUNCHER).read_text().splitlines()
    new_lines = (new_root / LAUNCHER).read_text().splitlines()
    first_context = changed[1][1:]  # the diff's first line, context on both sides
    assert old_lines[368 - 1] == first_context == new_lines[381 - 1]
    assert f"- {LAUNCHER} hunk 1 (old line 366): conflict, no exact new line: the hunk's old " \
           "lines are not in the new file (no fuzz); closest new lines from line 379" \
        in result.markdown
    assert "—" not in result.markdown


def test_a_port_into_a_folder_it_cannot_make_is_a_tree_io_error(
        m3patch_cli: CliRunner, tmp_path: Path) -> None:
    """Before: exit 70, `internal error: NotADirectoryError` (PermissionError for a user in a
    read-only folder). A path below a regular file cannot be made, by root either."""
    (tmp_path / "a-file").write_text("")
    for tree, out in ((pristine_tree("0.32.0"), tmp_path / "a-file" / "p"),  # conflict: report
                      (pristine_tree("0.33.0"), tmp_path / "a-file" / "q")):  # complete: staging
        proc = m3patch_cli("series", "port", str(SERIES_033), "--tree", str(tree),
                           "--out", str(out), timeout=600)
        assert proc.returncode == 7, proc.stderr
        assert "internal error" not in proc.stderr
        assert str(tmp_path / "a-file") in proc.stderr and "fix: " in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
