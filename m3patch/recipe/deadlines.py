"""The recipe's deadlines: how long the server may take to be ready, one request, the whole run.

`ready-s` bounds the wait for /health, `request-s` a silent request (and, per wave of requests,
a bench cell), `run-s` the whole serve / bench / ci run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from m3patch.schema import at_key, check_keys, expect_number


@dataclass(frozen=True)
class Deadlines:
    ready_s: float
    request_s: float
    run_s: float


def deadlines(data: dict[str, Any]) -> Deadlines:
    check_keys(data, optional=("ready-s", "request-s", "run-s"))
    values = []
    for key, default in (("ready-s", 900.0), ("request-s", 120.0), ("run-s", 4 * 3600.0)):
        with at_key(key):
            values.append(expect_number(data.get(key, default), minimum=1.0))
    return Deadlines(*values)
