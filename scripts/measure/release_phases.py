"""Where a warm whole-release apply spends its time: the phases of `m3patch apply` in one process.

    python scripts/measure/release_phases.py [--runs 3] [--out docs/results/release_phases.json]

Builds the vLLM 0.32.0 -> 0.33.0 release series as bench_release.py does, locks it, fills an
empty cache with one cold apply, then times warm applies on fresh flushed copies of the pristine
tree with a timer around each phase (wall seconds, median of --runs), and counts, in one more
run under cProfile, the calls that used to dominate (lstat, pathlib parses, sha256, file
creation). The code under test is this checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = [("m3patch.commands.common", "start_tree_command"), ("m3patch.patching.apply", "pinned"),
          ("m3patch.patching.apply", "load_patches"), ("m3patch.patching.apply", "_images"),
          ("m3patch.patching.apply", "read_and_classify"), ("m3patch.patching.apply", "_plan"),
          ("m3patch.patching.apply", "folders_of"), ("m3patch.patching.apply", "to_changes"),
          ("m3patch.patching.writer", "_write_journal"), ("m3patch.patching.writer", "_stage"),
          ("m3patch.patching.writer", "_stage_durable"), ("m3patch.patching.writer", "_swap"),
          ("m3patch.patching.writer", "_finish"), ("m3patch.patching.writer", "commit")]
COUNTED = {"lstat": "{built-in method posix.lstat}", "open": "{built-in method posix.open}",
           "sha256": "{built-in method _hashlib.openssl_sha256}",
           "pathlib parse": "pathlib.py:56(parse_parts)"}


def _timed(totals: dict[str, float], module: str, name: str) -> None:
    mod = importlib.import_module(module)
    if not hasattr(mod, name):  # an older checkout without this phase
        return
    real = getattr(mod, name)
    label = f"{module.rsplit('.', 1)[-1]}.{name}"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

    setattr(mod, name, wrapper)
    if module == "m3patch.commands.common":  # the command module imported it by name
        setattr(importlib.import_module("m3patch.commands.apply"), name, wrapper)


def _apply(argv: list[str]) -> float:
    from m3patch.main import main
    from m3patch.patching import memo

    memo.start_command(read_only=False)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"apply exited {code}")
    return time.perf_counter() - start


def _fresh(copy: Callable[[Path, Path], Path], old: Path, dest: Path) -> Path:
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    tree = copy(old, dest)
    os.sync()
    return tree


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "release_phases.json")
    args = parser.parse_args()
    from bench_release import create_cost, release_series

    from m3patch.patching.pristine import copy_tree, pristine_tree

    with tempfile.TemporaryDirectory(prefix="m3patch-phases-") as tmp:
        work = Path(tmp)
        old, new = pristine_tree("0.32.0"), pristine_tree("0.33.0")  # from the usual cache
        os.environ["M3PATCH_CACHE"] = str(work / "cache")  # m3patch's memos: empty
        series = work / "series"
        counts = release_series(old, new, series)
        from m3patch.main import main as m3patch_main

        with contextlib.redirect_stdout(io.StringIO()):
            m3patch_main(["series", "lock", "--series", str(series), "--tree", str(old)])
        where = ["--series", str(series)]
        _apply(["apply", "--vllm-root", str(_fresh(copy_tree, old, work / "cold")), *where])
        totals: dict[str, float] = {}
        for module, name in PHASES:
            _timed(totals, module, name)
        samples: dict[str, list[float]] = {}
        creates = [create_cost(work)]
        for run in range(args.runs):
            totals.clear()
            tree = _fresh(copy_tree, old, work / f"warm-{run}")
            totals["whole command (in process)"] = _apply(["apply", "--vllm-root", str(tree), *where])
            for label, value in totals.items():
                samples.setdefault(label, []).append(value)
        creates.append(create_cost(work))
        tree = _fresh(copy_tree, old, work / "profiled")
        profile = cProfile.Profile()
        profile.runcall(_apply, ["apply", "--vllm-root", str(tree), *where])
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        name_of = pstats.func_std_string  # type: ignore[attr-defined]
        calls = {label: sum(v[1] for k, v in stats.items() if name_of(k).endswith(key))
                 for label, key in COUNTED.items()}
    rows = sorted(((label, statistics.median(v)) for label, v in samples.items()),
                  key=lambda row: -row[1])
    print(f"warm whole-release apply ({counts}), median of {args.runs}, wall s")
    for label, value in rows:
        print(f"  {label:34} {value:7.3f}")
    print(f"one file created: {creates[0]:.3f} ms before the runs, {creates[1]:.3f} ms after")
    print("calls (one profiled warm apply): " + ", ".join(f"{k} {v}" for k, v in calls.items()))
    report = {"series": counts, "runs": args.runs, "phases_wall_s": dict(rows), "calls": calls,
              "create_ms_before_after": creates,
              "command": "python scripts/measure/release_phases.py " + " ".join(sys.argv[1:]),
              "python": sys.version.split()[0], "cpus": os.cpu_count(),
              "load_avg": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
