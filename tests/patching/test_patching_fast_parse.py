"""The fast patch reading (unidiff's metadata-only parse, hunk lines read by m3patch) gives
exactly the model of unidiff's full parse, or exactly its error: on every patch this repository
ships, on hand-made edge cases (trailing blank lines and "no newline" markers after a hunk,
CRLF and bare line-break body lines, empty hunks, malformed counts) and on random line soups
made of diff-shaped lines (hypothesis)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3patch.errors import M3PatchError
from m3patch.patching.diffs import PatchFile, parse_patch

REPO = Path(__file__).resolve().parents[2]
HEAD = "diff --git a/vllm/x.py b/vllm/x.py\n--- a/vllm/x.py\n+++ b/vllm/x.py\n"
NEW = ("diff --git a/vllm/n.py b/vllm/n.py\nnew file mode 100755\nindex 0000000..1111111\n"
       "--- /dev/null\n+++ b/vllm/n.py\n")

EDGES = {
    "trailing blank line after a hunk": HEAD + "@@ -1,2 +1,2 @@ def f():\n a\n-b\n+c\n\n",
    "two blank lines and a marker after": HEAD + "@@ -1 +1 @@\n-a\n+b\n\n\n\\ No newline at end of file\n",
    "marker inside the body": HEAD + "@@ -1,2 +1,2 @@\n c\n-a\n\\ No newline at end of file\n+b\n"
                              "\\ No newline at end of file\n",
    "crlf and bare line breaks": HEAD + "@@ -1,4 +1,4 @@\n a\r\n\r\n\n-b\r\n+c\r\n",
    "a bare carriage return line": HEAD + "@@ -1,2 +1,2 @@\n\rx\n-b\n+c\n",
    "an empty hunk and a marker": HEAD + "@@ -0,0 +0,0 @@\n\\ No newline at end of file\n",
    "a new file": NEW + "@@ -0,0 +1,2 @@\n+a\n+b\n",
    "two files, several hunks": HEAD + "@@ -1 +1 @@\n-a\n+b\n@@ -5,2 +5,3 @@ class A:\n x\n+y\n z\n"
                                + NEW + "@@ -0,0 +1 @@\n+n\n",
    "a header-looking line in the patch info": "@@ not a header\n" + HEAD + "@@ -1 +1 @@\n-a\n+b\n",
    "hunk longer than its header": HEAD + "@@ -1 +1 @@\n-a\n+b\n+c\n",
    "hunk shorter than its header": HEAD + "@@ -1,3 +1,3 @@\n-a\n+b\n",
    "garbage in the body": HEAD + "@@ -1,2 +1,2 @@\n-a\n@b\n+c\n",
    "hunk before any file": "@@ -1 +1 @@\n-a\n+b\n",
    "marker before any hunk": HEAD + "\\ No newline at end of file\n",
}


def _outcome(data: bytes, *, full: bool) -> PatchFile | tuple[str, str]:
    try:
        return parse_patch(data, "p.patch", full=full)
    except M3PatchError as exc:
        return type(exc).__name__, str(exc)


def _same(data: bytes) -> None:
    assert _outcome(data, full=False) == _outcome(data, full=True)


@pytest.mark.parametrize("case", sorted(EDGES))
def test_edge_cases_read_as_the_full_parse_reads_them(case: str) -> None:
    _same(EDGES[case].encode())


def test_every_shipped_patch_reads_as_the_full_parse_reads_it() -> None:
    shipped = sorted({*REPO.glob("patches/**/*.patch"), *REPO.glob("tests/data/**/*.patch")})
    assert len(shipped) > 10
    for path in shipped:
        _same(path.read_bytes())


BODY = st.sampled_from(["-a\n", "+b\n", " c\n", "\n", "\r\n", "\\ No newline at end of file\n",
                        "-\n", "+x\r\n", " \n", "@@ -1 +1 @@\n", "@@ -1,2 +1,2 @@ s\n",
                        "@@ -0,0 +1 @@\n", "@@ -2,0 +2 @@\n", "junk\n", "\rq\n"])
SOUP = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@SOUP
@given(st.lists(BODY, max_size=14), st.booleans())
def test_random_line_soups_read_as_the_full_parse_reads_them(body: list[str], new: bool) -> None:
    _same(((NEW if new else HEAD) + "".join(body)).encode())
