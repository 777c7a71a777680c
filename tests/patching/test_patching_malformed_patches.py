"""Faults a hostile review found in the patch reader, verify and run-folder writes: each of these
failed before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from core_helpers import CliRunner, make_series

from m3patch.errors import UsageError
from m3patch.patching.diffs import parse_patch

HEAD = "diff --git a/vllm/version.py b/vllm/version.py\n--- a/vllm/version.py\n+++ b/vllm/version.py\n"
HUNK = ("@@ -1,2 +1,2 @@\n # SPDX-License-Identifier: Apache-2.0\n"
        "-# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
        "+# SPDX-FileCopyrightText: X\n")
LONG = "n" * 300


def test_a_blank_line_after_a_hunk_adds_no_line() -> None:
    # git apply and GNU patch ignore it; m3patch put an extra "\n" on the new side
    plain = parse_patch((HEAD + HUNK).encode(), "p")
    trailing = parse_patch((HEAD + HUNK + "\n").encode(), "p")
    assert trailing.files[0].hunks[0].new_lines == plain.files[0].hunks[0].new_lines


def test_a_whole_crlf_patch_is_not_called_a_rename() -> None:
    with pytest.raises(UsageError) as caught:
        parse_patch((HEAD + HUNK).replace("\n", "\r\n").encode(), "p")
    assert "CRLF" in caught.value.message and "rename" not in caught.value.message
    assert "\r" not in caught.value.message


def test_verify_of_a_file_too_deep_to_compile_is_a_verify_failure(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli) -> None:
    diff = ("diff --git a/vllm/deep.py b/vllm/deep.py\nnew file mode 100644\n--- /dev/null\n"
            "+++ b/vllm/deep.py\n@@ -0,0 +1 @@\n+x = " + "-" * 5000 + "1\n")
    series = make_series(tmp_path / "s", pristine_033, [diff])
    done = m3patch_cli("apply", "--series", str(series), "--vllm-root", str(vllm_tree))
    assert done.returncode == 0, done.stderr
    done = m3patch_cli("verify", "--series", str(series), "--vllm-root", str(vllm_tree))
    assert done.returncode == 6, done.stderr  # VerifyFailed naming vllm/deep.py, not 70





def test_a_removed_sql_comment_in_a_crlf_file_is_not_a_crlf_header() -> None:
    # a body line "--- x\r\n" (a removed "-- x" of a CRLF file) under a git header is content
    diff = ("diff --git a/vllm/q.sql b/vllm/q.sql\n--- a/vllm/q.sql\n+++ b/vllm/q.sql\n"
            "@@ -1,2 +1,1 @@\n a\r\n--- x\r\n")
    patch = parse_patch(diff.encode(), "p")
    assert patch.files[0].hunks[0].old_lines == ("a\r\n", "-- x\r\n")


def test_a_parse_memo_from_another_parser_is_parsed_afresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an entry an older reading wrote (here: the extra blank line it used to add) must not
    # outlive the fix that changed the reading
    from m3patch.patching import memo, parse_cache
    from m3patch.patching.ledger import digest

    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(memo._STATE, "read_only", False)  # whatever an earlier test's command left
    data = (HEAD + HUNK + "\n").encode()
    sha = digest(data)
    right = parse_cache.parsed(data, "p", sha)  # fills the memo
    entry = parse_cache._path(sha)
    head, body = (json.loads(part) for part in entry.read_bytes().split(b"\n", 1))
    body[0][0][5] += "\n"  # a new side with the blank line

    def write() -> None:
        entry.write_text(json.dumps(head) + "\n" + json.dumps(body) + "\n")

    head["parser"] = "older-unidiff-1.0.1"
    write()
    assert parse_cache.parsed(data, "p", sha) == right
    head["parser"] = parse_cache.parser_fingerprint()  # the control: this parser's entry is read
    write()
    assert parse_cache.parsed(data, "p", sha) != right


def test_a_hunk_whose_counts_lie_is_refused_not_cut_short() -> None:
    # the "-"/"+" lines past the header's count were dropped: the lock pinned "no change"
    short = HEAD + "@@ -1,1 +1,1 @@\n # SPDX-License-Identifier: Apache-2.0\n-b\n+c\n"
    with pytest.raises(UsageError) as caught:
        parse_patch(short.encode(), "p")
    assert "line 6" in caught.value.message and "counts lie" in caught.value.message


def test_an_empty_hunk_is_refused() -> None:
    with pytest.raises(UsageError, match="is empty"):
        parse_patch((HEAD + "@@ -30,0 +30,0 @@\n").encode(), "p")


def test_format_patch_signature_and_next_file_headers_are_not_lying_counts() -> None:
    text = HEAD + HUNK + HEAD.replace("version.py", "envs.py") + HUNK + "-- \n2.43.0\n\n"
    assert len(parse_patch(text.encode(), "p").files) == 2
    plain = "".join(x for x in text.splitlines(keepends=True) if not x.startswith("diff --git"))
    assert plain.count("--- a/") == 2  # diff -u style: the next file starts at its "---" line
    assert len(parse_patch(plain.encode(), "p").files) == 2


def test_a_conflict_on_a_missing_line_break_shows_the_difference() -> None:
    from m3patch.patching.hunks import difference

    assert difference(["a\n", "b"], 1, ("b\n",)) == (2, "b\n", "b")
    assert difference(["a\n"], -1, ("a\n",)) == (0, "a", "<before line 1>")
    assert difference(["a\n"], 1, ("b\n",)) == (2, "b", "<end of file>")


def test_a_patch_that_does_not_fit_at_lock_time_names_a_command_that_works(
        pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    # the hint was `m3patch status --json`, which needs the lock this run could not write
    wrong = HUNK.replace(" # SPDX-License-Identifier", " # not the first line")
    series = make_series(tmp_path / "s", None, [HEAD + wrong])
    done = m3patch_cli("series", "lock", "--series", str(series), "--tree", str(pristine_033))
    assert done.returncode == 5, done.stderr
    assert "does not apply exactly" in done.stderr and "series port" in done.stderr
    assert "status --json" not in done.stderr
    assert not (series / "series.lock.json").exists()
