"""Benchmark the core: median wall time of `m3patch apply --verify` on an already patched tree
and of `m3patch --version`. Targets: <= 0.5 s and <= 150 ms on the 2-core CI machine.

Usage: python scripts/measure/bench_core.py [--runs N] [--out docs/results/bench_core.json]
       python scripts/measure/bench_core.py --release [--release-runs N] [--before DIR]
              [--ram-ext4] [--out docs/results/bench_release.json]

`--release` times the whole-release apply instead (bench_release.py: the vLLM 0.32.0 -> 0.33.0
difference as a series, m3patch apply and verify, cold and warm, each warm apply paired with its
own `git apply` and the durable floor (release_floor.py) run just before it; with `--before DIR`
a second checkout of m3patch, e.g. main, in the same run; with `--ram-ext4` every tree on a
fresh memory-backed ext4, the same fast disk for every run).

Uses the full real series (patches/vllm-0.33.0, locked into a temp copy from the pristine
wheel); falls back to tests/data/test-series when that series does not lock, and says so.
A bare `python -c pass` row shows what interpreter start-up alone costs on this machine now.
Each command runs in a fresh interpreter, twice: as the environment is (this sandbox sets
PYTHONDONTWRITEBYTECODE=1, so every import compiles from source) and with bytecode caching
(PYTHONPYCACHEPREFIX in a temp dir, warmed by the first run).
"""

from __future__ import annotations

import argparse
import contextlib
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from m3patch.patching.pristine import copy_tree, pristine_tree  # noqa: E402


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


def import_costs(cmd: list[str], env: dict[str, str], top: int = 12) -> list[dict[str, object]]:
    """The largest cumulative import times (us) of one run, from `python -X importtime`."""
    proc = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True,
                          env=env, cwd=REPO, check=False)
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append({"module": parts[2].rstrip(), "self_us": int(parts[0]),
                         "cumulative_us": int(parts[1])})
    return sorted(rows, key=lambda r: -int(str(r["cumulative_us"])))[:top]


def profile_top(cmd: list[str], env: dict[str, str], top: int = 12) -> list[str]:
    """cProfile's top functions by cumulative time of one run (its own text lines)."""
    proc = subprocess.run([cmd[0], "-m", "cProfile", "-s", "tottime", *cmd[1:]],
                          capture_output=True, text=True, env=env, cwd=REPO, check=False)
    lines = proc.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("ncalls")), None)
    return [] if start is None else [line.strip() for line in lines[start:start + top + 1]]


def portable_argv(cmd: list[str]) -> list[str]:
    """argv as recorded in the committed JSON: no machine-specific interpreter or temp paths."""
    tmp = tempfile.gettempdir()
    return ["python" if arg == sys.executable else arg.replace(tmp, "$TMPDIR") for arg in cmd]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "bench_core.json")
    parser.add_argument("--release", action="store_true",
                        help="time the whole-release apply against git apply instead")
    parser.add_argument("--release-runs", type=int, default=3)
    parser.add_argument("--ram-ext4", action="store_true",
                        help="--release: run every tree on a fresh ext4 backed by memory (root)")
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help="--release: also time the m3patch checkout in DIR (e.g. main)")
    args = parser.parse_args()
    if args.release:
        return release(args)
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
        load_before = os.getloadavg()
        imports = import_costs(apply_cmd, env_as_is)
        profile = profile_top(apply_cmd, env_as_is)
        rows = []
        for label, env in (("as-is", env_as_is), ("bytecode-cached", env_cached)):
            for name, cmd, target in (("apply --verify (patched tree)", apply_cmd, 0.5),
                                      ("--version", [*base, "--version"], 0.150),
                                      ("python -c pass (baseline)", [sys.executable, "-c", "pass"],
                                       None)):
                times = timed(cmd, env, args.runs)
                rows.append({"command": name, "env": label, "median_s": statistics.median(times),
                             "min_s": min(times), "max_s": max(times), "runs": len(times),
                             "target_s": target, "argv": portable_argv(cmd)})
    print(f"series: {series_label}")
    print(f"{'command':32} {'env':16} {'median s':>9} {'min s':>7} {'max s':>7} {'target':>7}")
    for r in rows:
        print(f"{r['command']:32} {r['env']:16} {r['median_s']:9.3f} {r['min_s']:7.3f} "
              f"{r['max_s']:7.3f} {'-' if r['target_s'] is None else format(r['target_s'], '7.3f'):>7}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for row in imports[:8]:
        print(f"import {str(row['module']).strip():40} {row['cumulative_us']!s:>8} us cumulative")
    report = {"series": series_label, "python": sys.version.split()[0],
              "command": "python scripts/measure/bench_core.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.platform()} ({os.cpu_count()}-core CI machine, shared with "
                         "other jobs: see load_avg)", "cpus": os.cpu_count(),
              "file_system": "ext4 on a loop device in /dev/shm (--ram-ext4)" if args.ram_ext4
              else "the machine's own disk (the temporary folder's file system)",
              "load_avg_before": load_before, "load_avg": os.getloadavg(), "rows": rows,
              "importtime_top": imports, "cprofile_top_tottime": profile,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(report, indent=2, allow_nan=False)
    # Committed output: no machine-specific paths (repo checkout, interpreter prefix, home).
    for path, name in ((str(Path(__file__).resolve().parents[2]) + "/", ""),
                       (sys.base_prefix, "<python>"), (str(Path.home()), "~")):
        text = text.replace(path, name)
    args.out.write_text(text + "\n")
    print(f"wrote {args.out}")
    return 0


def release(args: argparse.Namespace) -> int:
    from bench_release import print_rows, ram_ext4, release_rows

    codes = {"after": REPO, **({"before": args.before.resolve()} if args.before else {})}
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        parent = stack.enter_context(ram_ext4()) if args.ram_ext4 else None
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="m3patch-release-",
                                                              dir=parent))
        counts, rows, per_run = release_rows(Path(tmp), args.release_runs, codes)
    print_rows(counts, rows, per_run)
    out = args.out if args.out != REPO / "docs" / "results" / "bench_core.json" else (
        REPO / "docs" / "results" / "bench_release.json")
    report = {"series": counts, "python": sys.version.split()[0],
              "command": "python scripts/measure/bench_core.py " + " ".join(sys.argv[1:]).replace(
                  str(args.before), "BEFORE_DIR"),
              "code": {k: ("this checkout" if v == REPO else "--before checkout")
                       for k, v in codes.items()},
              "machine": f"{platform.platform()} ({os.cpu_count()} cores, shared with other "
                         "jobs: see load_avg)", "cpus": os.cpu_count(),
              "file_system": "ext4 on a loop device in /dev/shm (--ram-ext4)" if args.ram_ext4
              else "the machine's own disk (the temporary folder's file system)",
              "load_avg_before": load_before, "load_avg": os.getloadavg(), "rows": rows,
              "per_run": per_run, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(report, indent=2, allow_nan=False)
    for path, name in ((str(REPO) + "/", ""), (str(Path.home()), "~")):
        text = text.replace(path, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
