"""The task's dataset, read from the JSON beside this file (never a download).

lm-eval resolves a `data_files` path against the working directory, not the task folder; a
custom_dataset function finds the file from its own location wherever the harness runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

DATA = Path(__file__).resolve().parent / "tiny_arith.json"


def load(**_metadata: Any) -> datasets.DatasetDict:
    rows = json.loads(DATA.read_text(encoding="utf-8"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
