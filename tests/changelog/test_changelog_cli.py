"""CLI behaviour of `m3patch changelog check`: annotations, JSON report, the project's own file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from changelog_repo import FILE, REPO, GitRepo, entry, make_repo

from m3patch.changelog import CheckInput, check
from m3patch.changelog.sources import WorkTreeReader, build_catalog
from m3patch.main import main

PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GitRepo:
    return make_repo(tmp_path, monkeypatch)


def test_github_actions_annotations(
    repo: GitRepo, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    repo.write(entry(desc="one"))
    base = repo.commit()
    repo.write(entry(desc="100% new"))
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    code, out = repo.check(capsys, "--base", base)
    assert code == 16
    # '%' must be escaped as %25 in a workflow command, or GitHub mangles the message
    assert f"""::error file={FILE},line=4::line 4 edited: '    - "100%25 new"'""" in out


def test_repo_defaults_to_github_repository(
    repo: GitRepo, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from m3patch.main import main

    repo.write(entry(pr="https://github.com/someone/else/pull/3"))
    monkeypatch.setenv("GITHUB_REPOSITORY", "someone/else")
    assert main(["changelog", "check", "--pr", "3"]) == 0
    monkeypatch.setenv("GITHUB_REPOSITORY", "acme/other")
    assert main(["changelog", "check", "--pr", "3"]) == 16
    assert "expected https://github.com/acme/other/pull/3 or XXX" in capsys.readouterr().err


def test_json_report(repo: GitRepo, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    repo.write(entry(key="nope"))
    report = tmp_path / "out" / "changelog.json"
    code, _ = repo.check(capsys, "--json", str(report))
    assert code == 16
    data = json.loads(report.read_text())
    assert data["passed"] is False
    assert [(f["rule"], f["line"]) for f in data["findings"]] == [("config-keys", 1)]
    repo.write(entry(key="cpu_tiny_moe") + "\n" + entry(key="mi300x_*"))
    assert repo.check(capsys, "--json", str(report))[0] == 0
    data = json.loads(report.read_text())
    assert data["new_recipes"] == ["recipes/cpu_tiny_moe.yaml", "recipes/mi300x_tp8.yaml"]
    assert data["new_entries"] == [1, 7]


def test_json_spellings_match_the_other_commands(repo: GitRepo, capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    """`--json` alone prints the report on stdout (as apply/status/bench do); `--json-file FILE`
    writes it; `--json FILE`, the older spelling, still writes it."""
    repo.write(entry(key="cpu_tiny_moe"))
    assert main(["changelog", "check", "--repo", REPO, "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["new_recipes"] == ["recipes/cpu_tiny_moe.yaml"]
    for flag in ("--json-file", "--json"):
        report = tmp_path / f"{flag}.json"
        assert repo.check(capsys, flag, str(report))[0] == 0
        assert json.loads(report.read_text())["passed"] is True


def test_eval_task_files_under_recipes_are_no_recipes(
        repo: GitRepo, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An eval task (recipes/evals/NAME/NAME.yaml) is no recipe: a glob does not select it and
    it is never suggested."""
    repo.write("task: tiny_arith\n", "recipes/evals/tiny_arith/tiny_arith.yaml")
    repo.write(entry(key='"*"'))  # quoted: a bare * is a YAML alias
    report = tmp_path / "r.json"
    assert repo.check(capsys, "--json-file", str(report))[0] == 0
    assert json.loads(report.read_text())["new_recipes"] == [
        "recipes/cpu_tiny_moe.yaml", "recipes/mi300x_tp8.yaml"]
    repo.write(entry(key="evals/tiny_arith/tiny_arith"))
    assert repo.check(capsys)[0] == 16


def test_cli_subprocess_exit_codes(repo: GitRepo) -> None:
    repo.write(entry())
    cmd = [sys.executable, "-m", "m3patch", "changelog", "check", "--repo", REPO]
    assert subprocess.run(cmd, cwd=repo.root, capture_output=True, check=False).returncode == 0
    done = subprocess.run([*cmd, "--base", "HEAD"], cwd=repo.root, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2  # a fresh repository has no HEAD yet
    assert "unknown git ref 'HEAD'" in done.stderr
    assert "Traceback" not in done.stderr


def test_pre_commit_hook_definition_runs_this_command() -> None:
    hooks = yaml.safe_load((PROJECT / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in hooks if h["id"] == "m3patch-changelog")
    assert hook["entry"].split()[:3] == ["m3patch", "changelog", "check"]
    assert hook["files"] == r"^perf-changelog\.yaml$"
    assert hook["pass_filenames"] is False


def test_project_changelog_is_valid() -> None:
    raw = (PROJECT / FILE).read_bytes()
    inp = CheckInput(path=FILE, head=raw, base=None, compare=False)
    report = check(inp, build_catalog(WorkTreeReader(PROJECT)))
    assert report.passed, [f.message for f in report.findings]
    assert any("cpu_tiny_moe" in key for e in report.entries for key in e.config_keys)


def test_a_key_may_name_a_recipes_inferencex_config_entry(
    repo: GitRepo, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """What `bench compare --changelog-entry` writes for a recipe with a config entry selects
    that recipe here too (the CI matrix runs it)."""
    repo.write("name: mi300x_tp8\ninferencex:\n  config-entry: minimaxm3-fp8-mi300x-vllm\n",
               "recipes/mi300x_tp8.yaml")
    repo.write(entry(key="minimaxm3-fp8-mi300x-vllm"))
    report = tmp_path / "r.json"
    assert repo.check(capsys, "--json-file", str(report))[0] == 0
    assert json.loads(report.read_text())["new_recipes"] == ["recipes/mi300x_tp8.yaml"]


def _check_in_subprocess(repo: GitRepo, *args: str) -> subprocess.CompletedProcess[str]:
    # a subprocess with a deadline: the old read blocked forever on a FIFO nobody writes to
    cmd = [sys.executable, "-m", "m3patch", "changelog", "check", "--repo", REPO, *args]
    return subprocess.run(cmd, cwd=repo.root, capture_output=True, text=True, check=False,
                          timeout=20)


def test_file_that_is_a_fifo_is_refused_at_once(repo: GitRepo) -> None:
    os.mkfifo(repo.root / "pipe.yaml")
    done = _check_in_subprocess(repo, "--file", "pipe.yaml")
    assert done.returncode == 2, done.stderr
    assert "pipe.yaml: cannot read the changelog: not a regular file" in done.stderr
    assert "Traceback" not in done.stderr


def test_master_config_that_is_a_fifo_is_refused_at_once(repo: GitRepo) -> None:
    repo.write(entry())
    (repo.root / "configs").mkdir()
    os.mkfifo(repo.root / "configs" / "amd-master.yaml")
    done = _check_in_subprocess(repo)
    assert done.returncode == 2, done.stderr
    assert "amd-master.yaml: cannot read: not a regular file" in done.stderr


@pytest.mark.parametrize("number", ["0", "-5"])
def test_pr_that_is_no_pr_number_is_a_usage_error(
    repo: GitRepo, capsys: pytest.CaptureFixture[str], number: str
) -> None:
    """Before: --pr 0 and --pr -5 were taken, and a new entry had to link .../pull/0."""
    repo.write(entry(pr=f"https://github.com/{REPO}/pull/{number}"))
    code, out = repo.check(capsys, "--pr", number)
    assert code == 2, out
    assert f"--pr must be a PR number (1 or more), got {number}" in out
