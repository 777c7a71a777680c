"""Command line for the crash and concurrency soak; the harness lives in tests/patching/soak_harness.py, where the tests import it.

    python scripts/measure/crash_soak.py --help
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "patching"))

from soak_harness import cli

if __name__ == "__main__":
    raise SystemExit(cli())
