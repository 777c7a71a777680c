"""The read-only commands (locate, status, verify, and apply/revert --dry-run) write nothing
anywhere: not into the tree, not into m3patch's own cache (the parsed-patch, compile and image memos only apply may grow)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from core_helpers import CliRunner


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under root with its size and mtime (ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def test_locate_status_verify_write_nothing_and_apply_fills_the_memos(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {"M3PATCH_CACHE": str(cache)}
    where = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]

    def read_only_round() -> None:
        before_tree, before_cache = _snapshot(vllm_tree), _snapshot(cache)
        m3patch_cli("locate", "--vllm-root", str(vllm_tree), env=env)
        m3patch_cli("status", *where, env=env)
        m3patch_cli("verify", *where, env=env)
        assert _snapshot(vllm_tree) == before_tree
        assert _snapshot(cache) == before_cache

    read_only_round()  # unpatched: status parses every patch to classify its hunks
    before_tree, before_cache = _snapshot(vllm_tree), _snapshot(cache)
    for command in ("apply", "revert"):  # --dry-run: "plan and report, write nothing"
        assert m3patch_cli(command, "--dry-run", *where, env=env).returncode == 0
    assert (_snapshot(vllm_tree), _snapshot(cache)) == (before_tree, before_cache)
    assert m3patch_cli("apply", *where, env=env).returncode == 0
    assert any((cache / "parsed").iterdir())  # the control: a writing command does fill it
    assert any((cache / "images").iterdir())
    read_only_round()  # patched: verify compiles every patched .py


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_status_json_on_a_ledger_that_never_ends(kind: str, vllm_tree: Path, test_series: Path,
                                                 m3patch_cli: CliRunner) -> None:
    """`status --json` names the ledger's digest: a FIFO (blocks forever) or a link to /dev/zero
    (never ends) must be refused like any unreadable ledger, not read (found by the extended
    state fuzz: a hang and a MemoryError, exit 70)."""
    where = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert m3patch_cli("apply", *where).returncode == 0
    ledger = vllm_tree / "vllm" / ".m3patch" / "ledger.json"
    ledger.unlink()
    if kind == "fifo":
        os.mkfifo(ledger)
    else:
        ledger.symlink_to("/dev/zero")
    done = m3patch_cli("status", "--json", *where, timeout=30)
    assert done.returncode != 70, done.stderr  # status reports; verify is the gate
    assert "internal error" not in done.stderr
    assert json.loads(done.stdout)["ledger_sha256"] is None


def test_a_writing_command_after_a_read_only_one_in_one_process_fills_the_memos(
        vllm_tree: Path, test_series: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo switch was set by a read-only command and never cleared, so in one process (a
    test worker) every later apply silently stopped remembering parses."""
    from m3patch.main import main

    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    where = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert main(["status", *where]) == 0
    assert main(["apply", *where]) == 0
    assert any((tmp_path / "cache" / "parsed").iterdir())
