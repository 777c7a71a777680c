"""Recipe texts for the hostile-input tests: a shipped recipe with its series made absolute,
written where a test wants it."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def recipe_text(name: str = "cpu_tiny_moe") -> str:
    data = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    return yaml.safe_dump(data, sort_keys=False)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path
