"""The docs say what the shipped files hold: the README's series table lists every patch of
every shipped series in apply order, no paragraph of the docs is pasted twice, and a recipe's
header comment names recipes that exist (never itself as its sibling)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from m3patch.patching.series import load_series

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"),
               *(REPO / "patches").glob("*/README.md")])


def series_table() -> dict[str, list[str]]:
    """README's series table: folder -> the backticked patch ids of its patches column."""
    rows: dict[str, list[str]] = {}
    for line in (REPO / "README.md").read_text().splitlines():
        match = re.match(r"\| `patches/([^/`]+)/` \|[^|]*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = re.findall(r"`([a-z0-9-]+)`", match.group(2))
    return rows


def test_series_table_lists_every_patch_of_every_shipped_series() -> None:
    rows = series_table()
    folders = sorted(p.parent.name for p in (REPO / "patches").glob("*/series.yaml"))
    assert sorted(rows) == folders
    for folder in folders:
        patches = [p.id for p in load_series(REPO / "patches" / folder, with_lock=False).patches]
        assert rows[folder] == patches, f"README's row for patches/{folder}/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_sentence_is_pasted_twice(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    sentences = re.split(r"(?<=[.;:)])\s", re.sub(r"\s+", " ", text))
    counts = Counter(s for s in sentences if len(s) >= 40 and not s.startswith("|"))
    assert [s for s, n in counts.items() if n > 1] == []


def test_recipe_headers_name_existing_siblings_never_themselves() -> None:
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        header = "".join(line for line in recipe.read_text().splitlines(keepends=True)
                         if line.startswith("#"))
        for named in re.findall(r"recipes/([\w.-]+\.yaml)", header):
            assert named != recipe.name, f"{recipe.name}'s header names itself as its sibling"
            assert (REPO / "recipes" / named).is_file(), f"{recipe.name} names {named}"
