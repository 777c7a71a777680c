"""A chat cell's prompts file, written by the target interpreter (chat_prompts_probe.py).

A chat cell (`sweep.client: chat`, the speculative-decoding rows) counts its ISL with the model's
chat template, as InferenceX's `--use-chat-template` runs do: vLLM's client reads the prompt
bodies from this file (`--dataset-name custom`), applies the template, counts the templated
prompt, and sends it as a completions prompt. The row records `isl_convention: chat-template`;
`prompts/<cell>.json` beside the bodies keeps the template's token count and each prompt's
length as InferenceX counts it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from m3patch.bench.cells import Cell
from m3patch.errors import BenchFailed
from m3patch.fsio import write_json_atomic
from m3patch.serving.launch_plan import LOOPBACK_ENV

PROBE = Path(__file__).with_name("chat_prompts_probe.py")
RESULT_PREFIX = "M3PATCH_CHAT_PROMPTS: "
TIMEOUT_S = 300.0


def write_prompts(python: Path, tokenizer: str, cell: Cell, seed: int, out: Path,
                  rerun: str) -> dict[str, Any]:
    """Write the cell's prompt bodies to `out`; what the probe reports (template tokens, lengths)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(python), "-c", PROBE.read_text(encoding="utf-8"), tokenizer, str(cell.seq.isl),
            str(cell.seq.osl), repr(cell.range_ratio), cell.length_convention,
            str(cell.num_prompts), str(seed), str(out)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                              env=_env(), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        msg = f"cell {cell.cell_id}: the chat prompts could not be made with {python}: {exc}"
        raise BenchFailed(msg, hint=rerun) from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        msg = (f"cell {cell.cell_id}: the chat prompts could not be made with the tokenizer "
               f"{tokenizer} (status {proc.returncode}):\n{tail}")
        raise BenchFailed(msg, hint=rerun)
    report: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX):])
    # Beside the prompts: the template's tokens and each prompt's length, as InferenceX counts it.
    write_json_atomic(out.with_suffix(".json"), report, error=BenchFailed)
    return report


def _env() -> dict[str, str]:
    return {**os.environ, **dict(LOOPBACK_ENV)}
