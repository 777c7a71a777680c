"""The accuracy gate's exit codes are unique and documented where scripts look them up."""

from __future__ import annotations

import re
from pathlib import Path

from m3patch import errors

REPO = Path(__file__).resolve().parents[2]


def test_eval_codes_are_unique_and_in_both_tables() -> None:
    codes = [cls.exit_code for cls in errors.ALL_ERRORS]
    assert len(codes) == len(set(codes))
    doc = (REPO / "docs" / "exit-codes.md").read_text()
    for cls, code in ((errors.EvalFailed, 20), (errors.EvalError, 21)):
        assert cls.exit_code == code
        assert re.search(rf"^\| {code} +\| {cls.__name__} ", doc, re.M), cls.__name__
        assert re.search(rf"^\| {code} +\| {cls.__name__} ", errors.__doc__ or "", re.M)
