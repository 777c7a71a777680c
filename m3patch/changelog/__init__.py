"""perf-changelog.yaml validation: schema, layout, append-only rules and cross-references.

Modules: text (bytes/lines), entries (schema), rules (append-only vs a base), refs (recipes,
series, patch ids), check (pure orchestration), sources (git and the work tree), findings.
"""

from __future__ import annotations

from m3patch.changelog.check import CheckInput, CheckReport, check
from m3patch.changelog.findings import Finding, Status, raise_for_errors

__all__ = ["CheckInput", "CheckReport", "Finding", "Status", "check", "raise_for_errors"]
