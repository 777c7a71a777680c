"""The run pipeline's step results and their one reduction to an exit code (nox's shape)."""

from __future__ import annotations

import pytest

from m3patch.errors import INTERNAL_ERROR_EXIT, Interrupted, MarkerForbidden, ServerDied
from m3patch.run.steps import StepDone, StepResult, StepStatus, exit_code_of, finish, run_steps

OK, FAILED, SKIPPED, INTERRUPTED = (StepStatus.OK, StepStatus.FAILED, StepStatus.SKIPPED,
                                    StepStatus.INTERRUPTED)


def _results(*pairs: tuple[StepStatus, int]) -> list[StepResult]:
    return [StepResult(f"s{i}", status, code, 0.0, "") for i, (status, code) in enumerate(pairs)]


@pytest.mark.parametrize(("steps", "code"), [
    ((), 0),
    (((OK, 0), (OK, 0), (OK, 0)), 0),
    (((OK, 0), (SKIPPED, 0), (OK, 0)), 0),  # a step with nothing to do is not a failure
    (((OK, 0), (FAILED, 13), (SKIPPED, 0)), 13),
    (((OK, 0), (FAILED, 13), (FAILED, 17)), 13),  # the first failure, not the last or the max
    (((FAILED, 2), (FAILED, 18)), 2),
    (((OK, 0), (INTERRUPTED, 130), (SKIPPED, 0)), 130),
    (((INTERRUPTED, 130), (FAILED, 14)), 130),
    (((FAILED, 14), (INTERRUPTED, 130)), 14),
    (((OK, 0), (FAILED, INTERNAL_ERROR_EXIT)), INTERNAL_ERROR_EXIT),
])
def test_exit_code_is_the_first_failed_or_interrupted_steps(
    steps: tuple[tuple[StepStatus, int], ...], code: int
) -> None:
    assert exit_code_of(_results(*steps)) == code


def _raise(exc: BaseException) -> StepDone:
    raise exc


@pytest.mark.parametrize(("exc", "status", "code"), [
    (MarkerForbidden("forbidden marker seen\nmore"), FAILED, 13),
    (Interrupted("received signal SIGTERM"), INTERRUPTED, 130),
    (KeyboardInterrupt(), INTERRUPTED, 130),
    (ValueError("a bug"), FAILED, INTERNAL_ERROR_EXIT),
])
def test_the_failing_step_ends_the_run_and_its_exception_is_reraised(
    exc: BaseException, status: StepStatus, code: int
) -> None:
    seen: list[str] = []
    outcome = run_steps([("a", lambda: StepDone("fine", ("x.json",))),
                         ("b", lambda: _raise(exc)),
                         ("c", lambda: StepDone("never runs"))], lambda r: seen.append(r.name))
    assert [(r.name, r.status) for r in outcome.results] == [("a", OK), ("b", status), ("c", SKIPPED)]
    assert seen == ["a", "b"]  # the skipped step is recorded, not reported as run
    assert outcome.results[0].artifacts == ("x.json",)
    assert outcome.exit_code == code and outcome.failure is exc
    with pytest.raises(type(exc)):
        finish(outcome)


def test_a_skipped_step_keeps_its_reason_and_the_run_passes() -> None:
    outcome = run_steps([("serve", lambda: StepDone("nothing to measure", status=SKIPPED)),
                         ("results", lambda: StepDone("ok"))], lambda _r: None)
    assert outcome.results[0].to_json()["status"] == "skipped"
    assert outcome.results[0].message == "nothing to measure"
    assert finish(outcome) == 0


def test_the_message_is_the_errors_first_line_without_the_hint() -> None:
    outcome = run_steps([("serve", lambda: _raise(ServerDied("died\nlast lines", hint="rerun")))],
                        lambda _r: None)
    assert outcome.results[0].message == "died"
    assert outcome.results[0].to_json() == {"name": "serve", "status": "failed", "exit_code": 18,
                                             "seconds": outcome.results[0].seconds,
                                             "message": "died", "artifacts": []}
