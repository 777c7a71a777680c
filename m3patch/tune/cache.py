"""Resumable cache of finished (shape, batch, config, stage) results: one JSON object a line.

Append-only and flushed per record, so a run killed at its deadline loses at most the config in
flight; a later run with the same cache skips everything already measured. A torn last line
(killed mid-write) is ignored on load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Result:
    shape: str
    batch: int
    config: str
    stage: str  # "quick" | "refine" | "failed"
    us: float | None
    error: float | None = None
    note: str = ""

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.shape, self.batch, self.config, self.stage)


def _parse(line: str) -> Result | None:
    try:
        raw: Any = json.loads(line)
        return Result(str(raw["shape"]), int(raw["batch"]), str(raw["config"]), str(raw["stage"]),
                      None if raw.get("us") is None else float(raw["us"]),
                      None if raw.get("error") is None else float(raw["error"]),
                      str(raw.get("note", "")))
    except (ValueError, KeyError, TypeError):
        return None


class ResultCache:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.results: dict[tuple[str, int, str, str], Result] = {}
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                result = _parse(line)
                if result is not None:
                    self.results[result.key] = result

    def get(self, shape: str, batch: int, config: str, stage: str) -> Result | None:
        return self.results.get((shape, batch, config, stage))

    def failed(self, shape: str, batch: int, config: str) -> bool:
        return (shape, batch, config, "failed") in self.results

    def add(self, result: Result) -> None:
        self.results[result.key] = result
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"shape": result.shape, "batch": result.batch, "config": result.config,
                  "stage": result.stage, "us": result.us, "error": result.error,
                  "note": result.note}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

