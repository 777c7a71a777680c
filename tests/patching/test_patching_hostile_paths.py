"""Security: a patch never reaches outside the vLLM tree however its path is spelled; YAML is
loaded safely; recipe values reach vLLM as argv elements, never through a shell; manifest paths
stay in their series folder. Real tree, real CLI entry (in-process)."""

from __future__ import annotations

import ast
import contextlib
import io
import shutil
from pathlib import Path

import pytest
import yaml

from m3patch import errors
from m3patch.main import main

REPO = Path(__file__).resolve().parents[2]
SAFE_CODES = {0, errors.UsageError.exit_code, errors.PatchConflict.exit_code,
              errors.TreeIOError.exit_code, errors.HostilePatch.exit_code}


def cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


def series_with(tmp_path: Path, patch: str) -> Path:
    series = tmp_path / "series"
    series.mkdir(exist_ok=True)
    (series / "0001-x.patch").write_bytes(patch.encode("utf-8", "surrogateescape"))
    (series / "series.yaml").write_text(
        "schema: 1\nid: hostile\ntarget: {vllm-version: '0.33.0'}\npatches:\n"
        "  - {id: x, file: 0001-x.patch, summary: s, why: w, upstream: [], drop-when: never}\n")
    return series


def outside_vllm(box: Path) -> set[str]:
    """Every path under `box` except those inside <box>/site-packages/vllm/."""
    inside = box / "site-packages" / "vllm"
    return {str(p.relative_to(box)) for p in box.rglob("*")
            if p != inside and not p.is_relative_to(inside)}


HOSTILE_NAMES = [
    "vllm/../../pwned.py", "vllm/./../../pwned.py", "./vllm/../../pwned.py", "vllm//../../pwned.py",
    "vllm/sub/../../../pwned.py", "vllm/../vllm/../../pwned.py", "/tmp/pwned.py", "//tmp/pwned.py",
    "vllm/..", "vllm/.", "vllm", "../vllm/x.py", "~/pwned.py", "vllm/\u2025/pwned.py",
    "vllm/\uff0e\uff0e/\uff0e\uff0e/pwned.py", "vllm/..\\..\\pwned.py", "C:/pwned.py",
    "vllm/x\x00/../../pwned.py", "vllm/" + "a" * 300 + ".py", "vllm/" + "d/" * 2100 + "x.py",
    "vllm/.m3patch/ledger.json", "vllm/.m3patch/lock", "vllm/x.py\t2024-01-01 00:00:00",
    '"vllm/\\056\\056/\\056\\056/pwned.py"', "vllm/\udcff.py", "vllm/ ../../pwned.py",
]


LONG_NAME_BUG = ("bug (fixed): diffs.safe_target called Path.is_symlink() on each component; a name "
                 "over NAME_MAX (255 bytes) or a path over PATH_MAX raises OSError ENAMETOOLONG, "
                 "which escapes as an internal error (exit 70) instead of exit 9/2")


def _hostile_params() -> list[object]:
    long_names = {"vllm/" + "a" * 300 + ".py", "vllm/" + "d/" * 2100 + "x.py"}
    # LONG_NAME_BUG was found here and fixed in diffs.safe_target: plain regression cases now
    return [pytest.param(name, id=("long-" if name in long_names else "") + str(index))
            for index, name in enumerate(HOSTILE_NAMES)]


@pytest.mark.parametrize("name", _hostile_params())
def test_a_patch_never_writes_outside_the_tree(tmp_path: Path, pristine_033: Path,
                                               name: str) -> None:
    """A new-file diff needs no context, so a path that passes the checks would be written."""
    from m3patch.patching.pristine import copy_tree

    root = copy_tree(pristine_033, tmp_path / "box" / "site-packages")
    (tmp_path / "box" / "outside.txt").write_text("keep\n")
    before = outside_vllm(tmp_path / "box")
    src = "/dev/null"
    dst = name if name.startswith(('"', "/")) else f"b/{name}"
    patch = f"--- {src}\n+++ {dst}\n@@ -0,0 +1 @@\n+PWNED = 1\n"
    series = series_with(tmp_path, patch)
    lock_code, lock_err = cli("series", "lock", "--series", str(series), "--tree", str(root))
    assert lock_code in SAFE_CODES, lock_err
    assert "Traceback" not in lock_err and "internal error" not in lock_err, lock_err
    if lock_code == 0:
        code, stderr = cli("apply", "--vllm-root", str(root), "--series", str(series))
        assert code in SAFE_CODES and "internal error" not in stderr, stderr
    after = outside_vllm(tmp_path / "box")
    assert after == before, f"written outside the tree: {after - before}"
    pwned = [p for p in (tmp_path / "box").rglob("*") if p.is_file() and "PWNED" in
             p.read_text(errors="replace") and not p.resolve().is_relative_to(root / "vllm")]
    assert pwned == []


def test_a_symlinked_parent_inside_the_tree_that_points_out_is_refused(
        tmp_path: Path, vllm_tree: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (vllm_tree / "vllm" / "escape").symlink_to(outside)
    series = series_with(tmp_path, "--- /dev/null\n+++ b/vllm/escape/x.py\n@@ -0,0 +1 @@\n+P = 1\n")
    code, stderr = cli("series", "lock", "--series", str(series), "--tree", str(vllm_tree))
    if code == 0:
        code, stderr = cli("apply", "--vllm-root", str(vllm_tree), "--series", str(series))
    assert code == errors.HostilePatch.exit_code, stderr
    assert list(outside.iterdir()) == []


# ---------------------------------------------------------------- YAML and shell


def _python_sources() -> list[Path]:
    return sorted((REPO / "m3patch").rglob("*.py")) + sorted((REPO / "scripts").glob("*.py"))


def _calls(path: Path) -> list[tuple[str, ast.Call]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found.append((ast.unparse(node.func), node))
    return found


def test_yaml_is_only_loaded_safely() -> None:
    unsafe = []
    for path in _python_sources():
        for func, call in _calls(path):
            if func in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all"):
                unsafe.append(f"{path}:{call.lineno}: {func}")
            if func == "yaml.load":
                loader = next((ast.unparse(k.value) for k in call.keywords if k.arg == "Loader"),
                              None)
                if loader not in ("UniqueKeyLoader", "yaml.SafeLoader", "yaml.CSafeLoader"):
                    unsafe.append(f"{path}:{call.lineno}: yaml.load(Loader={loader})")
    assert unsafe == []
    # and the loader in use really is a SafeLoader: a python tag is refused as a usage error
    from m3patch.yamlio import load_yaml_text

    with pytest.raises(errors.UsageError, match="invalid YAML"):
        load_yaml_text("x: !!python/object/apply:os.system ['true']\n", source="t.yaml")


def test_no_shell_anywhere() -> None:
    shells = []
    for path in _python_sources():
        for func, call in _calls(path):
            if func in ("os.system", "os.popen", "subprocess.getoutput",
                        "subprocess.getstatusoutput", "os.execlp", "os.spawnlp"):
                shells.append(f"{path}:{call.lineno}: {func}")
            for kw in call.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                              and kw.value.value is False):
                    shells.append(f"{path}:{call.lineno}: shell={ast.unparse(kw.value)}")
    assert shells == []


INJECTIONS = ["; touch /tmp/m3patch-pwned", "$(touch /tmp/m3patch-pwned)", "`id`", "a' b \"c",
              "x\ny", "--trust-remote-code", "&& rm -rf ~", "|| true", "${HOME}", "*"]


@pytest.mark.parametrize("value", INJECTIONS, ids=range(len(INJECTIONS)))
def test_recipe_values_reach_vllm_as_single_argv_elements(tmp_path: Path, value: str) -> None:
    from m3patch.recipe.loader import load_recipe
    from m3patch.serving.launch_plan import plan_launch

    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["vllm-args"]["served-model-name-extra"] = value
    data["env"]["M3PATCH_TEST_VALUE"] = value
    data["model"]["source"] = f"/models/{value}"
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(yaml.safe_dump(data))
    try:
        recipe = load_recipe(recipe_path)
    except errors.UsageError as exc:  # refusing the value outright is also safe
        assert "Traceback" not in str(exc)
        return
    plan = plan_launch(recipe, "/usr/bin/python3", 8000, tmp_path / "server.log", None)
    argv = list(plan.spec.argv)
    # paths expand ${VAR} and ~ (documented recipe feature); vllm-args values are verbatim
    from m3patch.recipe.paths import expand

    assert value in argv and str(Path(expand(f"/models/{value}")).absolute()) in argv
    assert plan.spec.env["M3PATCH_TEST_VALUE"] == value
    assert not Path("/tmp/m3patch-pwned").exists()


# ---------------------------------------------------------------- manifest confinement


@pytest.mark.parametrize("file", ["../0001-x.patch", "/etc/hostname", "sub/../0001-x.patch",
                                  "..", ".", "", "0001-x.patch\x00"])
def test_manifest_patch_paths_stay_in_the_series_folder(tmp_path: Path, file: str) -> None:
    series = series_with(tmp_path, "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-a\n+b\n")
    shutil.copy(series / "0001-x.patch", tmp_path / "0001-x.patch")
    text = (series / "series.yaml").read_text().replace("file: 0001-x.patch", f"file: {file!r}")
    (series / "series.yaml").write_text(text)
    code, stderr = cli("series", "show", "--series", str(series))
    assert code == errors.UsageError.exit_code, stderr
    assert stderr.startswith("m3patch: error: ")


# Regression (found by this suite, fixed by the owner):
# "bug: series._patch checks `'/' not in file and (directory / file).is_file()`, which "
# "follows a symlink: a patch file that is a symlink out of the series folder is read"
def test_a_symlinked_patch_file_pointing_out_of_the_series_is_refused(tmp_path: Path) -> None:
    series = series_with(tmp_path, "")
    outside = tmp_path / "elsewhere.patch"
    outside.write_text("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-a\n+b\n")
    (series / "0001-x.patch").unlink()
    (series / "0001-x.patch").symlink_to(outside)
    code, stderr = cli("series", "show", "--series", str(series))
    assert code == errors.UsageError.exit_code, stderr
