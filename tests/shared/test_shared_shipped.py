"""Series and recipes travel with the tool: the wheel and sdist carry copies of the top-level
patches/ and recipes/ under m3patch/_shipped/, and an installed m3patch (the wheel unpacked on
sys.path, run from a folder outside the checkout) finds them by name.

The builds run setuptools' own PEP 517 backend (what pip calls) on a copy of the checkout's
source files, so the worktree itself is never written to.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from core_helpers import REPO

pytestmark = pytest.mark.slow

SHIPPED = ("patches", "recipes")
BUILD = ("from setuptools import build_meta as b; import sys; "
         "print(b.build_sdist('dist') if sys.argv[1] == 'sdist' else b.build_wheel('dist'))")


def _source_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    return [f for f in listed if (REPO / f).is_file() and not f.startswith("results/")]


def _shipped_sources() -> dict[str, bytes]:
    return {f: (REPO / f).read_bytes() for f in _source_files() if f.split("/")[0] in SHIPPED}


def _build(src: Path, what: str) -> Path:
    proc = subprocess.run([sys.executable, "-c", BUILD, what], cwd=src, capture_output=True,
                          text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return src / "dist" / proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A fresh copy of the source files, its sdist and wheel, and a wheel built from the sdist."""
    src = tmp_path_factory.mktemp("src")
    for rel in _source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes((REPO / rel).read_bytes())
    sdist = _build(src, "sdist")
    wheel = _build(src, "wheel")
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    from_sdist = _build(next(unpacked.iterdir()), "wheel")
    return {"src": src, "sdist": sdist, "wheel": wheel, "wheel_from_sdist": from_sdist}


@pytest.fixture(scope="module")
def installed(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel unpacked as site-packages would hold it (no checkout anywhere near it)."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(built["wheel"]) as whl:
        whl.extractall(site)
    return site


def test_wheel_carries_every_shipped_file_byte_for_byte(built: dict[str, Path]) -> None:
    expected = _shipped_sources()
    assert any(f.endswith("series.lock.json") for f in expected)
    for key in ("wheel", "wheel_from_sdist"):
        with zipfile.ZipFile(built[key]) as whl:
            bundled = {n.removeprefix("m3patch/_shipped/"): whl.read(n) for n in whl.namelist()
                       if n.startswith("m3patch/_shipped/")}
        assert bundled == expected, key


def test_sdist_carries_the_sources_and_the_bundled_copy(built: dict[str, Path]) -> None:
    with tarfile.open(built["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for rel in _shipped_sources():
        assert rel in names
        assert f"m3patch/_shipped/{rel}" in names
    assert "setup.py" in names


def test_building_writes_nothing_into_the_source_tree(built: dict[str, Path]) -> None:
    assert not (built["src"] / "m3patch" / "_shipped").exists()


def _run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    env.update(PYTHONPATH=str(site), COLUMNS="250",
               M3PATCH_CRASH_DIR=str(cwd / "crash"), HOME=str(cwd))
    return subprocess.run([sys.executable, "-m", "m3patch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False, timeout=120)


def test_installed_tool_finds_recipes_and_series_by_name(installed: Path, tmp_path: Path) -> None:
    bundle = installed / "m3patch" / "_shipped"
    show = _run_installed(installed, tmp_path, "recipe", "show", "mi300x_tp8")
    assert show.returncode == 0, show.stderr
    # The recipe's `series: vllm-0.33.0` (a shipped series' name) lands on the bundled copy.
    assert f"# series {bundle / 'patches' / 'vllm-0.33.0'} " in show.stdout
    dry = _run_installed(installed, tmp_path, "serve", "cpu_tiny_moe.yaml", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"# series {bundle / 'patches' / 'vllm-0.32.0'} " in dry.stdout
    listing = _run_installed(installed, tmp_path, "series", "list")
    assert listing.returncode == 0, listing.stderr
    assert f"shipped series in {bundle / 'patches'}:" in listing.stdout
    assert "vllm-0.33.0" in listing.stdout and "vllm-0.32.0" in listing.stdout
    assert not any(tmp_path.glob("results*")), "a dry run wrote into the working directory"
