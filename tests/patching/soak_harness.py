"""Crash and concurrency soak: SIGKILL m3patch at random points, and run 8..32 at once.

    python scripts/measure/crash_soak.py [--kills 200] [--rounds 5] [--sizes 8 16 32] [--seed 0]

Works on a private hard-linked copy of the real vLLM 0.33.0 tree with tests/data/test-series
(4 modified files over 3 patches, one added file, one deleted). Two phases:

1. kills: a random apply or revert is SIGKILLed, half of the time at a random write step
   (M3PATCH_FAULT=kill-after:N, the test-only hook in m3patch/patching/writer.py), half of the time after a
   random delay (a real signal at an arbitrary instruction). Then a clean run of a random
   command must exit 0 and leave a verified state: applied (verify passes) or pristine (every
   file equals the wheel's RECORD), with no journal, staged file or backup left.
2. concurrency: N processes (mixed apply/revert) start at once on one tree, some of them
   SIGKILLed at random times; every survivor must exit 0, and after one clean apply the
   tree must verify, with nothing left behind.

Prints a table and writes <out>/crash_soak.json. Exits 1 if any run broke an invariant.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from m3patch.patching.api import verify_tree  # noqa: E402
from m3patch.patching.ledger import state_dir  # noqa: E402
from m3patch.patching.locate import tree_at  # noqa: E402
from m3patch.patching.pristine import copy_tree, pristine_tree, verify_against_record  # noqa: E402
from m3patch.patching.series import load_series  # noqa: E402

SERIES = REPO / "tests" / "data" / "test-series"
MAX_WRITE_STEP = 18  # write steps of a full apply of the test series (tests/patching/test_patching_writer.py)
MAX_DELAY_S = 0.6


@dataclass
class Phase:
    runs: int = 0
    killed: int = 0
    survivors_ok: int = 0
    verified_after: int = 0
    broken: list[str] = field(default_factory=list)


def _env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    env["M3PATCH_CRASH_DIR"] = str(Path(tempfile.gettempdir()) / "m3patch-soak-crash")
    if fault:
        env["M3PATCH_FAULT"] = fault
    return env


def _argv(command: str, root: Path) -> list[str]:
    return [sys.executable, "-m", "m3patch", command, "--vllm-root", str(root),
            "--series", str(SERIES)]


def spawn(command: str, root: Path, fault: str | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(_argv(command, root), cwd=REPO, env=_env(fault), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def leftovers(root: Path) -> list[str]:
    found = [str(p) for p in (root / "vllm").rglob("*")
             if p.name.endswith((".m3patch-new", ".m3patch-pre")) or ".tmp" in p.name
             or p.suffix in (".orig", ".rej")]
    if (state_dir(root) / "journal.json").exists():
        found.append("journal.json")
    return found


def verified_state(root: Path) -> str | None:
    """'applied' or 'pristine' when the tree is exactly one of them, else None."""
    if leftovers(root):
        return None
    if verify_tree(tree_at(root), load_series(SERIES)).ok:
        return "applied"
    return "pristine" if verify_against_record(root) == [] else None


def kill_one(rng: random.Random, root: Path) -> bool:
    """Run a command (mostly the one that writes) and SIGKILL it; True when the signal hit."""
    writes = "revert" if verified_state(root) == "applied" else "apply"
    command = writes if rng.random() < 0.8 else rng.choice(("apply", "revert"))
    if rng.random() < 0.5:
        proc = spawn(command, root, f"kill-after:{rng.randint(1, MAX_WRITE_STEP)}")
        proc.communicate(timeout=120)
    else:
        proc = spawn(command, root)
        time.sleep(rng.uniform(0.05, MAX_DELAY_S))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=120)
    return proc.returncode == -signal.SIGKILL


def kills_phase(rng: random.Random, root: Path, count: int) -> Phase:
    phase = Phase()
    for index in range(count):
        phase.runs += 1
        phase.killed += kill_one(rng, root)
        command = rng.choice(("apply", "revert"))
        proc = spawn(command, root)
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            phase.broken.append(f"kill {index}: clean {command} exited {proc.returncode}: "
                                f"{err.strip()[-300:]}")
            continue
        phase.survivors_ok += 1
        state = verified_state(root)
        want = "applied" if command == "apply" else "pristine"
        if state != want:
            phase.broken.append(f"kill {index}: after a clean {command} the tree is {state}; "
                                f"leftovers {leftovers(root)[:3]}")
        else:
            phase.verified_after += 1
    return phase


def concurrency_round(rng: random.Random, root: Path, size: int, phase: Phase) -> None:
    procs = [spawn(rng.choice(("apply", "revert")), root) for _ in range(size)]
    victims = set(rng.sample(range(size), k=rng.randint(0, size // 4)))
    time.sleep(rng.uniform(0.1, MAX_DELAY_S))
    for index in victims:
        procs[index].send_signal(signal.SIGKILL)
    for index, proc in enumerate(procs):
        _, err = proc.communicate(timeout=600)
        phase.runs += 1
        if proc.returncode == -signal.SIGKILL and index in victims:
            phase.killed += 1
        elif proc.returncode == 0:
            phase.survivors_ok += 1
        else:
            phase.broken.append(f"size {size}: a run exited {proc.returncode}: "
                                f"{err.strip()[-300:]}")
    final = spawn("apply", root)
    _, err = final.communicate(timeout=120)
    if final.returncode != 0 or verified_state(root) != "applied":
        phase.broken.append(f"size {size}: final apply exited {final.returncode}, tree "
                            f"{verified_state(root)}, leftovers {leftovers(root)[:3]}: "
                            f"{err.strip()[-300:]}")
    else:
        phase.verified_after += 1


def soak(kills: int, rounds: int, sizes: list[int], seed: int, work: Path) -> dict[str, Phase]:
    rng = random.Random(seed)
    root = copy_tree(pristine_tree("0.33.0"), work / "site-packages")
    results = {"sigkill at random points": kills_phase(rng, root, kills)}
    for size in sizes:
        phase = Phase()
        for _ in range(rounds):
            concurrency_round(rng, root, size, phase)
        results[f"{size} concurrent apply/revert"] = phase
    return results


def print_table(results: dict[str, Phase]) -> None:
    print(f"{'phase':<28} {'runs':>6} {'killed':>7} {'exit 0':>7} {'verified':>9} {'broken':>7}")
    for name, p in results.items():
        print(f"{name:<28} {p.runs:>6} {p.killed:>7} {p.survivors_ok:>7} {p.verified_after:>9} "
              f"{len(p.broken):>7}")


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "reliability")
    args = parser.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="m3patch-soak-") as tmp:
        results = soak(args.kills, args.rounds, args.sizes, args.seed, Path(tmp))
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    body = {"command": "python scripts/measure/crash_soak.py " + " ".join(argv or sys.argv[1:]),
            "seed": args.seed, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "seconds": round(time.time() - started, 1),
            "phases": {name: {"runs": p.runs, "killed": p.killed, "exit_0": p.survivors_ok,
                              "verified_after": p.verified_after, "broken": p.broken[:20]}
                       for name, p in results.items()}}
    out = args.out / "crash_soak.json"
    out.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if any(p.broken for p in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(cli())
