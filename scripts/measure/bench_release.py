"""The whole-release apply, timed against `git apply`: the vLLM 0.32.0 -> 0.33.0 difference of
the published wheels (every text file; binaries left out, as m3patch applies text diffs only),
cut into one patch per folder (at most 12 files each) and locked on the pristine 0.32.0 tree.

Imported by scripts/measure/bench_core.py (`--release`); each run copies the pristine tree (hard
links, flushed) and times, in turn: `git apply` of every patch, then `m3patch apply` and
`m3patch verify` of the series, cold (an empty m3patch cache: nothing parsed or compiled before)
and warm (the same cache again), then `apply --verify` (which fills the compile memo) and a
bare `verify` after it, for the code under test and, with `--before DIR`, for another checkout
(e.g. main) in the same run, so the machine's load falls on both alike. Wall and CPU (user + sys of the child) seconds.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 12


def release_series(old: Path, new: Path, dest: Path) -> dict[str, int]:
    """Write the release difference as a series into `dest` (unlocked); its counts."""
    out = subprocess.run(["git", "diff", "--no-index", "--no-renames", "--no-color",
                          str(old / "vllm"), str(new / "vllm")], capture_output=True,
                         check=False).stdout
    groups: dict[str, list[bytes]] = {}
    binaries = 0
    for section in re.split(rb"(?m)^(?=diff --git )", out):
        if not section.startswith(b"diff --git"):
            continue
        if b"\nBinary files " in section or b"GIT binary patch" in section or b"\0" in section \
                or b"\n@@" not in section:
            binaries += 1
            continue
        for side, tree in ((b"a", old), (b"b", new), (b"a", new), (b"b", old)):
            section = section.replace(side + str(tree).encode() + b"/", side + b"/")
        match = re.match(rb"diff --git a/(\S+) b/(\S+)", section)
        assert match is not None
        parts = match.group(2).decode().split("/")
        key = "/".join(parts[:3]) if len(parts) > 3 else "/".join(parts[:-1])
        groups.setdefault(key, []).append(section)
    dest.mkdir(parents=True)
    lines = ["schema: 1", "id: release-0.32.0-to-0.33.0", "target:", '  vllm-version: "0.32.0"',
             "patches:"]
    number = 0
    for key in sorted(groups):
        for start in range(0, len(groups[key]), CHUNK):
            number += 1
            name = re.sub(r"[^a-z0-9]+", "-", key.lower()).strip("-")
            (dest / f"{number:04d}-{name}.patch").write_bytes(b"".join(groups[key][start:start + CHUNK]))
            lines += [f"  - id: r{number:03d}-{name}"[:64], f"    file: {number:04d}-{name}.patch",
                      "    summary: the release difference", "    why: benchmark",
                      "    upstream: []", "    drop-when: never"]
    (dest / "series.yaml").write_text("\n".join(lines) + "\n")
    files = sum(len(v) for v in groups.values())
    hunks = sum(s.count(b"\n@@ ") for v in groups.values() for s in v)
    return {"patches": number, "files": files, "hunks": hunks, "binary_files_left_out": binaries}


def on_disk(tree: Path) -> Path:
    """The copy flushed before it is timed, as an installed tree is: a command that makes its
    own writes durable (m3patch's syncfs) must not also pay for flushing the copy itself."""
    os.sync()
    return tree


def create_cost(folder: Path, files: int = 500) -> float:
    """Milliseconds to create one empty file on this file system now: the largest single cost
    of an apply (and of `git apply`), and on this VM it varies with its page cache tenfold."""
    probe = folder / "create-probe"
    probe.mkdir()
    start = time.perf_counter()
    for index in range(files):
        os.close(os.open(probe / f"f{index}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    cost = (time.perf_counter() - start) / files * 1e3
    for index in range(files):
        (probe / f"f{index}").unlink()
    probe.rmdir()
    return cost


def timed(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall, cpu) seconds of one run; a failure stops the benchmark with its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def release_rows(work: Path, runs: int, codes: dict[str, Path]) -> tuple[
        dict[str, int], list[dict[str, object]], list[dict[str, float]]]:
    """Time git apply and, per code checkout in `codes` (label -> folder), m3patch apply and
    verify, cold and warm, `runs` times each; rows of medians, and per run the file-creation
    cost beside `git apply` and the first checkout's warm apply."""
    sys.path.insert(0, str(next(iter(codes.values()))))
    from m3patch.patching.pristine import copy_tree, pristine_tree

    old, new = pristine_tree("0.32.0"), pristine_tree("0.33.0")
    series = work / "release-series"
    counts = release_series(old, new, series)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    for code in codes.values():  # bytecode, as `pip install` leaves an installed m3patch: a
        # checkout run under PYTHONDONTWRITEBYTECODE=1 would compile every module on each run
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(code / "m3patch")],
                       env={**base_env, "PYTHONDONTWRITEBYTECODE": ""}, check=True,
                       capture_output=True)
    first_label, first = next(iter(codes.items()))
    subprocess.run([sys.executable, "-m", "m3patch", "series", "lock", "--series", str(series),
                    "--tree", str(old)], cwd=first, env=base_env, check=True,
                   capture_output=True)
    samples: dict[str, list[tuple[float, float]]] = {}
    patches = sorted(str(p) for p in series.glob("*.patch"))
    for run in range(runs):
        # this VM's cost of creating a file varies tenfold with its page cache, and both tools
        # create every patched file: each run records it, so each ratio carries its regime
        samples.setdefault("create ms", []).append((create_cost(work), 0.0))
        tree = on_disk(copy_tree(old, work / f"git-{run}"))
        samples.setdefault("git apply", []).append(
            timed(["git", "apply", *patches], cwd=tree, env=base_env))
        shutil.rmtree(tree)
        for label, code in codes.items():
            cache = work / f"cache-{label}-{run}"  # empty: the cold runs
            for temp in ("cold", "warm"):
                env = {**base_env, "M3PATCH_CACHE": str(cache)}
                tree = on_disk(copy_tree(old, work / f"m3-{label}-{run}-{temp}"))
                m3 = [sys.executable, "-m", "m3patch"]
                where = ["--vllm-root", str(tree), "--series", str(series)]
                samples.setdefault(f"{label}: m3patch apply ({temp})", []).append(
                    timed([*m3, "apply", *where], cwd=code, env=env))
                samples.setdefault(f"{label}: m3patch verify ({temp})", []).append(
                    timed([*m3, "verify", *where], cwd=code, env=env))
                shutil.rmtree(tree)
            # the serve/bench/ci path: apply and verify in one process, which fills the compile
            # memo (a bare verify only reads it); then a bare verify of the same contents
            tree = on_disk(copy_tree(old, work / f"m3-{label}-{run}-verify"))
            where = ["--vllm-root", str(tree), "--series", str(series)]
            samples.setdefault(f"{label}: m3patch apply --verify (warm parse)", []).append(
                timed([*m3, "apply", "--verify", *where], cwd=code, env=env))
            samples.setdefault(f"{label}: m3patch verify (after apply --verify)", []).append(
                timed([*m3, "verify", *where], cwd=code, env=env))
            shutil.rmtree(tree)
    creates = [ms for ms, _ in samples.pop("create ms")]
    per_run = [{"create_ms": ms, "git_apply_s": git[0], "warm_apply_s": warm[0],
                "warm_vs_git": warm[0] / git[0]}
               for ms, git, warm in zip(creates, samples["git apply"],
                                        samples[f"{first_label}: m3patch apply (warm)"], strict=True)]
    git_wall = statistics.median(w for w, _ in samples["git apply"])
    git_cpu = statistics.median(c for _, c in samples["git apply"])
    rows: list[dict[str, object]] = []
    for name, values in samples.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        rows.append({"command": name, "runs": len(values), "median_wall_s": wall,
                     "median_cpu_s": cpu, "min_wall_s": min(w for w, _ in values),
                     "wall_vs_git_apply": wall / git_wall, "cpu_vs_git_apply": cpu / git_cpu})
    return counts, rows, per_run


def print_rows(counts: dict[str, int], rows: list[dict[str, object]],
               per_run: list[dict[str, float]]) -> None:
    print(f"whole-release series: {counts}")
    print(f"{'command':44} {'runs':>4} {'wall s':>7} {'cpu s':>7} {'x git (wall)':>12} "
          f"{'x git (cpu)':>11}")
    for r in rows:
        print(f"{r['command']!s:44} {r['runs']!s:>4} {r['median_wall_s']:7.2f} "
              f"{r['median_cpu_s']:7.2f} {r['wall_vs_git_apply']:12.2f} {r['cpu_vs_git_apply']:11.2f}")
    print(f"{'run':>4} {'create ms/file':>14} {'git apply s':>11} {'warm apply s':>12} {'x git':>6}")
    for number, one in enumerate(per_run, 1):
        print(f"{number:>4} {one['create_ms']:14.3f} {one['git_apply_s']:11.2f} "
              f"{one['warm_apply_s']:12.2f} {one['warm_vs_git']:6.2f}")
