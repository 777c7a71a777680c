"""Append-only rules against a base ref, on real git repositories (git init, commits)."""

from __future__ import annotations

from pathlib import Path

import pytest
from changelog_repo import FILE, GitRepo, entry, link, make_repo

INVALID = 16


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GitRepo:
    return make_repo(tmp_path, monkeypatch)


def test_plain_append_accepted(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    base = repo.write(entry(pr=link(1))) or repo.commit()
    repo.write(entry(pr=link(1)) + "\n" + entry(pr=link(7)))
    code, out = repo.check(capsys, "--base", base, "--pr", "7")
    assert code == 0, out
    assert "append: 1 new entry" in out


def test_append_after_missing_final_newline_accepted(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    # The InferenceX #1753 incident: git diff shows the base's last line as deleted.
    old = entry(pr=link(1798)).rstrip("\n")
    repo.write(old)
    base = repo.commit()
    repo.write(old + "\n\n" + entry(key="mi300x_tp8", pr=link(1753)))
    diff = repo.git("diff", base, "--", FILE)
    assert f"-  pr-link: {link(1798)}" in diff  # what the old line-based scan rejected
    code, out = repo.check(capsys, "--base", base, "--pr", "1753")
    assert code == 0, out


def test_extending_a_base_line_without_newline_rejected(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write(entry(pr=link(17)).rstrip("\n"))
    base = repo.commit()
    repo.write(entry(pr=link(17)).rstrip("\n") + "99\n")
    code, out = repo.check(capsys, "--base", base)
    assert code == INVALID
    assert f"{FILE}:5: line 5 was extended: '  pr-link: {link(1799)}'" in out


def test_pr_link_repair_alone_accepted(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    repo.write(entry(pr="XXX") + "\n" + entry(pr=f"{link(5)}/changes"))
    base = repo.commit()
    repo.write(entry(pr=link(4)) + "\n" + entry(pr=link(5)))
    code, out = repo.check(capsys, "--base", base)
    assert code == 0, out
    assert "pr-link repair on line(s) 5, 11" in out


def test_pr_link_repair_to_a_non_pr_url_rejected(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write(entry(pr="XXX"))
    base = repo.commit()
    repo.write(entry(pr="https://github.com/other/repo/pull/4"))
    code, out = repo.check(capsys, "--base", base)
    assert code == INVALID
    assert f"{FILE}:5: repaired pr-link 'https://github.com/other/repo/pull/4' is not a PR URL" in out


@pytest.mark.parametrize("quote", ["", '"'])
def test_pr_link_repair_of_a_valid_link_rejected(
    repo: GitRepo, capsys: pytest.CaptureFixture[str], quote: str
) -> None:
    """Quoted, the base's link is the same value: it was judged by the raw line before."""
    repo.write(entry(pr=f"{quote}{link(1)}{quote}"))
    base = repo.commit()
    repo.write(entry(pr=link(2)))
    code, out = repo.check(capsys, "--base", base)
    assert code == INVALID
    assert f"{FILE}:5: pr-link '{link(1)}' was already a PR URL" in out


def test_pr_link_repair_mixed_with_new_entry_rejected(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write(entry(pr="XXX"))
    base = repo.commit()
    repo.write(entry(pr=link(4)) + "\n" + entry(pr=link(9)))
    code, out = repo.check(capsys, "--base", base, "--pr", "9")
    assert code == INVALID
    assert f"{FILE}:5: line 5 repairs a historical pr-link, and lines from 6 add new entries" in out


def test_deleted_entry_rejected(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    repo.write(entry(desc="one") + "\n" + entry(desc="two") + "\n" + entry(desc="three"))
    base = repo.commit()
    repo.write(entry(desc="one") + "\n" + entry(desc="three"))
    code, out = repo.check(capsys, "--base", base)
    assert code == INVALID
    assert "entries were deleted (base has 3, head has 2)" in out
    assert f"""{FILE}:10: entries were deleted (base has 3, head has 2): base entry 2 (base line 7) is gone, its line '    - "two"' missing; head line 10 is '    - "three"'""" in out


def test_edited_description_rejected_naming_the_line(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write(entry(desc="one") + "\n" + entry(desc="two"))
    base = repo.commit()
    repo.write(entry(desc="one") + "\n" + entry(desc="TWO") + "\n" + entry(pr=link(3)))
    code, out = repo.check(capsys, "--base", base, "--pr", "3")
    assert code == INVALID
    assert f"""{FILE}:10: line 10 edited: '    - "TWO"' (base line 10: '    - "two"')""" in out


def test_reorder_rejected(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = entry(desc="one"), entry(key="mi300x_tp8", desc="two")
    repo.write(first + "\n" + second)
    base = repo.commit()
    repo.write(second + "\n" + first)
    code, out = repo.check(capsys, "--base", base)
    assert code == INVALID
    assert f"{FILE}:1: entries reordered: line 1 '- config-keys:' starts entry 1, which was entry 2" in out


def test_entry_inserted_before_existing_ones_rejected(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write(entry(desc="one"))
    base = repo.commit()
    repo.write(entry(key="mi300x_tp8", desc="new", pr=link(2)) + "\n" + entry(desc="one"))
    code, out = repo.check(capsys, "--base", base, "--pr", "2")
    assert code == INVALID
    assert f"{FILE}:1: line 1 starts a new entry inserted before existing entry 1" in out


def test_append_that_continues_the_last_entry_rejected(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write(entry())
    base = repo.commit()
    repo.write(entry() + "  append-only: true\n")
    code, out = repo.check(capsys, "--base", base)
    assert code == INVALID
    assert f"{FILE}:6: line 6 '  append-only: true' continues the last existing entry" in out


def test_new_entry_must_link_its_own_pr(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    repo.write(entry(pr=link(1)))
    base = repo.commit()
    repo.write(entry(pr=link(1)) + "\n" + entry(pr=link(8)))
    code, out = repo.check(capsys, "--base", base, "--pr", "9")
    assert code == INVALID
    assert f"{FILE}:11: the new entry at line 7 has pr-link '{link(8)}'; expected {link(9)} or XXX" in out
    repo.write(entry(pr=link(1)) + "\n" + entry(pr="TBD"))
    code, out = repo.check(capsys, "--base", base)
    assert code == INVALID
    assert "has pr-link 'TBD'" in out
    repo.write(entry(pr=link(1)) + "\n" + entry(pr="XXX"))
    assert repo.check(capsys, "--base", base, "--pr", "9")[0] == 0


def test_file_absent_at_base_is_all_new(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    base = repo.commit("no changelog yet")
    repo.write(entry(pr=link(3)))
    code, out = repo.check(capsys, "--base", base, "--pr", "3")
    assert code == 0, out
    assert "1 entry checked" in out


def test_head_ref_is_read_from_git_not_the_work_tree(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write(entry())
    base = repo.commit()
    repo.write(entry() + "\n" + entry(pr=link(4)))
    head = repo.commit()
    repo.write("garbage: [\n")  # the work tree is broken; --head must not look at it
    code, out = repo.check(capsys, "--base", base, "--head", head, "--pr", "4")
    assert code == 0, out


def test_unknown_ref_is_a_usage_error(repo: GitRepo, capsys: pytest.CaptureFixture[str]) -> None:
    repo.write(entry())
    repo.commit()
    code, out = repo.check(capsys, "--base", "no-such-branch")
    assert code == 2
    assert "unknown git ref 'no-such-branch'" in out


@pytest.mark.parametrize("spelling", ['"XXX"', "'XXX'", "XXX # filled in once the PR exists",
                                      f'"{link(9)}"', f"{link(9)}  # this PR"])
def test_pr_link_is_judged_by_its_parsed_value(
    repo: GitRepo, capsys: pytest.CaptureFixture[str], spelling: str
) -> None:
    repo.write(entry(pr=link(1)))
    base = repo.commit()
    repo.write(entry(pr=link(1)) + "\n" + entry(pr=spelling))
    code, out = repo.check(capsys, "--base", base, "--pr", "9")
    assert code == 0, out


def test_pr_link_continued_on_the_next_line_rejected(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    # a plain scalar folds its continuation in: the value is not the first line's URL
    repo.write(entry(pr=f"{link(9)}\n    and-more"))
    code, out = repo.check(capsys, "--pr", "9")
    assert code == INVALID
    assert f"{FILE}:5: the new entry at line 1 has pr-link '{link(9)} and-more'" in out


def test_pr_link_lookalike_inside_a_string_is_not_the_pr_link(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = f'"a\n  pr-link: {link(9)}\n      b"'
    repo.write(entry(desc="x", pr="TBD").replace('"x"', fake))
    code, out = repo.check(capsys, "--pr", "9")
    assert code == INVALID
    assert "has pr-link 'TBD'" in out


def test_pr_link_repair_to_a_quoted_pr_url_accepted(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write(entry(pr="XXX"))
    base = repo.commit()
    repo.write(entry(pr=f'"{link(4)}"  # repaired'))
    code, out = repo.check(capsys, "--base", base)
    assert code == 0, out


def test_edit_of_a_pr_link_lookalike_inside_a_string_rejected(
    repo: GitRepo, capsys: pytest.CaptureFixture[str]
) -> None:
    # the edited line starts like a pr-link, but it is a line of the description
    def changelog(inner: str) -> str:
        return entry(desc="x", pr="XXX").replace('"x"', f'"a\n  pr-link: {inner}\n      b"')
    repo.write(changelog("one"))
    base = repo.commit()
    repo.write(changelog(link(3)))
    code, out = repo.check(capsys, "--base", base)
    assert code == INVALID
    assert f"{FILE}:5: line 5 edited: it is not the pr-link of the entry at line 1" in out
