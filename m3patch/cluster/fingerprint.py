"""What makes two nodes of a set differ beyond their patched files: published in every vLLM
node's record and compared with the head's (a mismatch names the node and the field).

- vllm_version, vllm_commit: the tree's own `_version.py` (the ledger records only the base);
- torch, gpu_runtime: torch's `version.py` beside vLLM in the same site-packages, read as text
  (never imported): `__version__`, and `hip` (ROCm; RCCL ships with it) or `cuda`, else cpu;
- model: the snapshot revision the model folder is (a hub cache's `snapshots/<revision>`, else
  `local`) and the sha256 of its config.json;
- argv_sha256: the recipe's rendered launch without what is per node by design (the model's
  path on this host, --host, --port) plus the recipe env: one recipe edited on one host differs.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path

from m3patch.recipe.loader import Recipe
from m3patch.recipe.model_files import Presence

FIELDS = ("vllm_version", "vllm_commit", "torch", "gpu_runtime", "model", "argv_sha256")
_ASSIGN = re.compile(r"^(\w+)\s*(?::[^=]*)?=\s*(.+)$")


def torch_versions(site: Path) -> tuple[str, str]:
    """(torch version, GPU runtime) from site/torch/version.py; ("absent", "absent") without it."""
    try:
        text = (site / "torch" / "version.py").read_text(errors="replace")
    except OSError:
        return "absent", "absent"
    values: dict[str, object] = {}
    for line in text.splitlines():
        match = _ASSIGN.match(line.strip())
        if match:
            try:
                values[match.group(1)] = ast.literal_eval(match.group(2).strip())
            except (ValueError, SyntaxError):
                continue
    runtime = "cpu"
    if values.get("hip"):
        runtime = f"rocm {values['hip']}"
    elif values.get("cuda"):
        runtime = f"cuda {values['cuda']}"
    return str(values.get("__version__", "unknown")), runtime


def model_identity(found: tuple[Presence, ...]) -> str:
    folder = next((p.folder for p in found if p.need.role == "model" and p.folder), None)
    if folder is None:
        return "absent"
    revision = folder.name if folder.parent.name == "snapshots" else "local"
    try:
        config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    except OSError:
        config = "unreadable"
    return f"{revision} config.json sha256:{config}"


def argv_sha256(recipe: Recipe) -> str:
    args = list(recipe.serve_args())[1:]  # the model's path on this host is not the model
    for flag in ("--host", "--port"):
        if flag in args:
            index = args.index(flag)
            del args[index:index + 2]
    data = {"argv": args, "env": sorted(recipe.env)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def node_fingerprint(recipe: Recipe, site: Path, vllm_version: str, vllm_commit: str | None,
                     found: tuple[Presence, ...]) -> dict[str, str]:
    torch, runtime = torch_versions(site)
    return {"vllm_version": vllm_version, "vllm_commit": vllm_commit or "unknown",
            "torch": torch, "gpu_runtime": runtime, "model": model_identity(found),
            "argv_sha256": argv_sha256(recipe)}
