"""The recipe's `eval:` section: which lm-evaluation-harness tasks gate the run, and how.

    eval:
      when: after-sweep            # or before-sweep: when the gated run evaluates
      python: ~/.cache/m3patch/lm-eval-venv/bin/python   # lm-eval's own interpreter
      timeout-s: 1800              # the whole harness run
      tasks:
        - task: gsm8k              # lm-eval's task name (or one defined in task-dir)
          task-dir: ../evals/x     # optional local task folder (lm-eval --include_path)
          dataset: openai/gsm8k    # optional hub dataset the task reads (offline check, fetch)
          num-fewshot: 5
          limit: 250               # optional: the first N samples
          metric: exact_match,strict-match
          min: 0.93                # fail below
          max-drop: 0.01           # optional: fail when it drops more than this below
          baseline: path.json      #   the baseline: a harness results file or an m3patch eval.json
          concurrency: 8
          gen-kwargs: {max_gen_toks: 256}
          chat-template: false     # true: the chat endpoint with the model's chat template

Pure: the section is validated into frozen values; running the harness is m3patch.eval.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from m3patch.recipe.paths import expand
from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_bool,
    expect_choice,
    expect_flag_value,
    expect_int,
    expect_list,
    expect_mapping,
    expect_number,
    expect_str,
)

DEFAULT_PYTHON = "${M3PATCH_LM_EVAL_PYTHON:-~/.cache/m3patch/lm-eval-venv/bin/python}"
_TASK_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")
_METRIC = re.compile(r"^[\w.-]+,[\w.-]+$")  # lm-eval's results key: METRIC,FILTER
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?$")
TASK_KEYS = ("task-dir", "dataset", "dataset-name", "num-fewshot", "limit", "max-drop",
             "baseline", "concurrency", "gen-kwargs", "chat-template")


class EvalWhen(str, Enum):
    BEFORE_SWEEP = "before-sweep"
    AFTER_SWEEP = "after-sweep"


@dataclass(frozen=True)
class EvalTask:
    task: str
    task_dir: Path | None
    dataset: str | None
    dataset_name: str | None
    num_fewshot: int | None
    limit: int | None
    metric: str        # the metric name, e.g. exact_match
    filter: str        # the filter name, e.g. strict-match
    min: float
    max_drop: float | None
    baseline: Path | None
    concurrency: int
    gen_kwargs: tuple[tuple[str, str | int | float | bool], ...]
    chat_template: bool

    @property
    def metric_key(self) -> str:
        """The key lm-eval writes the score under in its results file."""
        return f"{self.metric},{self.filter}"


@dataclass(frozen=True)
class EvalSpec:
    when: EvalWhen
    python: str
    timeout_s: float
    tasks: tuple[EvalTask, ...]


def _metric(value: object) -> tuple[str, str]:
    text = expect_str(value)
    if not _METRIC.match(text):
        msg = f"expected METRIC,FILTER as lm-eval keys its results (exact_match,strict-match), got {text!r}"
        raise SchemaError(msg)
    name, filter_name = text.split(",")
    return name, filter_name


def _gen_kwargs(value: object) -> tuple[tuple[str, str | int | float | bool], ...]:
    data = expect_mapping(value)
    out: list[tuple[str, str | int | float | bool]] = []
    for key, item in data.items():
        with at_key(str(key)):
            item = expect_flag_value(item)
            if isinstance(item, str) and ("," in item or "=" in item):
                # lm-eval reads --gen_kwargs as KEY=VALUE,KEY=VALUE: these would split the value.
                msg = f"a value with ',' or '=' cannot pass through lm-eval's --gen_kwargs: {item!r}"
                raise SchemaError(msg)
            out.append((str(key), item))
    return tuple(out)


def _optional_path(data: dict[str, Any], key: str, base: Path) -> Path | None:
    if key not in data:
        return None
    with at_key(key):
        return (base / expand(expect_str(data[key]))).resolve()


def _hub_id(data: dict[str, Any], key: str) -> str | None:
    if key not in data:
        return None
    with at_key(key):
        text = expect_str(data[key])
        if not _HUB_ID.match(text):
            msg = f"expected a hub dataset id ORG/NAME, got {text!r}"
            raise SchemaError(msg)
        return text


def _optional_str(data: dict[str, Any], key: str) -> str | None:
    if key not in data:
        return None
    with at_key(key):
        return expect_str(data[key])


def _optional_int(data: dict[str, Any], key: str, minimum: int) -> int | None:
    if key not in data:
        return None
    with at_key(key):
        return expect_int(data[key], minimum=minimum)


def eval_task(raw: object, base: Path) -> EvalTask:
    data = expect_mapping(raw)
    check_keys(data, required=("task", "metric", "min"), optional=TASK_KEYS)
    with at_key("task"):
        task = expect_str(data["task"])
        if not _TASK_NAME.match(task):
            msg = f"expected an lm-eval task name (letters, digits, _ . -), got {task!r}"
            raise SchemaError(msg)
    with at_key("metric"):
        metric, filter_name = _metric(data["metric"])
    with at_key("min"):
        floor = expect_number(data["min"])
    max_drop = None
    if "max-drop" in data:
        with at_key("max-drop"):
            max_drop = expect_number(data["max-drop"], minimum=0.0)
    baseline = _optional_path(data, "baseline", base)
    if (max_drop is None) != (baseline is None):
        msg = "max-drop and baseline go together: the drop is measured against the baseline file"
        raise SchemaError(msg)
    with at_key("concurrency"):
        concurrency = expect_int(data.get("concurrency", 1), minimum=1)
    with at_key("gen-kwargs"):
        gen = _gen_kwargs(data.get("gen-kwargs", {}))
    with at_key("chat-template"):
        chat = expect_bool(data.get("chat-template", False))
    task_dir = _optional_path(data, "task-dir", base)
    return EvalTask(task, task_dir, _hub_id(data, "dataset"), _optional_str(data, "dataset-name"),
                    _optional_int(data, "num-fewshot", 0), _optional_int(data, "limit", 1),
                    metric, filter_name, floor, max_drop, baseline, concurrency, gen, chat)


def evals(data: dict[str, Any], *, base: Path) -> EvalSpec | None:
    """The section, or None when the recipe has none (the run has no accuracy gate)."""
    if not data:
        return None
    check_keys(data, required=("tasks",), optional=("when", "python", "timeout-s"))
    with at_key("when"):
        when = EvalWhen(expect_choice(data.get("when", EvalWhen.AFTER_SWEEP.value),
                                      [w.value for w in EvalWhen]))
    with at_key("python"):
        python = expand(expect_str(data.get("python", DEFAULT_PYTHON)))
    with at_key("timeout-s"):
        timeout = expect_number(data.get("timeout-s", 3600.0), minimum=1.0)
    tasks: list[EvalTask] = []
    with at_key("tasks"):
        for index, raw in enumerate(expect_list(data["tasks"], non_empty=True)):
            with at_key(index):
                tasks.append(eval_task(raw, base))
        names = [t.task for t in tasks]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate:
            msg = f"task {duplicate!r} is listed twice; lm-eval keys results by task name"
            raise SchemaError(msg)
    return EvalSpec(when, python, timeout, tuple(tasks))
