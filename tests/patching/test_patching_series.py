"""Series manifest and lock: strict schema, pins regenerate identically, stale lock refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from core_helpers import REPO, CliRunner

from m3patch import errors
from m3patch.patching.api import apply_series
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import verify_against_record
from m3patch.patching.series import load_series
from m3patch.schema import SchemaError


def copy_series(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "series"))


def test_load_and_markers_for(test_series: Path) -> None:
    series = load_series(test_series)
    assert series.id == "test-series-0.33.0" and series.target_commit == "4ba787ec9"
    assert [p.id for p in series.patches] == ["version-banner", "logger-marks", "logger-followup"]
    assert series.lock is not None and len(series.lock.patches) == 3
    cpu = {m.id for m in series.markers_for("cpu")}
    cuda = {m.id for m in series.markers_for("cuda")}
    rocm = {m.id for m in series.markers_for("rocm-gfx942")}
    assert cpu == {"test-added-file", "test-logger-mark", "test-no-emulation"}
    assert cuda == {"test-added-file", "test-no-emulation"}  # the marker's own platform gate
    assert rocm == {"test-added-file"}  # logger-marks is gated to cpu, cuda
    regex = next(m for m in series.markers_for("cpu") if m.id == "test-logger-mark")
    assert regex.regex == "m3patch\\[test-series\\]: logger patched( twice)?$"
    assert regex.text == "regex:" + regex.regex
    assert regex.declared_by == f"patch logger-marks in {test_series / 'series.yaml'}"


def test_unknown_key_has_breadcrumb_and_suggestion(test_series: Path, tmp_path: Path) -> None:
    series = copy_series(test_series, tmp_path)
    manifest = series / "series.yaml"
    manifest.write_text(manifest.read_text().replace("drop-when: never (test data)\n    platforms",
                                                     "drop_when: never\n    platforms", 1))
    with pytest.raises(SchemaError) as info:
        load_series(series)
    text = str(info.value)
    assert "==> At key: patches" in text and "==> At index 1" in text
    assert "Perhaps you meant 'drop-when'?" in text


def test_committed_lock_equals_a_fresh_one(test_series: Path, tmp_path: Path,
                                           m3patch_cli: CliRunner) -> None:
    series = copy_series(test_series, tmp_path)
    proc = m3patch_cli("series", "lock", "--series", str(series), "--pristine")
    assert proc.returncode == 0, proc.stderr
    assert (series / "series.lock.json").read_text() == (
        test_series / "series.lock.json").read_text()


def test_edited_patch_makes_the_lock_stale(test_series: Path, tmp_path: Path,
                                           vllm_tree: Path) -> None:
    series = copy_series(test_series, tmp_path)
    patch = series / "0002-logger-marks.patch"
    patch.write_text(patch.read_text().replace('"num_warps": 8', '"num_warps": 16'))
    with pytest.raises(errors.UsageError, match=r"changed since series\.lock\.json"):
        apply_series(tree_at(vllm_tree), load_series(series))


def test_reordered_manifest_makes_the_lock_stale(test_series: Path, tmp_path: Path) -> None:
    series = copy_series(test_series, tmp_path)
    manifest = series / "series.yaml"
    manifest.write_text(manifest.read_text().replace("id: test-series-0.33.0", "id: renamed"))
    with pytest.raises(errors.UsageError, match="stale"):
        load_series(series)


def test_missing_lock(test_series: Path, tmp_path: Path, vllm_tree: Path) -> None:
    series = copy_series(test_series, tmp_path)
    (series / "series.lock.json").unlink()
    with pytest.raises(errors.UsageError, match="series lock"):
        apply_series(tree_at(vllm_tree), load_series(series))


def test_a_lock_that_fails_the_marker_lint_writes_nothing(test_series: Path, tmp_path: Path,
                                                           pristine_033: Path,
                                                           m3patch_cli: CliRunner) -> None:
    """Before: the lock was written, then the lint failed (23) with the new lock in place."""
    series = copy_series(test_series, tmp_path)
    manifest = series / "series.yaml"
    manifest.write_text(manifest.read_text().replace(
        'text: "m3patch[test-series]: added file present"',
        'text: "m3patch[test-series]: added fiel present"'))
    lock = series / "series.lock.json"
    lock.write_text('{"stand-in": "the lock before this run"}\n')
    proc = m3patch_cli("series", "lock", "--series", str(series), "--tree", str(pristine_033))
    assert proc.returncode == 23, proc.stderr
    assert "added fiel present" in proc.stderr
    assert lock.read_text() == '{"stand-in": "the lock before this run"}\n'
    assert "wrote" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["vllm-0.33.0", "vllm-0.32.0"])
def test_real_series_folders_lock(name: str, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    src = REPO / "patches" / name
    if not (src / "series.yaml").exists():
        pytest.skip(f"patches/{name} not written yet")
    series = copy_series(src, tmp_path)
    proc = m3patch_cli("series", "lock", "--series", str(series), "--pristine", timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert load_series(series).lock is not None


def test_default_series_lookup_checkout_then_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   ) -> None:
    """--series, $M3PATCH_SERIES, ./patches/vllm-<base>, then the series shipped with m3patch
    (the checkout's patches/, or in an installed wheel its bundled copy)."""
    from m3patch.patching import series as series_mod

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("M3PATCH_SERIES", raising=False)
    shipped = series_mod.find_series_dir(None, "0.33.0+cpu")
    assert shipped.resolve() == REPO / "patches" / "vllm-0.33.0"
    bundled = tmp_path / "wheel" / "_shipped" / "patches"
    shutil.copytree(REPO / "patches" / "vllm-0.33.0", bundled / "vllm-0.33.0")
    monkeypatch.setattr(series_mod, "shipped_dir", lambda kind: bundled)  # as installed
    assert series_mod.find_series_dir(None, "0.33.0") == bundled / "vllm-0.33.0"
    shutil.copytree(REPO / "patches" / "vllm-0.33.0", tmp_path / "patches" / "vllm-0.33.0")
    assert series_mod.find_series_dir(None, "0.33.0") == Path("patches/vllm-0.33.0")
    monkeypatch.setenv("M3PATCH_SERIES", "/from/env")
    assert series_mod.find_series_dir(None, "0.33.0") == Path("/from/env")
    assert series_mod.find_series_dir(Path("/explicit"), "0.33.0") == Path("/explicit")
    monkeypatch.delenv("M3PATCH_SERIES")
    with pytest.raises(errors.UsageError, match=r"no series for vLLM 0\.99\.0") as caught:
        series_mod.find_series_dir(None, "0.99.0")
    assert "pass --series NAME|DIR (shipped: vllm-0.33.0" in str(caught.value.hint)


def test_series_by_the_name_series_list_prints(tmp_path: Path, vllm_tree: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               m3patch_cli: CliRunner) -> None:
    """`--series vllm-0.33.0` (as `series list` prints it) works from any folder, in every
    command that takes a series; an unknown name names the nearest shipped one."""
    from m3patch.patching import series as series_mod

    monkeypatch.chdir(tmp_path)
    assert series_mod.series_path("vllm-0.33.0").resolve() == REPO / "patches" / "vllm-0.33.0"
    assert series_mod.series_path("./vllm-0.33.0") == Path("./vllm-0.33.0")  # a path stays one
    listed = m3patch_cli("series", "list", "--vllm-root", str(vllm_tree))
    assert "vllm-0.33.0" in listed.stdout and "<- fits the located vLLM" in listed.stdout
    shown = m3patch_cli("series", "show", "--series", "vllm-0.33.0")
    assert shown.returncode == 0 and shown.stdout.startswith("vllm-0.33.0: vLLM 0.33.0")
    status = m3patch_cli("status", "--vllm-root", str(vllm_tree), "--series", "vllm-0.33.0")
    assert status.returncode == 0, status.stderr
    bad = m3patch_cli("series", "show", "--series", "vllm-0.33")
    assert bad.returncode == errors.UsageError.exit_code
    assert "Perhaps you meant 'vllm-0.33.0'?" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("edit", ["post equals pre", "broken chain", "short hash"])
def test_a_lock_pin_that_cannot_be_true_is_refused_at_load(
        edit: str, test_series: Path, tmp_path: Path, vllm_tree: Path,
        m3patch_cli: CliRunner) -> None:
    """A pin whose post-image equals its pre-image made apply skip the patch and report it
    applied; the lock is read back as untrusted input and refused (exit 2), the tree untouched."""
    series = tmp_path / "series"
    shutil.copytree(test_series, series)
    lock = json.loads((series / "series.lock.json").read_text())
    logger = [f for p in lock["patches"] for f in p["files"] if f["path"] == "vllm/logger.py"]
    if edit == "post equals pre":
        logger[1]["post"] = logger[1]["pre"]
    elif edit == "broken chain":  # the first patch's post is no longer the second one's pre
        logger[0]["post"] = "0" * 64
    else:
        logger[0]["pre"] = logger[0]["pre"][:12]
    (series / "series.lock.json").write_text(json.dumps(lock))
    args = ("--vllm-root", str(vllm_tree), "--series", str(series))
    for command in ("apply", "verify", "status"):
        proc = m3patch_cli(command, *args)
        assert proc.returncode == errors.UsageError.exit_code, proc.stderr
        assert "series lock --pristine" in proc.stderr and "vllm/logger.py" in proc.stderr
    assert not (vllm_tree / "vllm/.m3patch").exists()


def without_tuned_tables(folder: Path, series_id: str, pristine: Path,
                         m3patch_cli: CliRunner) -> Path:
    """The shipped series less its tuned-tables patch, as `series_id`, relocked."""
    shutil.copytree(REPO / "patches" / "vllm-0.33.0", folder)
    manifest = (folder / "series.yaml").read_text()
    start = manifest.index("  - id: tuned-tables-h200")
    end = manifest.index("  - id: packed-e8m0-scales")
    manifest = manifest[:start] + manifest[end:]
    (folder / "series.yaml").write_text(manifest.replace("id: vllm-0.33.0", f"id: {series_id}", 1))
    (folder / "0005-tuned-tables-h200.patch").unlink()
    locked = m3patch_cli("series", "lock", "--series", str(folder), "--tree", str(pristine))
    assert locked.returncode == 0, locked.stderr
    return folder


def test_one_tree_holds_one_series(vllm_tree: Path, pristine_033: Path, tmp_path: Path,
                                   m3patch_cli: CliRunner) -> None:
    """A second series (the shipped one less a patch, relocked with `series lock`) on a tree the
    first one patched is refused (exit 5) naming both and the switch; revert of the first
    removes every folder it created; then the second applies."""
    first = REPO / "patches" / "vllm-0.33.0"
    second = without_tuned_tables(tmp_path / "second", "second", pristine_033, m3patch_cli)
    root = ("--vllm-root", str(vllm_tree))
    assert m3patch_cli("apply", *root, "--series", str(first)).returncode == 0
    configs = vllm_tree / "vllm/model_executor/layers/fused_moe/configs/m3patch"
    assert configs.is_dir()
    for command in ("apply", "revert"):
        proc = m3patch_cli(command, *root, "--series", str(second))
        assert proc.returncode == errors.PatchConflict.exit_code, proc.stderr
        assert "holds series vllm-0.33.0" in proc.stderr and "not second" in proc.stderr
        assert "m3patch revert" in proc.stderr and f"--series {second}" in proc.stderr
    status = m3patch_cli("status", *root, "--series", str(second))
    assert "ledger records series vllm-0.33.0, not second" in status.stdout
    assert m3patch_cli("revert", *root, "--series", str(first)).returncode == 0
    assert not configs.exists()
    assert verify_against_record(vllm_tree) == []
    proc = m3patch_cli("apply", "--verify", *root, "--series", str(second))
    assert proc.returncode == 0, proc.stderr


def test_a_series_relocked_under_its_id_without_a_patch_is_another_series(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """The shipped series less a patch, relocked under the same id, on a tree the whole series
    patched: apply, revert, verify and status all exited 0, the dropped patch's files left
    patched. The ledger's files that the lock does not pin mark another series: 5 from apply,
    revert and status, 8 from verify, naming a file and the way back; nothing written."""
    first = REPO / "patches" / "vllm-0.33.0"
    second = without_tuned_tables(tmp_path / "vllm-0.33.0", "vllm-0.33.0", pristine_033,
                                  m3patch_cli)
    root = ("--vllm-root", str(vllm_tree))
    assert m3patch_cli("apply", *root, "--series", str(first)).returncode == 0
    ledger = (vllm_tree / "vllm/.m3patch/ledger.json").read_bytes()
    configs = vllm_tree / "vllm/model_executor/layers/fused_moe/configs/m3patch"
    expected = {"apply": errors.PatchConflict.exit_code, "revert": errors.PatchConflict.exit_code,
                "status": errors.PatchConflict.exit_code, "verify": errors.VerifyFailed.exit_code}
    for command, code in expected.items():
        proc = m3patch_cli(command, *root, "--series", str(second))
        assert proc.returncode == code, (command, proc.stdout, proc.stderr)
        said = proc.stdout + proc.stderr
        assert "earlier lock of series vllm-0.33.0" in said and "configs/m3patch/" in said
        assert "m3patch revert" in said, said
    assert (vllm_tree / "vllm/.m3patch/ledger.json").read_bytes() == ledger
    assert m3patch_cli("revert", *root, "--series", str(first)).returncode == 0
    assert not configs.exists()
    for command in ("apply", "verify", "status"):
        proc = m3patch_cli(command, *root, "--series", str(second))
        assert proc.returncode == 0, (command, proc.stderr)


def test_a_recipe_names_its_series_by_the_name_series_list_prints(tmp_path: Path) -> None:
    """A user's recipe outside the checkout says `series: vllm-0.33.0` (no patches/ folder
    beside it): the shipped series of that name is used; a folder there still wins."""
    import yaml

    from m3patch.recipe.loader import load_recipe

    data = yaml.safe_load((REPO / "recipes" / "mi300x_tp8.yaml").read_text())
    data["series"] = "vllm-0.33.0"
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    assert load_recipe(tmp_path / "mine.yaml").series_dir == REPO / "patches" / "vllm-0.33.0"
    # a folder of that name that holds no series (an unpacked vLLM sdist) does not hide it
    (tmp_path / "vllm-0.33.0").mkdir()
    assert load_recipe(tmp_path / "mine.yaml").series_dir == REPO / "patches" / "vllm-0.33.0"
    data["series"] = "${M3PATCH_NO_SUCH_VARIABLE:-vllm-0.33.0}"  # a name after expansion too
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    assert load_recipe(tmp_path / "mine.yaml").series_dir == REPO / "patches" / "vllm-0.33.0"
    data["series"] = "./vllm-0.33.0"  # a path is a path: that folder holds no series
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(SchemaError, match=r"no series\.yaml in"):
        load_recipe(tmp_path / "mine.yaml")
    data["series"] = "vllm-0.33.0"
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    shutil.copy(REPO / "patches" / "vllm-0.33.0" / "series.yaml", tmp_path / "vllm-0.33.0")
    assert load_recipe(tmp_path / "mine.yaml").series_dir == tmp_path / "vllm-0.33.0"
