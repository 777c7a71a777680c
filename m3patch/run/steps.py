"""Step results with a status, and the one reduction of a run's results to its exit code.

`run_steps` runs named steps in order, as nox runs sessions: each step ends as one StepResult;
after the first failure or interruption the rest are skipped, and `exit_code_of` reduces the
results once: the first failed or interrupted step's code (errors.py), else 0. The exception
that ended the failing step is kept so the command re-raises it, and errors_handler prints its
message and hint exactly once; its exit code is the reduction's by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from m3patch.errors import INTERNAL_ERROR_EXIT, Interrupted, M3PatchError


class StepStatus(str, Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class StepDone:
    """What a step returns when it did not raise: OK, or SKIPPED with the reason as message."""

    message: str
    artifacts: tuple[str, ...] = ()
    status: StepStatus = StepStatus.OK


@dataclass(frozen=True)
class StepResult:
    name: str
    status: StepStatus
    exit_code: int
    seconds: float
    message: str
    artifacts: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "exit_code": self.exit_code,
                "seconds": self.seconds, "message": self.message, "artifacts": list(self.artifacts)}


Step = tuple[str, Callable[[], StepDone]]


@dataclass(frozen=True)
class RunOutcome:
    results: tuple[StepResult, ...]
    failure: BaseException | None  # what ended the first failed or interrupted step

    @property
    def exit_code(self) -> int:
        return exit_code_of(self.results)


def exit_code_of(results: Sequence[StepResult]) -> int:
    """The reduction: the first failed or interrupted step's code, else 0."""
    ended = (StepStatus.FAILED, StepStatus.INTERRUPTED)
    return next((r.exit_code for r in results if r.status in ended), 0)


def run_steps(steps: Sequence[Step], on_result: Callable[[StepResult], None]) -> RunOutcome:
    """Run each step once, in order; `on_result` sees every step that ran (not the skipped)."""
    results: list[StepResult] = []
    failure: BaseException | None = None
    for name, step in steps:
        if failure is not None:
            results.append(StepResult(name, StepStatus.SKIPPED, 0, 0.0, _skip_reason(failure)))
            continue
        result, failure = _run_one(name, step)
        results.append(result)
        on_result(result)
    return RunOutcome(tuple(results), failure)


def _run_one(name: str, step: Callable[[], StepDone]) -> tuple[StepResult, BaseException | None]:
    started = time.monotonic()
    try:
        done = step()
    except (KeyboardInterrupt, Exception) as exc:  # each ends the step with its own code
        status, code = classify_failure(exc)
        first = (str(exc) or type(exc).__name__).splitlines()[0]
        return StepResult(name, status, code, time.monotonic() - started, first), exc
    return StepResult(name, done.status, 0, time.monotonic() - started, done.message,
                      done.artifacts), None


def classify_failure(exc: BaseException) -> tuple[StepStatus, int]:
    """How an exception ends a step: Ctrl-C / SIGTERM interrupt it, an internal bug is 70."""
    if isinstance(exc, KeyboardInterrupt):  # errors_handler exits 130 for it, as for Interrupted
        return StepStatus.INTERRUPTED, Interrupted.exit_code
    if isinstance(exc, Interrupted):
        return StepStatus.INTERRUPTED, exc.exit_code
    if isinstance(exc, M3PatchError):
        return StepStatus.FAILED, exc.exit_code
    return StepStatus.FAILED, INTERNAL_ERROR_EXIT


def _skip_reason(failure: BaseException) -> str:
    status, _ = classify_failure(failure)
    return "the run was interrupted" if status is StepStatus.INTERRUPTED else "an earlier step failed"


def finish(outcome: RunOutcome) -> int:
    """The command's return: re-raise the failure (one message, its code), else the reduction."""
    if outcome.failure is not None:
        raise outcome.failure
    return outcome.exit_code
