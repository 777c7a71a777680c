"""Changelog findings: result objects with a status, reduced once into the exit code.

Every rule returns findings instead of raising, so one run reports every problem it can see
(a reviewer fixes them in one push) and the exit code is decided in exactly one place.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from m3patch.errors import ChangelogInvalid


class Status(enum.Enum):
    OK = "ok"
    ERROR = "error"


@dataclass(frozen=True)
class Finding:
    """One rule outcome; `line` is a 1-based line of the head file (None: the whole file)."""

    status: Status
    rule: str
    message: str
    line: int | None = None
    hint: str | None = None

    def where(self, path: str) -> str:
        return f"{path}:{self.line}" if self.line is not None else path

    def render(self, path: str, *, with_hint: bool = True) -> str:
        text = f"{self.where(path)}: {self.message}"
        return f"{text} (fix: {self.hint})" if self.hint and with_hint else text

    def to_json(self) -> dict[str, object]:
        return {
            "status": self.status.value, "rule": self.rule, "message": self.message,
            "line": self.line, "hint": self.hint,
        }


def error(rule: str, message: str, line: int | None = None, hint: str | None = None) -> Finding:
    return Finding(Status.ERROR, rule, message, line, hint)


def ok(rule: str, message: str) -> Finding:
    return Finding(Status.OK, rule, message)


def errors_of(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.status is Status.ERROR]


def raise_for_errors(findings: Sequence[Finding], path: str, *, annotated: bool = False) -> None:
    """The single reduction: any error finding becomes one ChangelogInvalid (exit 16).

    `annotated`: each finding was already printed as a GitHub annotation (see `github_annotation`).
    """
    bad = errors_of(findings)
    if not bad:
        return
    noun = "problem" if len(bad) == 1 else "problems"
    lines = [f"{path}: {len(bad)} changelog {noun}"]
    lines += [f.render(path, with_hint=False) for f in bad]
    hints = list(dict.fromkeys(f.hint for f in bad if f.hint))
    raise ChangelogInvalid("\n".join(lines), hint="; ".join(hints) or None, annotated=annotated)


def github_annotation(finding: Finding, path: str) -> str:
    """A GitHub Actions workflow command that pins the message to the file and line."""
    props = f"file={_escape_property(path)}"
    if finding.line is not None:
        props += f",line={finding.line}"
    message = finding.message + (f" (fix: {finding.hint})" if finding.hint else "")
    return f"::error {props}::{_escape_data(message)}"


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")
