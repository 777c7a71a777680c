"""The accuracy gate's exit codes are unique and documented where scripts look them up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from m3patch import errors

REPO = Path(__file__).resolve().parents[2]


def test_eval_codes_are_unique_and_in_both_tables() -> None:
    codes = [cls.exit_code for cls in errors.ALL_ERRORS]
    assert len(codes) == len(set(codes))
    doc = (REPO / "docs" / "exit-codes.md").read_text()
    for cls, code in ((errors.EvalFailed, 20), (errors.EvalError, 21)):
        assert cls.exit_code == code
        assert re.search(rf"^\| {code} +\| {cls.__name__} ", doc, re.M), cls.__name__
        assert re.search(rf"^\| {code} +\| {cls.__name__} ", errors.__doc__ or "", re.M)


def test_eval_command_fails_closed_before_asking_any_server(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "m3patch", "eval"]
    missing = subprocess.run([*run, "cpu_tiny_moe", "--lm-eval-python", str(tmp_path / "python"),
                              "--run-dir", str(tmp_path / "run")],
                             capture_output=True, text=True, cwd=REPO, check=False)
    assert missing.returncode == 21, missing.stderr
    assert f"no lm-eval interpreter at {tmp_path / 'python'}" in missing.stderr
    assert "fix: python3 -m venv " in missing.stderr and "Traceback" not in missing.stderr
    assert "/bin/pip install 'lm-eval[api]==" in missing.stderr
    assert not (tmp_path / "run").exists()
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    del data["eval"]
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    bare = subprocess.run([*run, str(tmp_path / "r.yaml")], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert bare.returncode == 2 and "no eval section" in bare.stderr


def test_eval_baseline_flags_are_checked_before_any_harness_or_server(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "m3patch", "eval", "cpu_tiny_moe", "--run-dir", str(tmp_path / "r")]
    cases = ((["--max-drop", "0.05"], "--max-drop needs --baseline"),
             (["--baseline", str(tmp_path / "b.json")], "task tiny_arith has no max-drop"),
             (["--baseline", str(tmp_path / "b.json"), "--max-drop", "nan"], "--max-drop nan"),
             (["--baseline", str(tmp_path / "b.json"), "--max-drop", "-1"], "--max-drop -1"))
    for flags, said in cases:
        done = subprocess.run([*run, *flags], capture_output=True, text=True, cwd=REPO, check=False)
        assert done.returncode == 2 and said in done.stderr, (flags, done.stderr)
        assert "Traceback" not in done.stderr and not (tmp_path / "r").exists()
