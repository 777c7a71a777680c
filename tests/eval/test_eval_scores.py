"""Scores from real lm-eval results files, judged against min and a baseline (pure)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from m3patch.errors import EvalError
from m3patch.eval.harness import Endpoint, harness_argv
from m3patch.eval.scores import baseline_score, judge, task_score
from m3patch.recipe.evals import EvalTask

DATA = Path(__file__).resolve().parents[1] / "data" / "eval"
# Written by lm-eval 0.4.13 against the embedded default's real server (serve --bench).
REAL = DATA / "tiny_arith_results.json"


def real() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(REAL.read_text())
    return data


def arith(**change: Any) -> EvalTask:
    base: dict[str, Any] = dict(
        task="tiny_arith", task_dir=None, dataset=None, dataset_name=None, num_fewshot=None,
        limit=None, metric="exact_match", filter="strict-match", min=0.0, max_drop=None,
        baseline=None, concurrency=4, gen_kwargs=(), chat_template=False)
    base.update(change)
    return EvalTask(**base)


def test_real_results_file_gives_score_stderr_and_counts() -> None:
    score = task_score(real(), arith(), str(REAL))
    assert (score.score, score.stderr, score.samples, score.samples_in_split) == (0.0, 0.0, 32, 32)
    assert score.metric == "exact_match,strict-match"


def test_limit_shows_as_effective_samples() -> None:
    data = real()
    data["n-samples"]["tiny_arith"]["effective"] = 10
    assert task_score(data, arith(), "f").samples == 10


def test_missing_metric_names_what_the_task_has() -> None:
    with pytest.raises(EvalError) as info:
        task_score(real(), arith(filter="flexible-extract"), str(REAL))
    assert "no metric 'exact_match,flexible-extract'" in info.value.message
    assert "exact_match,strict-match" in info.value.message and info.value.exit_code == 21


def test_missing_task_lists_the_tasks_found() -> None:
    with pytest.raises(EvalError, match=r"no results for task 'gsm8k' \(found: tiny_arith\)"):
        task_score(real(), arith(task="gsm8k"), str(REAL))


@pytest.mark.parametrize("breakage", ["score-string", "no-n-samples", "zero-samples", "no-results"])
def test_hostile_results_are_eval_errors(breakage: str) -> None:
    data = copy.deepcopy(real())
    if breakage == "score-string":
        data["results"]["tiny_arith"]["exact_match,strict-match"] = "0.5"
    elif breakage == "no-n-samples":
        del data["n-samples"]
    elif breakage == "zero-samples":
        data["n-samples"]["tiny_arith"]["effective"] = 0
    else:
        data["results"] = []
    with pytest.raises(EvalError):
        task_score(data, arith(), "f")


def test_na_stderr_is_kept_as_unknown() -> None:
    data = real()
    data["results"]["tiny_arith"]["exact_match_stderr,strict-match"] = "N/A"
    assert task_score(data, arith(), "f").stderr is None


def test_min_passes_at_the_floor_and_fails_under_it() -> None:
    score = task_score(real(), arith(), str(REAL))
    assert judge(score, arith(min=0.0), None).passed
    failed = judge(score, arith(min=0.5), None)
    assert not failed.passed
    assert failed.failures == ("tiny_arith exact_match,strict-match = 0.0000, below min 0.5",)


def test_baseline_drop_beyond_max_drop_fails_within_passes(tmp_path: Path) -> None:
    score = task_score(real(), arith(), str(REAL))
    base = real()
    base["results"]["tiny_arith"]["exact_match,strict-match"] = 0.03
    path = tmp_path / "base.json"
    path.write_text(json.dumps(base))
    baseline = baseline_score(base, arith(), path)
    assert baseline == 0.03
    assert judge(score, arith(max_drop=0.05, baseline=path), baseline).passed
    lost = judge(score, arith(max_drop=0.01, baseline=path), baseline)
    assert not lost.passed and "0.0300 under the baseline 0.0300 (max-drop 0.01)" in lost.failures[0]


def test_baseline_may_be_an_earlier_m3patch_eval_record(tmp_path: Path) -> None:
    record = {"tasks": [{"task": "tiny_arith", "metric": "exact_match,strict-match", "score": 0.9}]}
    assert baseline_score(record, arith(), tmp_path / "eval.json") == 0.9
    with pytest.raises(EvalError, match="no tiny_arith exact_match,flexible-extract"):
        baseline_score(record, arith(filter="flexible-extract"), tmp_path / "eval.json")


def test_argv_uses_the_client_model_types_and_recipe_settings(tmp_path: Path) -> None:
    endpoint = Endpoint("http://127.0.0.1:8765", "tiny-moe", 60)
    argv = harness_argv("/lm/bin/python", arith(task_dir=tmp_path, limit=8, num_fewshot=0,
                                                 gen_kwargs=(("max_gen_toks", 8),)),
                        endpoint, tmp_path / "out")
    assert argv[:6] == ("/lm/bin/python", "-m", "lm_eval", "run", "--model", "local-completions")
    args = argv[argv.index("--model_args") + 1]
    assert "base_url=http://127.0.0.1:8765/v1/completions" in args and "num_concurrent=4" in args
    assert "tokenizer_backend=None" in args and "timeout=60" in args
    assert argv[argv.index("--include_path") + 1] == str(tmp_path)
    assert argv[argv.index("--limit") + 1] == "8" and argv[argv.index("--num_fewshot") + 1] == "0"
    assert argv[argv.index("--gen_kwargs") + 1] == "max_gen_toks=8"
    chat = harness_argv("/p", arith(chat_template=True), endpoint, tmp_path)
    assert "local-chat-completions" in chat and "--apply_chat_template" in chat
    assert "base_url=http://127.0.0.1:8765/v1/chat/completions" in chat[chat.index("--model_args") + 1]
