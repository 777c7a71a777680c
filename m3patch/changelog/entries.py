"""The entry schema (InferenceX-compatible plus m3patch's `series`/`patches`), pure.

Raw YAML never leaves this module: each entry becomes a frozen ChangelogEntry, and every
problem becomes a Finding at the entry's line with the breadcrumb to the bad key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from m3patch.changelog.findings import Finding, error
from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_bool,
    expect_choice,
    expect_list,
    expect_mapping,
    expect_str,
    str_list,
)
from m3patch.yamlio import UniqueKeyLoader

REQUIRED_KEYS = ("config-keys", "description", "pr-link")
OPTIONAL_KEYS = ("evals-only", "all-evals", "append-only", "scenario-type", "series", "patches")
SCENARIO_TYPES = ("fixed-seq-len", "agentic-coding")
FIX_SCHEMA = ("an entry is a mapping with config-keys (a list of recipe names), description (a list "
              "of lines) and pr-link; optional: evals-only, all-evals, append-only, scenario-type, "
              "series, patches")


@dataclass(frozen=True)
class ChangelogEntry:
    line: int  # 1-based line of the entry's '- ' in the file it was read from
    config_keys: tuple[str, ...]
    description: tuple[str, ...]
    pr_link: str
    evals_only: bool = False
    all_evals: bool = False
    append_only: bool = False
    scenario_type: tuple[str, ...] = ()
    series: str | None = None
    patches: tuple[str, ...] = ()


def parse_yaml(text: str) -> tuple[Any, list[Finding]]:
    """Safe-load with duplicate keys rejected; a syntax error names its line."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader), []  # UniqueKeyLoader is a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        return None, [error("yaml", f"invalid YAML: {problem}", line, FIX_SCHEMA)]


def parse_entries(data: Any, starts: list[int]) -> tuple[list[ChangelogEntry], list[Finding]]:
    """Validate every entry; `starts` are the entries' first lines from the raw text."""
    if not isinstance(data, list):
        msg = "the file must be a YAML list of entries ('- config-keys: ...')"
        return [], [error("schema", msg, 1, FIX_SCHEMA)]
    if len(starts) != len(data):
        msg = (f"found {len(data)} entries but {len(starts)} lines starting with '- ' at column 0;"
               " every entry must start with '- ' at column 0 and nothing else may")
        return [], [error("schema", msg, None, FIX_SCHEMA)]
    entries: list[ChangelogEntry] = []
    findings: list[Finding] = []
    for index, (raw, line) in enumerate(zip(data, starts, strict=True)):
        try:
            entries.append(_entry(raw, line))
        except SchemaError as exc:
            msg = f"entry {index + 1}: {exc.one_line()}"
            findings.append(error("schema", msg, line, FIX_SCHEMA))
    return entries, findings


def _entry(raw: object, line: int) -> ChangelogEntry:
    data = expect_mapping(raw, "an entry mapping")
    check_keys(data, required=REQUIRED_KEYS, optional=OPTIONAL_KEYS)
    flags = {key: _optional_bool(data, key) for key in ("evals-only", "all-evals", "append-only")}
    if flags["append-only"] and (flags["evals-only"] or flags["all-evals"]):
        msg = "append-only cannot be combined with evals-only or all-evals"
        raise SchemaError(msg)
    return ChangelogEntry(
        line=line,
        config_keys=_strings(data, "config-keys", non_empty=True),
        description=_strings(data, "description", non_empty=True),
        pr_link=_string(data, "pr-link"),
        evals_only=flags["evals-only"],
        all_evals=flags["all-evals"],
        append_only=flags["append-only"],
        scenario_type=_scenarios(data),
        series=_string(data, "series") if "series" in data else None,
        patches=_patches(data),
    )


def _strings(data: dict[str, Any], key: str, *, non_empty: bool) -> tuple[str, ...]:
    with at_key(key):
        return str_list(data[key], non_empty=non_empty)


def _string(data: dict[str, Any], key: str) -> str:
    with at_key(key):
        return expect_str(data[key]).strip()


def _optional_bool(data: dict[str, Any], key: str) -> bool:
    if key not in data:
        return False
    with at_key(key):
        return expect_bool(data[key])


def _scenarios(data: dict[str, Any]) -> tuple[str, ...]:
    if "scenario-type" not in data:
        return ()
    chosen: list[str] = []
    with at_key("scenario-type"):
        for index, item in enumerate(expect_list(data["scenario-type"], non_empty=True)):
            with at_key(index):
                chosen.append(expect_choice(item, SCENARIO_TYPES))
    return tuple(chosen)


def _patches(data: dict[str, Any]) -> tuple[str, ...]:
    if "patches" not in data:
        return ()
    if "series" not in data:
        msg = "'patches' needs 'series' (the series folder the patch ids belong to)"
        raise SchemaError(msg)
    return _strings(data, "patches", non_empty=True)
