"""How a recipe names files and models: `~`, `${VAR}` / `${VAR:-default}`, local path or hub id.

Used by every section that holds a path (target.python, model.*, series, results).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from m3patch.schema import SchemaError

LOCAL_PREFIXES = ("/", "~", "./", "../", "$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand(text: str) -> str:
    """`~` and `${VAR}` / `${VAR:-default}`; an unset variable without default is an error."""
    return str(Path(expand_vars(text)).expanduser())


def expand_vars(text: str) -> str:
    """`${VAR}` / `${VAR:-default}` only (not a path: nothing normalised)."""
    def one(match: re.Match[str]) -> str:
        value = os.environ.get(match.group(1)) or match.group(2)
        if value is None:
            msg = f"environment variable {match.group(1)} is not set (no default given)"
            raise SchemaError(msg)
        return value
    return _VAR.sub(one, text)


def model_source(text: str) -> tuple[str, bool]:
    """A path (starts with / ~ ./ ../ or ${VAR}) is expanded; anything else is a hub id."""
    if text.startswith(LOCAL_PREFIXES):
        return str(Path(expand(text)).absolute()), True
    return text, False
