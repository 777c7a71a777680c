"""lm-evaluation-harness as a client subprocess against the served OpenAI-compatible endpoint.

`harness_argv` is pure: one `python -m lm_eval run` per task, the completions model type
(`local-completions`, or `local-chat-completions` with the chat template), requests sent as
text (no tokenizer in lm-eval's venv: the server tokenizes), the recipe's few-shot, limit,
concurrency and generation kwargs. `run_harness` is the effect: its own process group, a
deadline, the server watched between polls; whatever ends the wait, the group is stopped with
the one stop ladder (serving.processes.stop_group). The harness never downloads: it runs with
the hub offline and the datasets must already be cached (eval.datasets).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from m3patch.errors import EvalError, ServerDied
from m3patch.fsio import path_is
from m3patch.recipe.evals import EvalTask
from m3patch.serving.launch_plan import LOOPBACK_ENV
from m3patch.serving.processes import StopRung, start_group, stop_group

POLL_SECONDS = 0.5
STOP_LADDER = (StopRung(signal.SIGINT, 5.0), StopRung(signal.SIGTERM, 5.0),
               StopRung(signal.SIGKILL, float("inf")))
OFFLINE_ENV = (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
               ("TRANSFORMERS_OFFLINE", "1"))
LOG_TAIL_LINES = 15
# The pin scripts/setup/setup_lm_eval.sh installs (tests keep the two in step); the hint spells
# its steps out, since an installed m3patch ships no scripts/.
LM_EVAL_PIN = "lm-eval[api]==0.4.13"
DEFAULT_VENV = "~/.cache/m3patch/lm-eval-venv"


def setup_hint(python: str | None = None) -> str:
    """How to make the lm-eval venv whose interpreter is `python` (default: the recipes')."""
    venv = str(Path(python).parent.parent) if python and Path(python).parent.name == "bin" \
        else DEFAULT_VENV
    shown = venv if venv == DEFAULT_VENV else shlex.quote(venv)
    return (f"python3 -m venv {shown} && {shown}/bin/pip install '{LM_EVAL_PIN}'  "
            "(or set eval.python / $M3PATCH_LM_EVAL_PYTHON)")



@dataclass(frozen=True)
class Endpoint:
    base_url: str        # http://host:port, no trailing slash
    model: str           # the served model name
    request_s: float     # one request's timeout


@dataclass(frozen=True)
class HarnessRun:
    task: str
    argv: tuple[str, ...]
    returncode: int
    seconds: float
    log: Path
    out_dir: Path


def model_args(task: EvalTask, endpoint: Endpoint) -> str:
    route = "chat/completions" if task.chat_template else "completions"
    return ",".join((f"model={endpoint.model}", f"base_url={endpoint.base_url}/v1/{route}",
                     f"num_concurrent={task.concurrency}", "max_retries=1",
                     "tokenized_requests=False", "tokenizer_backend=None",
                     f"timeout={int(endpoint.request_s)}"))


def harness_argv(python: str, task: EvalTask, endpoint: Endpoint, out_dir: Path) -> tuple[str, ...]:
    model = "local-chat-completions" if task.chat_template else "local-completions"
    argv = [python, "-m", "lm_eval", "run", "--model", model,
            "--model_args", model_args(task, endpoint), "--tasks", task.task,
            "--output_path", str(out_dir), "--log_samples"]
    if task.task_dir is not None:
        argv += ["--include_path", str(task.task_dir)]
    if task.num_fewshot is not None:
        argv += ["--num_fewshot", str(task.num_fewshot)]
    if task.limit is not None:
        argv += ["--limit", str(task.limit)]
    if task.gen_kwargs:
        argv += ["--gen_kwargs", ",".join(f"{k}={v}" for k, v in task.gen_kwargs)]
    if task.chat_template:
        argv += ["--apply_chat_template"]
    return tuple(argv)


def require_interpreter(python: str) -> None:
    """lm-eval lives in its own venv; say how to make it when it is not there."""
    if not path_is(Path(python), "file"):
        msg = f"no lm-eval interpreter at {python}"
        raise EvalError(msg, hint=setup_hint(python))


def run_harness(argv: tuple[str, ...], task: str, out_dir: Path, *, deadline_s: float,
                check_server: Callable[[], None]) -> HarnessRun:
    """Run one task's harness to completion; a dead server or the deadline stop it (EvalError)."""
    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier attempt's results must not be read
    out_dir.mkdir(parents=True)
    log_path = out_dir / "harness.log"
    env = {**os.environ, **dict(LOOPBACK_ENV), **dict(OFFLINE_ENV)}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        # cwd: lm-eval asks git for a commit hash from where it runs; the run folder has none.
        proc = start_group(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out_dir)
        try:
            code = _wait(proc, task, started + deadline_s, deadline_s, check_server)
        finally:
            stop_group(proc, STOP_LADDER)
    return HarnessRun(task, argv, code, time.monotonic() - started, log_path, out_dir)


def _wait(proc: subprocess.Popen[bytes], task: str, deadline: float, deadline_s: float,
          check_server: Callable[[], None]) -> int:
    while True:
        try:
            return proc.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        try:
            check_server()
        except ServerDied as exc:
            msg = f"eval {task}: the server died while the harness was asking it: {exc.message}"
            raise EvalError(msg, hint=exc.hint) from None
        if time.monotonic() > deadline:
            msg = f"eval {task}: lm-eval still running after eval.timeout-s = {deadline_s:g} s"
            raise EvalError(msg, hint="raise the recipe's eval.timeout-s, or lower the task's limit")


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of the harness log (progress bars dropped), for a failure message."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip() and "it/s]" not in line]
    return "\n".join(kept[-lines:])


def results_file(run: HarnessRun) -> Path:
    """The one `results_*.json` the harness wrote under its output folder."""
    found = sorted(run.out_dir.rglob("results_*.json"))
    if run.returncode != 0 or not found:
        why = f"exited {run.returncode}" if run.returncode != 0 else "wrote no results file"
        msg = (f"eval {run.task}: lm-eval {why} after {run.seconds:.0f} s "
               f"(log: {run.log})\n{log_tail(run.log)}")
        raise EvalError(msg, hint="read the log: a task that did not load, a request error")
    return found[-1]
