"""Schema, layout and reference rules of perf-changelog.yaml, checked through the CLI in a real repo."""

from __future__ import annotations

from pathlib import Path

import pytest
from changelog_repo import FILE, GitRepo, entry, link, make_repo

INVALID = 16


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GitRepo:
    return make_repo(tmp_path, monkeypatch)


def fails(repo: GitRepo, capsys: pytest.CaptureFixture[str], text: str | bytes) -> str:
    repo.write(text)
    code, out = repo.check(capsys)
    assert code == INVALID, out
    return out


def test_valid_file_passes(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    repo.write(entry(pr=link(1)) + "\n" + entry(key="recipes/mi300x_tp8.yaml", pr="XXX"))
    code, out = repo.check(capsys)
    assert code == 0, out
    assert "2 entries checked" in out


def test_duplicate_key(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry() + "  pr-link: XXX\n")
    assert f"{FILE}:6: invalid YAML: duplicate key 'pr-link' at line 6 (first at line 5)" in out


def test_malformed_yaml(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, "- config-keys: [cpu_tiny_moe\n  description: [x]\n  pr-link: XXX\n")
    assert f"{FILE}:2: invalid YAML:" in out


def test_unknown_key_suggests(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry() + "  evals-onyl: true\n")
    assert f"{FILE}:1: entry 1: unknown key 'evals-onyl'. Perhaps you meant 'evals-only'?" in out


def test_missing_required_key(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, "- config-keys: [cpu_tiny_moe]\n  description: [x]\n")
    assert f"{FILE}:1: entry 1: missing required key 'pr-link'" in out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("  config-keys: cpu_tiny_moe", "At key: config-keys: expected a list, got str"),
        ("  config-keys: []", "At key: config-keys: expected a non-empty list"),
        ("  config-keys: [3]", "At key: config-keys > At index 0: expected a string, got int"),
        ("  description: []", "At key: description: expected a non-empty list"),
        ("  pr-link:", "At key: pr-link: expected a string, got null"),
        ("  evals-only: 'yes'", "At key: evals-only: expected true or false, got str"),
        ("  scenario-type: [agentic]",
         "At key: scenario-type > At index 0: expected one of fixed-seq-len, agentic-coding,"
         " got 'agentic'. Perhaps you meant 'agentic-coding'?"),
    ],
)
def test_wrong_types(
    repo: GitRepo, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    fields = {
        "config-keys": "  config-keys: [cpu_tiny_moe]", "description": "  description: [x]",
        "pr-link": "  pr-link: XXX",
    }
    key = line.split(":")[0].strip()
    fields[key] = line
    body = "\n".join(fields.values()) + "\n"
    out = fails(repo, capsys, "- " + body[2:])
    assert f"{FILE}:1: entry 1: {message}" in out


def test_append_only_with_evals_rejected(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry() + "  append-only: true\n  all-evals: true\n")
    assert "entry 1: append-only cannot be combined with evals-only or all-evals" in out


def test_root_not_a_list(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, "config-keys: [x]\n")
    assert f"{FILE}:1: the file must be a YAML list of entries" in out


def test_recipe_that_does_not_exist(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry(key="mi355x_tp4"))
    assert f"{FILE}:1: config-keys: 'mi355x_tp4' matches no recipe under recipes/." in out
    assert "cpu_tiny_moe" not in out  # the nearest name only, never a list of every recipe
    out = fails(repo, capsys, entry(key="mi300x_tp9"))
    assert "matches no recipe under recipes/. Perhaps you meant 'mi300x_tp8'?" in out
    assert "lists the 2 recipe(s)" in out


def test_globs_must_match(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    repo.write(entry(key="mi300x_*"))
    assert repo.check(capsys)[0] == 0
    out = fails(repo, capsys, entry(key="h200_*"))
    assert "config-keys: glob 'h200_*' matches no recipe" in out


def test_series_and_patch_references(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    good = entry() + "  series: vllm-0.33.0\n  patches: [provenance, block-fp8-moe]\n"
    repo.write(good)
    assert repo.check(capsys)[0] == 0
    out = fails(repo, capsys, entry() + "  series: vllm-0.34.0\n")
    assert "series 'vllm-0.34.0' does not exist: no patches/vllm-0.34.0/series.yaml (known: vllm-0.33.0)" in out
    out = fails(repo, capsys, entry() + "  series: vllm-0.33.0\n  patches: [block-fp8]\n")
    assert ("patch 'block-fp8' is not in patches/vllm-0.33.0/series.yaml"
            " (ids: provenance, block-fp8-moe)") in out
    out = fails(repo, capsys, entry() + "  patches: [provenance]\n")
    assert "'patches' needs 'series'" in out


@pytest.mark.parametrize(
    ("raw", "where", "what"),
    [
        (entry().replace("  pr-link", "\tpr-link"), 5, "tab at column 1"),
        (entry().replace("\n", "\r\n"), 1, "carriage return (CR) at column 15"),
        (entry().replace("a change", "a\x00change"), 4, "NUL byte at column 9"),
    ],
)
def test_forbidden_characters(
    repo: GitRepo, capsys: pytest.CaptureFixture[str], raw: str, where: int, what: str
) -> None:
    out = fails(repo, capsys, raw)
    assert f"{FILE}:{where}: {what}; tabs, CR and NUL are not allowed" in out


def test_not_utf8(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry().encode() + b"# \xff\n")
    assert f"{FILE}:6: not UTF-8" in out


def test_two_blank_lines_between_entries(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry() + "\n\n" + entry())
    assert f"{FILE}:7: 2 blank lines between entries; use exactly one" in out


def test_no_blank_line_between_entries(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry() + entry())
    assert f"{FILE}:6: entry at line 6 must be preceded by exactly one blank line" in out


def test_blank_line_inside_an_entry(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry().replace("  description", "\n  description"))
    assert f"{FILE}:3: blank line inside an entry" in out


def test_missing_final_newline_on_head(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry().rstrip("\n"))
    assert f"{FILE}:5: the file does not end with a newline" in out


def test_trailing_blank_line(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, entry() + "\n")
    assert f"{FILE}:6: blank line(s) at the end of the file" in out


def test_empty_file(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(repo, capsys, "")
    assert f"{FILE}: the file has no entries" in out


def test_entry_not_at_column_zero(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    indented = "".join("  " + line for line in entry().splitlines(keepends=True))
    out = fails(repo, capsys, indented)
    assert "found 1 entries but 0 lines starting with '- ' at column 0" in out


def test_a_repository_without_patches_names_the_shipped_series(tmp_path: Path) -> None:
    """Before: in a repository with no patches/ folder (an InferenceX checkout), an entry with
    `series: vllm-0.33.0`, the name `series list` prints, was refused: "does not exist ...
    (known: none)". Such a repository runs the series that ship with m3patch; a repository
    with patches/ of its own still names only its own."""
    from m3patch.changelog.entries import ChangelogEntry
    from m3patch.changelog.refs import reference_findings
    from m3patch.changelog.sources import WorkTreeReader, build_catalog
    from m3patch.patching.series import load_series, series_path

    shipped_ids = tuple(p.id for p in load_series(series_path("vllm-0.33.0")).patches)
    entry = ChangelogEntry(line=1, config_keys=(), description=("x",), pr_link="",
                           series="vllm-0.33.0", patches=shipped_ids[:1])
    catalog = build_catalog(WorkTreeReader(tmp_path))
    assert catalog.series["vllm-0.33.0"] == shipped_ids
    assert reference_findings(entry, catalog) == []
    wrong = ChangelogEntry(line=1, config_keys=(), description=("x",), pr_link="",
                           series="vllm-0.33.0", patches=("no-such-patch",))
    assert [f.rule for f in reference_findings(wrong, catalog)] == ["patches"]
    own = tmp_path / "patches" / "mine"
    own.mkdir(parents=True)
    (own / "series.yaml").write_text("patches: []\n")
    assert set(build_catalog(WorkTreeReader(tmp_path)).series) == {"mine"}
