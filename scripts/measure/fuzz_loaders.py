"""Command line for the loader fuzzer; the harness lives in tests/shared/fuzz_harness.py, where the tests import it.

    python scripts/measure/fuzz_loaders.py --help
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "shared"))

from fuzz_harness import cli

if __name__ == "__main__":
    raise SystemExit(cli())
