"""The `M3PATCH_*` environment variables m3patch itself reads, and their check at a command's start.

The prefix is shared: a series' switches are read by the server (serving/switches.py checks
those against the series), the checkout's scripts and tests read their own, and a site may
export names of its own. So a name m3patch does not know is only a warning, and only when it is
a near miss of one it knows (`M3PATCH_SERIE`): such a typo would otherwise be ignored without a
word. A known variable with a value m3patch cannot use fails the command (UsageError, 2).

Pure, except `check_environment` (a warning on stderr).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from m3patch.errors import UsageError
from m3patch.output import warn
from m3patch.schema import suggest

PREFIX = "M3PATCH_"
# Read by the m3patch package, the shell scripts it writes (the Slurm batch script) and the
# shipped recipes it expands (`${M3PATCH_TINY_MODEL:-...}`). tests/shared/test_shared_tool_env.py
# derives this set from the source, so a new variable cannot be left out.
TOOL_ENV = frozenset({
    "M3PATCH_AIPERF_PYTHON", "M3PATCH_CACHE", "M3PATCH_CMD", "M3PATCH_CPU_VENV",
    "M3PATCH_CRASH_DIR", "M3PATCH_DEBUG_TRACEBACK", "M3PATCH_FAULT", "M3PATCH_HEAD_ADDR",
    "M3PATCH_IFNAME", "M3PATCH_IMAGE", "M3PATCH_LM_EVAL_PYTHON", "M3PATCH_LOCK_TIMEOUT",
    "M3PATCH_ROUTER_VENV", "M3PATCH_SERIES", "M3PATCH_SET_ID", "M3PATCH_SITE_HOOK",
    "M3PATCH_SRUN_ARGS", "M3PATCH_TINY_MODEL", "M3PATCH_VLLM_PARSER_TIMEOUT", "M3PATCH_VLLM_ROOT",
})
# Read only by the checkout's scripts and tests (setup, CI, measurements), never by the wheel.
CHECKOUT_ENV = frozenset({
    "M3PATCH_AIPERF_VENV", "M3PATCH_CI_SLURM", "M3PATCH_DEV_VENV", "M3PATCH_LMCACHE_VENV",
    "M3PATCH_LM_EVAL_VENV", "M3PATCH_PRISTINE_SOURCE", "M3PATCH_PYTHON", "M3PATCH_RUN_DIR",
    "M3PATCH_SKIP_SERVE", "M3PATCH_TEST_MARK", "M3PATCH_TEST_WORKERS", "M3PATCH_TRAIN_LOG",
    "M3PATCH_TUNE_VLLM_SOURCE",
})
KNOWN_ENV = TOOL_ENV | CHECKOUT_ENV

# Values with a closed form; the others (paths, seconds, ids) are checked where they are read.
_VALUE_RULES: dict[str, tuple[re.Pattern[str], str, str]] = {
    "M3PATCH_DEBUG_TRACEBACK": (re.compile(r"[01]?"), "1 (on) or 0 (off)",
                                "export M3PATCH_DEBUG_TRACEBACK=1"),
    "M3PATCH_FAULT": (re.compile(r"((kill|fail)-after:[0-9]+)?"),
                      "kill-after:N or fail-after:N (test-only)", ""),
}


DEFAULT_LOCK_TIMEOUT_S = 300.0
ENV_LOCK_TIMEOUT = "M3PATCH_LOCK_TIMEOUT"


def lock_timeout_s(environ: Mapping[str, str]) -> float:
    """$M3PATCH_LOCK_TIMEOUT in seconds (default 300); anything but a finite number >= 0 is a
    usage error (exit 2), never a crash or an endless wait (NaN never passes a deadline)."""
    raw = environ.get(ENV_LOCK_TIMEOUT)
    if raw is None or raw == "":
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        msg = f"${ENV_LOCK_TIMEOUT}={shown(raw)} is not a number of seconds >= 0"
        raise UsageError(msg, hint=f"unset it (default {DEFAULT_LOCK_TIMEOUT_S:.0f} s) or set "
                         f"e.g. {ENV_LOCK_TIMEOUT}=600")
    return value


SHOWN_CHARS = 120  # of a value in a message: a 100 kB variable is not printed whole


def shown(value: str) -> str:
    """`value` as a message quotes it, cut to SHOWN_CHARS."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value):,} characters)"


def bad_values(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(message, hint) for each known variable whose value m3patch cannot use."""
    out = []
    for name, (form, wanted, example) in sorted(_VALUE_RULES.items()):
        value = environ.get(name)
        if value is not None and not form.fullmatch(value):
            out.append((f"environment variable {name}={shown(value)} is not {wanted}",
                        f"unset {name}" + (f", or {example}" if example else "")))
    return out


def near_misses(environ: Mapping[str, str]) -> list[str]:
    """One warning per unknown `M3PATCH_*` name that is a near miss of a known one."""
    out = []
    for name in sorted(environ):
        if name.startswith(PREFIX) and name not in KNOWN_ENV:
            near = suggest(name, KNOWN_ENV)
            if near:
                named = name if len(name) <= SHOWN_CHARS else shown(name)
                out.append(f"environment variable {named} is not one m3patch reads; it is "
                           f"ignored.{near}")
    return out


def check_environment(environ: Mapping[str, str]) -> None:
    """At a command's start: a known variable with an unusable value is a UsageError (2); a
    near miss of a known name is a one-line warning."""
    lock_timeout_s(environ)  # every command: status refuses a bad value as apply does
    problems = bad_values(environ)
    if problems:
        message, hint = problems[0]
        raise UsageError(message, hint=hint)
    for line in near_misses(environ):
        warn(line)
