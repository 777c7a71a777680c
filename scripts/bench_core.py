"""Benchmark the core: median wall time of `m3patch apply --verify` on an already patched tree
and of `m3patch --version`. Targets (issue 2): <= 0.5 s and <= 150 ms on the 2-core CI machine.

Usage: python scripts/bench_core.py [--runs N] [--out docs/results/bench_core.json]

Uses the full real series (patches/vllm-0.33.0, locked into a temp copy from the pristine
wheel); falls back to tests/data/test-series when that series does not lock, and says so.
A bare `python -c pass` row shows what interpreter start-up alone costs on this machine now.
Each command runs in a fresh interpreter, twice: as the environment is (this sandbox sets
PYTHONDONTWRITEBYTECODE=1, so every import compiles from source) and with bytecode caching
(PYTHONPYCACHEPREFIX in a temp dir, warmed by the first run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from m3patch.pristine import copy_tree, pristine_tree  # noqa: E402


def pick_series(work: Path) -> tuple[Path, str]:
    real = REPO / "patches" / "vllm-0.33.0"
    if (real / "series.yaml").is_file():
        copy = Path(shutil.copytree(real, work / "series"))
        proc = subprocess.run([sys.executable, "-m", "m3patch", "series", "lock", "--series",
                               str(copy), "--pristine"], capture_output=True, text=True,
                              cwd=REPO, check=False)
        if proc.returncode == 0:
            return copy, "patches/vllm-0.33.0 (full real series)"
        print(f"real series did not lock: {proc.stderr.strip()}", file=sys.stderr)
    return REPO / "tests" / "data" / "test-series", "tests/data/test-series (FALLBACK)"


def timed(cmd: list[str], env: dict[str, str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
        out.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "bench_core.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="m3patch-bench-") as tmp:
        work = Path(tmp)
        series, series_label = pick_series(work)
        tree = copy_tree(pristine_tree("0.33.0"), work / "tree")
        base = [sys.executable, "-m", "m3patch"]
        apply_cmd = [*base, "apply", "--verify", "--vllm-root", str(tree), "--series", str(series)]
        env_as_is = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
        env_cached = {k: v for k, v in env_as_is.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env_cached["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        timed(apply_cmd, env_as_is, 1)  # patch the tree; the timed runs are all "already applied"
        timed(apply_cmd, env_cached, 1)  # warm the bytecode cache
        rows = []
        for label, env in (("as-is", env_as_is), ("bytecode-cached", env_cached)):
            for name, cmd, target in (("apply --verify (patched tree)", apply_cmd, 0.5),
                                      ("--version", [*base, "--version"], 0.150),
                                      ("python -c pass (baseline)", [sys.executable, "-c", "pass"],
                                       float("nan"))):
                times = timed(cmd, env, args.runs)
                rows.append({"command": name, "env": label, "median_s": statistics.median(times),
                             "min_s": min(times), "max_s": max(times), "runs": len(times),
                             "target_s": target, "argv": cmd})
    print(f"series: {series_label}")
    print(f"{'command':32} {'env':16} {'median s':>9} {'min s':>7} {'max s':>7} {'target':>7}")
    for r in rows:
        print(f"{r['command']:32} {r['env']:16} {r['median_s']:9.3f} {r['min_s']:7.3f} "
              f"{r['max_s']:7.3f} {r['target_s']:7.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"series": series_label, "python": sys.version.split()[0],
              "machine": platform.platform(), "cpus": os.cpu_count(),
              "load_avg": os.getloadavg(), "rows": rows,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
