"""Chat (speculative-decoding) cells count the ISL with the chat template, as InferenceX's
`--use-chat-template` client does; the convention is in the row and compare keeps them apart.

The real-server test uses the embedded default's tokenizer and its chat template
(scripts/make_tiny_model.py); the server test reads the input count vLLM's client records, which
is the server's own `usage.prompt_tokens` for every request.
"""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m3patch.bench.cells import Cell, Parallelism, SeqLen
from m3patch.bench.client import BenchTarget, bench_argv
from m3patch.bench.compare import compare_rows
from m3patch.main import main

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "tests" / "data" / "bench" / "runs"


def _chat_cell(isl: int = 64, osl: int = 16, conc: int = 2, ratio: float = 1.0) -> Cell:
    return Cell(SeqLen(isl, osl), Parallelism(), conc, ratio, length_convention="inferencex",
                chat=True)


def test_a_chat_cell_sends_templated_completions_from_its_prompts_file(tmp_path: Path) -> None:
    target = BenchTarget(Path("/venv/bin/python"), "http://127.0.0.1:8765", "tiny-moe", "/m/tiny")
    prompts = tmp_path / "prompts.jsonl"
    argv = bench_argv(target, _chat_cell(), tmp_path, "c2.json", seed=3, prompts=prompts)
    opts = dict(itertools.pairwise(argv[5:]))
    assert opts["--backend"] == "vllm" and opts["--dataset-name"] == "custom"
    assert opts["--dataset-path"] == str(prompts) and opts["--custom-output-len"] == "-1"
    assert "--skip-chat-template" not in argv and "--random-input-len" not in argv
    assert "--ignore-eos" in argv


def test_compare_never_puts_a_chat_template_isl_beside_a_prompt_isl() -> None:
    rows = json.loads((RUNS / "base" / "aggregate.json").read_text())["rows"]
    chat = [{**row, "isl_convention": "chat-template"} for row in rows]
    result = compare_rows(rows, chat)
    assert result.compared == ()
    assert all("ISL with chat template" in u.detail for u in result.unmatched)
    assert len(compare_rows(chat, chat).compared) == len(rows)


@pytest.mark.serve
def test_the_server_sees_the_stated_isl_on_a_chat_row(
    cpu_venv: Path, tiny_model: Path, tmp_path: Path
) -> None:
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["target"]["python"] = str(cpu_venv / "bin" / "python")
    data["model"]["source"] = str(tiny_model)
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["server"]["port"] = _free_port()
    data.pop("eval", None)
    data["sweep"] = {"inferencex-range-ratio": 0.8, "client": "chat",
                     "prompts-per-concurrency": 5, "warmups-per-concurrency": 1,
                     "rows": [{"isl": 64, "osl": 16, "concurrency": [2]}]}
    recipe = tmp_path / "chat.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "m3patch", "bench", str(recipe), "--run-dir",
                           str(run), "--no-plots"], capture_output=True, text=True, cwd=REPO,
                          timeout=560, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads((run / "aggregate.json").read_text())["rows"]
    assert row["isl_convention"] == "chat-template" and row["isl"] == 64
    # The prompts: bodies in InferenceX's range [int(0.8 L'), L'], L' = ISL - template; each
    # prompt as sent, counted as InferenceX's client counts it, is body + template.
    report = json.loads((run / "prompts" / f"{row['cell_id']}.json").read_text())
    template, bodies, sent = (report["template_tokens"], report["input_lens"],
                              report["templated_lens"])
    assert template > 0 and len(bodies) == len(sent) == 10
    assert all(int(0.8 * (64 - template)) <= n <= 64 - template for n in bodies)
    assert len(set(bodies)) > 1
    assert all(abs(s - (n + template)) <= 1 for s, n in zip(sent, bodies, strict=True))
    assert max(sent) <= 64 + 1
    # What the server saw: vLLM's client sums the server's usage.prompt_tokens per request.
    raw = json.loads((run / "raw" / f"{row['cell_id']}.json").read_text())
    assert raw["completed"] == 10 and raw["total_output_tokens"] == sum(report["output_lens"])
    assert abs(raw["total_input_tokens"] / 10 - sum(sent) / 10) <= 1, (raw["total_input_tokens"],
                                                                        sent)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_malformed_isl_convention_exits_17_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads((RUNS / "base" / "aggregate.json").read_text())
    data["rows"][0]["isl_convention"] = ["chat-template"]
    bad = tmp_path / "aggregate.json"
    bad.write_text(json.dumps(data))
    assert main(["bench", "compare", str(RUNS / "base"), str(bad)]) == 17
    assert "rows[0].isl_convention" in capsys.readouterr().err
