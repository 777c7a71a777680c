"""The whole-release apply, timed against `git apply`: the vLLM 0.32.0 -> 0.33.0 difference of
the published wheels (every text file; binaries left out, as m3patch applies text diffs only),
cut into one patch per folder (at most 12 files each) and locked on the pristine 0.32.0 tree.

Imported by scripts/measure/bench_core.py (`--release`); each run copies the pristine tree (hard
links, flushed) before each command and times, for the code under test and, with `--before DIR`,
for another checkout (e.g. main) in the same run: `m3patch apply` and `m3patch verify` of the
series cold (an empty m3patch cache: nothing parsed or compiled before), then `git apply` of
every patch and at once the warm `m3patch apply` (the same cache again) as a pair, then the warm
`verify`, `apply --verify` (which fills the compile memo) and a bare `verify` after it. Wall and
CPU (user + sys of the child) seconds.

This VM's cost of creating a file (which both tools pay for every patched file) moves tenfold
within seconds, so a ratio of two medians taken minutes apart says little: each warm apply is
timed right after its own `git apply`, and the headline is the median of those pairs' ratios.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def ram_ext4(size_mb: int = 3072) -> Iterator[Path]:
    """A fresh ext4 file system on a loop device backed by memory (/dev/shm), mounted in a
    temporary folder: a fast disk with ext4's own journal, syncfs and inode allocation, the same
    for every run (this VM's own disk moves tenfold in its cost of creating a file). Root
    only; unmounted and deleted afterwards."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        raise SystemExit("--ram-ext4 needs root and mkfs.ext4 (e2fsprogs)")
    image = Path(tempfile.mkstemp(prefix="m3patch-bench-ext4-", suffix=".img", dir="/dev/shm")[1])
    mount = Path(tempfile.mkdtemp(prefix="m3patch-bench-ext4-"))
    try:
        os.truncate(image, size_mb << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
        try:
            yield mount
        finally:
            subprocess.run(["umount", str(mount)], check=True)
    finally:
        mount.rmdir()
        image.unlink()


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
        dict[str, int], list[dict[str, object]], list[dict[str, object]]]:
    """Time, per code checkout in `codes` (label -> folder), m3patch apply and verify, cold and
    warm, and `git apply` paired with each warm apply, `runs` times each; rows of medians (the
    warm applies' also with the median of their pairs' ratios), and each pair with the
    file-creation cost measured just before it."""
    sys.path.insert(0, str(next(iter(codes.values()))))
    from m3patch.patching.pristine import copy_tree, pristine_tree

    old, new = pristine_tree("0.32.0"), pristine_tree("0.33.0")
    series = work / "release-series"
    counts = release_series(old, new, series)
    if os.stat(old).st_dev != os.stat(work).st_dev:  # copies by hard link need the same one
        old = copy_tree(old, work / "pristine-0.32.0")
    floor_pack = work / "floor-images.bin"
    paths = sorted({m.group(1).decode() for p in series.glob("*.patch")
                    for m in re.finditer(rb"(?m)^diff --git a/(\S+) b/", p.read_bytes())})
    (work / "floor-paths.txt").write_text("\n".join(paths) + "\n")
    floor = [sys.executable, str(Path(__file__).with_name("release_floor.py"))]
    subprocess.run([*floor, "pack", str(floor_pack), str(old), str(new),
                    str(work / "floor-paths.txt")], check=True)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    for code in codes.values():  # bytecode, as `pip install` leaves an installed m3patch: a
        # checkout run under PYTHONDONTWRITEBYTECODE=1 would compile every module on each run
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(code / "m3patch")],
                       env={**base_env, "PYTHONDONTWRITEBYTECODE": ""}, check=True,
                       capture_output=True)
    first = next(iter(codes.values()))
    subprocess.run([sys.executable, "-m", "m3patch", "series", "lock", "--series", str(series),
                    "--tree", str(old)], cwd=first, env=base_env, check=True,
                   capture_output=True)
    samples: dict[str, list[tuple[float, float]]] = {}
    patches = sorted(str(p) for p in series.glob("*.patch"))
    per_run: list[dict[str, object]] = []

    def on_copy(copy: str, steps: list[tuple[str, list[str], Path | None, dict[str, str]]]
                ) -> list[float]:
        """Each (name, command, cwd, env) in turn on one fresh flushed copy (TREE in the command;
        run in the copy when cwd is None); their wall seconds."""
        tree = on_disk(copy_tree(old, work / copy))
        walls = []
        for name, cmd, cwd, env in steps:
            result = timed([part.replace("TREE", str(tree)) for part in cmd], cwd=cwd or tree,
                           env=env)
            samples.setdefault(name, []).append(result)
            walls.append(result[0])
        shutil.rmtree(tree)
        return walls

    m3 = [sys.executable, "-m", "m3patch"]
    where = ["--vllm-root", "TREE", "--series", str(series)]
    for run in range(runs):
        for label, code in codes.items():
            env = {**base_env, "M3PATCH_CACHE": str(work / f"cache-{label}-{run}")}  # empty
            on_copy(f"m3-{label}-{run}-cold", [
                (f"{label}: m3patch apply (cold)", [*m3, "apply", *where], code, env),
                (f"{label}: m3patch verify (cold)", [*m3, "verify", *where], code, env)])
            # the pair: the file system's regime is the same for both within seconds
            create = create_cost(work)
            (git,) = on_copy(f"git-{label}-{run}",
                             [("git apply", ["git", "apply", *patches], None, base_env)])
            (least,) = on_copy(f"floor-{label}-{run}", [
                ("durable floor (release_floor.py)", [*floor, "apply", str(floor_pack), "TREE"],
                 None, base_env)])
            warm, _ = on_copy(f"m3-{label}-{run}-warm", [
                (f"{label}: m3patch apply (warm)", [*m3, "apply", *where], code, env),
                (f"{label}: m3patch verify (warm)", [*m3, "verify", *where], code, env)])
            per_run.append({"code": label, "create_ms": create, "git_apply_s": git,
                            "floor_s": least, "warm_apply_s": warm, "warm_vs_git": warm / git,
                            "floor_vs_git": least / git, "warm_vs_floor": warm / least})
            # the serve/bench/ci path: apply and verify in one process, which fills the compile
            # memo (a bare verify only reads it); then a bare verify of the same contents
            on_copy(f"m3-{label}-{run}-verify", [
                (f"{label}: m3patch apply --verify (warm parse)",
                 [*m3, "apply", "--verify", *where], code, env),
                (f"{label}: m3patch verify (after apply --verify)", [*m3, "verify", *where],
                 code, env)])
    git_wall = statistics.median(w for w, _ in samples["git apply"])
    git_cpu = statistics.median(c for _, c in samples["git apply"])
    rows: list[dict[str, object]] = []
    for name, values in samples.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        row: dict[str, object] = {
            "command": name, "runs": len(values), "median_wall_s": wall, "median_cpu_s": cpu,
            "min_wall_s": min(w for w, _ in values), "wall_vs_git_apply": wall / git_wall,
            "cpu_vs_git_apply": cpu / git_cpu}
        pairs = [float(str(p["warm_vs_git"])) for p in per_run
                 if name == f"{p['code']}: m3patch apply (warm)"]
        if pairs:
            row["median_pair_ratio"] = statistics.median(pairs)
        rows.append(row)
    return counts, rows, per_run


def print_rows(counts: dict[str, int], rows: list[dict[str, object]],
               per_run: list[dict[str, object]]) -> None:
    print(f"whole-release series: {counts}")
    print(f"{'command':44} {'runs':>4} {'wall s':>7} {'cpu s':>7} {'x git (wall)':>12} "
          f"{'x git (cpu)':>11}")
    for r in rows:
        print(f"{r['command']!s:44} {r['runs']!s:>4} {r['median_wall_s']:7.2f} "
              f"{r['median_cpu_s']:7.2f} {r['wall_vs_git_apply']:12.2f} {r['cpu_vs_git_apply']:11.2f}")
    print("each warm apply right after its own `git apply` (the file system's regime shared):")
    print(f"{'code':>7} {'create ms/file':>14} {'git apply s':>11} {'floor s':>7} "
          f"{'warm apply s':>12} {'x git':>6} {'floor x git':>11} {'x floor':>7}")
    for one in per_run:
        print(f"{one['code']!s:>7} {one['create_ms']:14.3f} {one['git_apply_s']:11.2f} "
              f"{one['floor_s']:7.2f} {one['warm_apply_s']:12.2f} {one['warm_vs_git']:6.2f} "
              f"{one['floor_vs_git']:11.2f} {one['warm_vs_floor']:7.2f}")
    floors = [float(str(one["floor_vs_git"])) for one in per_run]
    print(f"durable floor: median of its pairs' ratios {statistics.median(floors):.2f}x git apply")
    for r in rows:
        if "median_pair_ratio" in r:
            print(f"{r['command']}: median of its pairs' ratios {r['median_pair_ratio']:.2f}x "
                  "git apply")
