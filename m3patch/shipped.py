"""Where the series and recipes that ship with m3patch live, installed or in a checkout.

In the repository they are the top-level `patches/` and `recipes/` folders (the source of truth).
A built wheel carries copies as package data under `m3patch/_shipped/` (copied at build time), so
an installed m3patch finds them from any working directory without the checkout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Kind = Literal["patches", "recipes"]

PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED = PACKAGE_DIR / "_shipped"
CHECKOUT = PACKAGE_DIR.parent  # meaningful only when it holds pyproject.toml (a source checkout)


def shipped_dir(kind: Kind) -> Path | None:
    """The checkout's folder when running from one, else the wheel's bundled copy, else None."""
    if (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / kind).is_dir():
        return CHECKOUT / kind
    if (BUNDLED / kind).is_dir():
        return BUNDLED / kind
    return None
