"""Resumable cache of finished (shape, batch, config, stage) results: one JSON object a line.

Append-only and flushed per record, so a run killed at its deadline loses at most the config in
flight; a later run with the same cache skips everything already measured. A torn last line
(killed mid-write) is ignored on load.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.errors import M3PatchError
from m3patch.fsio import read_state, trusted_dir
from m3patch.output import warn
from m3patch.schema import finite_number, short_repr


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


STAGES = ("quick", "refine", "failed")


def _number(raw: object) -> float | None:
    """A cached time or error: null, or a finite number >= 0 (a NaN, a negative or an infinite
    time could win the pick); anything else is a ValueError and the line is dropped."""
    if raw is None:
        return None
    number = finite_number(raw)
    if number is None or number < 0:
        msg = f"not a finite number >= 0: {short_repr(raw)}"
        raise ValueError(msg)
    return number


def _parse(line: str) -> Result | None:
    """One cached result, or None for a line that is not one this tuner wrote (torn, edited,
    nested too deep, a wrong type): it is measured again, never trusted."""
    try:
        raw: Any = json.loads(line)
        batch, stage = raw["batch"], raw["stage"]
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or \
                stage not in STAGES or not all(isinstance(raw[k], str) for k in ("shape", "config")):
            return None
        us = _number(raw.get("us"))
        if stage != "failed" and (us is None or us == 0):
            return None
        return Result(raw["shape"], batch, raw["config"], stage, us, _number(raw.get("error")),
                      str(raw.get("note", "")))
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


class ResultCache:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.results: dict[tuple[str, int, str, str], Result] = {}
        if path is not None and path.is_file():
            try:
                text = read_state(path).decode("utf-8", "replace")
            except OSError:  # a link, FIFO or device in the cache's place: start afresh
                text = ""
            for line in text.splitlines():
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
        record = {"shape": result.shape, "batch": result.batch, "config": result.config,
                  "stage": result.stage, "us": result.us, "error": result.error,
                  "note": result.note}
        try:
            # a real folder of this user's (or one its own link leads to), never one another
            # user could swap for a link between two appends
            folder = trusted_dir(self.path.parent, create=True)
            _append(folder / self.path.name, (json.dumps(record) + "\n").encode("utf-8"))
        except (OSError, M3PatchError) as exc:  # a cache not written only costs a re-measure
            why = exc.message if isinstance(exc, M3PatchError) else exc.strerror or exc
            warn(f"{self.path}: tune cache not written ({why}); results are kept in memory only")
            self.path = None


def _append(path: Path, data: bytes) -> None:
    """Append to a regular file, never through a link (O_NOFOLLOW) and never blocking on a
    FIFO planted in the cache's place (O_NONBLOCK: ENXIO without a reader)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.write(fd, data)
    finally:
        os.close(fd)

