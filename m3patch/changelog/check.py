"""One changelog check: head bytes (+ optional base bytes) and a Catalog in, a report out.

Pure: the command module reads git or the work tree and hands the bytes here, so the rules
run on real git output in tests while this module never touches git itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from m3patch.changelog.entries import ChangelogEntry, parse_entries, parse_yaml
from m3patch.changelog.findings import Finding, errors_of, ok
from m3patch.changelog.refs import Catalog, reference_findings, selected_recipes
from m3patch.changelog.rules import Change, classify, pr_link_findings, repaired_links
from m3patch.changelog.text import (
    character_findings,
    decode,
    ending_findings,
    entry_starts,
    layout_findings,
    split_lines,
)


@dataclass(frozen=True)
class CheckInput:
    path: str  # shown in messages and annotations (repository-relative where possible)
    head: bytes
    base: bytes | None  # the file at the base ref; None: absent there (a new file)
    compare: bool  # False: no base given, every entry is checked as new
    base_label: str = "the base"
    repo: str = "m3patch/m3patch"
    pr: int | None = None


@dataclass(frozen=True)
class CheckReport:
    path: str
    kind: str  # the Change kind, or "invalid" when the file could not be read as entries
    findings: tuple[Finding, ...]
    entries: tuple[ChangelogEntry, ...]
    new_entries: tuple[ChangelogEntry, ...]
    new_recipes: tuple[str, ...] = ()  # recipe paths the new entries' config-keys select (for CI)

    @property
    def passed(self) -> bool:
        return not errors_of(self.findings)

    def to_json(self) -> dict[str, object]:
        return {
            "file": self.path, "passed": self.passed, "kind": self.kind,
            "entries": len(self.entries), "new_entries": [e.line for e in self.new_entries],
            "new_recipes": list(self.new_recipes),
            "findings": [f.to_json() for f in self.findings],
        }


def check(inp: CheckInput, catalog: Catalog) -> CheckReport:
    text, findings = decode(inp.head)
    if text is None:
        return CheckReport(inp.path, "invalid", tuple(findings), (), ())
    lines = split_lines(text)
    findings += character_findings(lines)
    findings += ending_findings(text, lines)
    if findings and not text.strip():
        return CheckReport(inp.path, "invalid", tuple(findings), (), ())
    change = _change(inp, text)
    findings += change.findings
    starts = entry_starts(lines)
    findings += layout_findings(lines, starts, change.after_line)
    data, yaml_findings = parse_yaml(text)
    findings += yaml_findings
    if yaml_findings:
        return CheckReport(inp.path, "invalid", tuple(findings), (), ())
    entries, schema_findings = parse_entries(data, starts)
    findings += schema_findings
    new = [e for e in entries if e.line > change.after_line]
    repaired, repair_findings = _repaired(inp, change, data, starts)
    if repair_findings:
        findings += repair_findings
        change = replace(change, kind="rejected")
    if change.kind != "rejected":
        for entry in new:
            findings += reference_findings(entry, catalog)
        findings += pr_link_findings(lines, new, repaired, inp.repo, inp.pr)
    if not errors_of(findings):
        findings.append(ok("summary", _summary(change, len(new), inp.base_label)))
    selected = selected_recipes([key for e in new for key in e.config_keys], catalog)
    return CheckReport(inp.path, change.kind, tuple(findings), tuple(entries), tuple(new),
                       tuple(selected))


def _change(inp: CheckInput, text: str) -> Change:
    if not inp.compare:
        return Change("new-file", 0)
    # surrogateescape keeps a non-UTF-8 base byte-faithful, so the str prefix test is a byte test
    base = None if inp.base is None else inp.base.decode("utf-8", errors="surrogateescape")
    return classify(base, text, base_label=inp.base_label)


def _repaired(inp: CheckInput, change: Change, head_data: object,
              starts: list[int]) -> tuple[dict[int, tuple[str, str]], list[Finding]]:
    if change.kind != "repair" or inp.base is None:
        return {}, []
    # a repair changes pr-link lines only, so the base's entries start on the same lines
    base_data, _ = parse_yaml(inp.base.decode("utf-8", errors="replace"))
    return repaired_links(change, base_data, head_data, starts, inp.base_label)


def _summary(change: Change, new: int, base_label: str) -> str:
    plural = "entry" if new == 1 else "entries"
    if change.kind == "repair":
        return f"pr-link repair on line(s) {', '.join(map(str, change.repaired_lines))}"
    if change.kind == "new-file":
        return f"{new} {plural} checked"
    return f"{change.kind}: {new} new {plural} since {base_label}"

