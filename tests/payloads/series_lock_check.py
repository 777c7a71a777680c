"""The one check that a shipped series' committed lock is what `series lock --pristine` writes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def assert_lock_is_current(name: str, tmp_path: Path) -> None:
    """Re-pin patches/NAME on a pristine tree and compare with its committed lock."""
    series = REPO / "patches" / name
    # The old lock stays: every pin is computed afresh from the pristine tree, and the launch
    # spec it pins (vllm-cli.json) is kept only when its bytes still match that pin.
    copy = shutil.copytree(series, tmp_path / "series")
    proc = subprocess.run([sys.executable, "-m", "m3patch", "series", "lock", "--series", str(copy),
                           "--pristine"], capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    fresh = json.loads((copy / "series.lock.json").read_text())
    assert fresh == json.loads((series / "series.lock.json").read_text()), \
        f"stale lock: run `m3patch series lock --series patches/{name} --pristine`"
