"""The real lm-eval harness as m3patch runs it: a task that does not load, a server that dies
while the harness asks it, datasets that are not cached for the offline run.

The harness is the one scripts/setup/setup_lm_eval.sh installs (skipped only with M3PATCH_SKIP_SERVE=1,
like the other tests that need a venv CI builds). The dying server is a stdlib HTTP server: the
fault under test is "the endpoint goes away mid-request", which the harness and m3patch's
health probe see the same way from any server; the passing and failing gates against a real
`vllm serve` are in tests/serving/test_serving_eval.py.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from m3patch.bench.runner import health_probe
from m3patch.errors import EvalError, UnsafeState
from m3patch.eval import datasets
from m3patch.eval.harness import Endpoint
from m3patch.eval.runner import evaluate, preflight
from m3patch.recipe.evals import EvalSpec, EvalTask, EvalWhen
from m3patch.serving.processes import live_processes

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "recipes" / "evals" / "tiny_arith"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def lm_eval_python() -> str:
    if os.environ.get("M3PATCH_SKIP_SERVE") == "1":
        pytest.skip("M3PATCH_SKIP_SERVE=1")
    default = Path.home() / ".cache" / "m3patch" / "lm-eval-venv" / "bin" / "python"
    python = os.environ.get("M3PATCH_LM_EVAL_PYTHON", str(default))
    if not Path(python).is_file():
        pytest.fail(f"no lm-eval at {python}: run scripts/setup/setup_lm_eval.sh")
    return python


def task(name: str = "tiny_arith", **change: object) -> EvalTask:
    values: dict[str, object] = dict(
        task=name, task_dir=TASK_DIR, dataset=None, dataset_name=None, num_fewshot=None,
        limit=None, metric="exact_match", filter="strict-match", min=0.0, max_drop=None,
        baseline=None, concurrency=1, gen_kwargs=(), chat_template=False)
    values.update(change)
    return EvalTask(**values)  # type: ignore[arg-type]


def spec(python: str, *tasks: EvalTask) -> EvalSpec:
    return EvalSpec(EvalWhen.AFTER_SWEEP, python, 600.0, tasks)


def harness_processes(marker: Path) -> list[int]:
    """Live processes whose command line names this test's output folder."""
    found = []
    for proc in live_processes():
        try:
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(marker).encode() in cmdline:
            found.append(proc.pid)
    return found


class _Hanging(BaseHTTPRequestHandler):
    """/health answers; a completion request never does (the server dies before it would)."""

    seen = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def do_POST(self) -> None:
        _Hanging.seen.set()
        time.sleep(30)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def dying_server() -> Iterator[tuple[str, threading.Event, ThreadingHTTPServer]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hanging)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hanging.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Hanging.seen, server
    server.shutdown()
    server.server_close()


def test_a_task_that_does_not_load_is_exit_21_with_the_harness_words(
        lm_eval_python: str, tmp_path: Path) -> None:
    endpoint = Endpoint("http://127.0.0.1:9", "tiny-moe", 30)
    with pytest.raises(EvalError) as info:
        evaluate(spec(lm_eval_python, task("no_such_task")), tmp_path, endpoint,
                 check_server=lambda: None, provenance={})
    assert info.value.exit_code == 21 and "lm-eval exited 1" in info.value.message
    assert "Tasks not found: no_such_task" in info.value.message  # the log's tail, shown
    assert (tmp_path / "eval" / "no_such_task" / "harness.log").is_file()
    assert not (tmp_path / "eval" / "eval.json").exists()  # no scores: nothing to record


def test_a_planted_link_at_the_eval_folder_is_refused_and_nothing_deleted_through_it(
        tmp_path: Path) -> None:
    """Before: RUN/eval as a link to another folder had that folder's eval.json deleted (the
    stale record's unlink went through the link). Now the link is refused (34) before anything
    is deleted or run; no harness is needed to reach the check."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "eval.json").write_text("{}")
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval").symlink_to(victim)
    with pytest.raises(UnsafeState) as info:
        evaluate(spec("/nonexistent/python", task()), run, Endpoint("http://127.0.0.1:9", "m", 30),
                 check_server=lambda: None, provenance={})
    assert info.value.exit_code == 34 and str(run / "eval") in info.value.message
    assert (victim / "eval.json").read_text() == "{}"


def test_a_server_dying_mid_eval_stops_the_harness_with_21(
        lm_eval_python: str, tmp_path: Path,
        dying_server: tuple[str, threading.Event, ThreadingHTTPServer]) -> None:
    url, seen, server = dying_server
    probe = health_probe(url, "m3patch eval RECIPE")

    def kill_after_first_request() -> None:
        if seen.is_set():
            server.shutdown()
            server.server_close()
        probe()

    with pytest.raises(EvalError) as info:
        evaluate(spec(lm_eval_python, task()), tmp_path, Endpoint(url, "tiny-moe", 120),
                 check_server=kill_after_first_request, provenance={})
    assert info.value.exit_code == 21
    assert "the server died while the harness was asking it" in info.value.message
    assert seen.is_set()  # it died mid-eval: the harness had sent a request
    assert harness_processes(tmp_path) == [], "the harness outlived the eval"


def test_missing_interpreter_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(EvalError) as info:
        preflight(spec(str(tmp_path / "nope" / "python"), task()), tmp_path / "r.yaml")
    assert info.value.hint is not None and info.value.hint.startswith("python3 -m venv ")
    assert "/bin/pip install 'lm-eval[api]==" in info.value.hint


def test_offline_run_names_the_uncached_dataset_and_the_fetch(tmp_path: Path) -> None:
    gsm8k = task("gsm8k", task_dir=None, dataset="openai/gsm8k", dataset_name="main")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    recipe = tmp_path / "r.yaml"
    with pytest.raises(EvalError) as info:
        datasets.require_cached(spec("/p", task(), gsm8k), recipe, env)
    assert "gsm8k (openai/gsm8k)" in info.value.message and "offline" in info.value.message
    assert info.value.hint == f"m3patch model fetch {recipe}"
    snapshot = tmp_path / "hub" / "datasets--openai--gsm8k" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    with pytest.raises(EvalError):  # an empty snapshot is a download that never finished
        datasets.require_cached(spec("/p", gsm8k), recipe, env)
    (snapshot / "README.md").write_text("x")
    datasets.require_cached(spec("/p", task(), gsm8k), recipe, env)
