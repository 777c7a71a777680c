"""Random sequences on the real vLLM 0.33.0 tree with the shipped series (seeded, bounded).

Each step is one of: apply, apply --offset, revert (of the shipped series A, or of a second
series B: A less `tuned-tables-h200`, new id, relocked with the real `m3patch series lock`), a
hand edit of a file the series touches (a comment line at the top: a moved base that --offset
can port; at the end; inside a hunk), a deletion, a file put back to its pristine bytes, or
every file put back (a reinstall of vLLM, which leaves m3patch's ledger).
After every step, for the series the ledger names (else A), and for the other one:

- status, verify and a dry-run apply agree with each other: verify passes exactly when status
  shows every file applied and nothing pending or in conflict; status shows a conflict exactly
  when the dry run refuses (exit 5); a dry run that would write names exactly the files status
  does not show as applied; the other series is refused (exit 5) while the tree holds one;
- they agree with the bytes on disk: status's hash of every file is the file's sha256 (None when
  absent), "applied" is the final pin or the post-image an offset apply recorded, "pristine"
  the first pin, "missing" an absent file;
- a real apply or revert does what its dry run said: refused with the same code and the tree's
  bytes untouched, or done, and then verify passes (apply) / every file is pristine (revert);
- nothing outside `vllm/` changed (every file under the folder above the tree root, hashed).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from core_helpers import REPO, replace_file

from m3patch.errors import M3PatchError, PatchConflict
from m3patch.main import main
from m3patch.patching.api import apply_series, revert_series, tree_status, verify_tree
from m3patch.patching.ledger import read_ledger
from m3patch.patching.locate import VllmTree, tree_at
from m3patch.patching.pristine import copy_tree
from m3patch.patching.series import Series, load_series
from m3patch.patching.series_lock import pinned

SHIPPED = REPO / "patches" / "vllm-0.33.0"
DROPPED = "tuned-tables-h200"
SEEDS = (1, 2, 3, 4)
STEPS = 40  # per seed: about 12 s of CPU each (wall time grows with the machine's load)
APPLIED = ("applied", "applied (offset)")
LOCK_FILE = "vllm/.m3patch/lock"  # the documented lock file: the one thing a run may leave


def second_series(tmp: Path) -> Path:
    """The shipped series less one patch, with a new id, relocked on the pristine tree."""
    folder = shutil.copytree(SHIPPED, tmp / "series-b")
    manifest = (folder / "series.yaml").read_text()
    start = manifest.index(f"  - id: {DROPPED}")
    end = manifest.index("  - id: ", start + 1)
    manifest = manifest[:start] + manifest[end:]
    manifest = manifest.replace("id: vllm-0.33.0\n", "id: vllm-0.33.0-less-h200\n", 1)
    (folder / "series.yaml").write_text(manifest)
    next(folder.glob("0005-*.patch")).unlink()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["series", "lock", "--series", str(folder), "--pristine"]) == 0
    return folder


def outside_digest(scope: Path, root: Path) -> str:
    """Every file and folder under `scope` but `root/vllm`: names and bytes."""
    sha = hashlib.sha256()
    for folder, dirs, files in os.walk(scope):
        if Path(folder) == root:
            dirs.remove("vllm")
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            sha.update(str(path.relative_to(scope)).encode() + b"\0" + path.read_bytes())
        sha.update(f"{folder}/{sorted(dirs)}".encode())
    return sha.hexdigest()


def vllm_bytes(root: Path, files: list[str]) -> dict[str, object]:
    """What a refused run must leave as it was: every file either series touches, the folders
    above them, and m3patch's state folder (but its documented lock file)."""
    out: dict[str, object] = {}
    for rel in files:
        path = root / rel
        out[rel] = path.read_bytes() if path.is_file() else None
        for parent in Path(rel).parents:
            out[str(parent)] = (root / parent).is_dir()
    state = root / "vllm" / ".m3patch"
    for path in sorted(state.iterdir()) if state.is_dir() else ():
        if str(path.relative_to(root)) != LOCK_FILE:
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def code_of(call: Callable[[], Any]) -> tuple[int, Any]:
    try:
        return 0, call()
    except M3PatchError as exc:
        return exc.exit_code, exc


class World:
    """The tree, both series, and the checks run after every step."""

    def __init__(self, root: Path, scope: Path, pristine: Path, a: Series, b: Series) -> None:
        self.root, self.scope, self.pristine = root, scope, pristine
        self.tree: VllmTree = tree_at(root)
        self.series = {"A": a, "B": b}
        self.hashes = {k: pinned(s).hashes for k, s in self.series.items()}
        self.outside = outside_digest(scope, root)
        self.files = sorted({p for h in self.hashes.values() for p in h})

    def holder(self) -> str | None:
        ledger = read_ledger(self.root)
        if ledger is None or not ledger.files:
            return None
        return next(k for k, s in self.series.items() if s.id == ledger.series)

    def check(self, step: str) -> None:
        assert outside_digest(self.scope, self.root) == self.outside, step
        held = self.holder()
        name = held or "A"
        series = self.series[name]
        status_code, status = code_of(lambda: tree_status(self.tree, series))
        assert status_code == 0, (step, status)
        verify = verify_tree(self.tree, series)
        dry_code, dry = code_of(lambda: apply_series(self.tree, series, dry_run=True))
        states = {f["path"]: f["state"] for f in status.files}
        done = all(s in APPLIED for s in states.values())
        assert verify.ok == (done and not status.interrupted), (step, states, verify.problems)
        assert bool(status.conflicts) == (dry_code == PatchConflict.exit_code), (step, states, dry)
        if dry_code == 0:
            assert set(dry.files_written) == {p for p, s in states.items() if s not in APPLIED}, (
                step, states, dry.files_written)
        else:
            assert dry_code == PatchConflict.exit_code, (step, dry)
        self._check_bytes(step, name, status.files)
        other = "B" if name == "A" else "A"
        if held is not None:
            for call in (apply_series, revert_series):
                code, _ = code_of(lambda c=call: c(self.tree, self.series[other], dry_run=True))
                assert code == PatchConflict.exit_code, (step, call.__name__, other)

    def _check_bytes(self, step: str, name: str, files: tuple[dict[str, Any], ...]) -> None:
        ledger = read_ledger(self.root)
        recorded = {f.path: f.post for f in ledger.files} if ledger is not None else {}
        for item in files:
            path, state = item["path"], item["state"]
            target = self.root / path
            current = hashlib.sha256(target.read_bytes()).hexdigest() if target.is_file() else None
            pins = self.hashes[name][path]
            assert item["sha256"] == current, (step, path)
            if state == "applied":
                assert current == pins[-1], (step, path)
            elif state == "applied (offset)":
                assert current == recorded[path] and current not in pins, (step, path)
            elif state == "pristine":
                assert current == pins[0], (step, path)
            elif state == "missing":
                assert current is None, (step, path)
            else:
                assert current not in (pins[0], pins[-1]), (step, path, state)

    # ---- steps --------------------------------------------------------------------------------

    def run(self, name: str, *, revert: bool = False, offset: bool = False) -> str:
        series = self.series[name]
        if revert:
            dry_code, _ = code_of(lambda: revert_series(self.tree, series, dry_run=True))
        else:
            mode = "offset" if offset else "strict"
            dry_code, _ = code_of(lambda: apply_series(self.tree, series, dry_run=True, mode=mode))
        before = vllm_bytes(self.root, self.files)
        if revert:
            code, _ = code_of(lambda: revert_series(self.tree, series))
        else:
            code, _ = code_of(lambda: apply_series(self.tree, series, mode=mode))
        assert code == dry_code, (name, revert, offset, code, dry_code)
        if code != 0:
            assert vllm_bytes(self.root, self.files) == before, "a refused run changed the tree"
        elif revert:
            status = tree_status(self.tree, series)
            assert {f["state"] for f in status.files} <= {"pristine", "drifted"}, status.files
            assert read_ledger(self.root) is None
        else:
            assert verify_tree(self.tree, series).ok, (name, offset)
        return f"{'revert' if revert else 'apply'}{' --offset' if offset else ''} {name}: {code}"

    def edit(self, rng: random.Random) -> str:
        existing = [p for p in self.files if p.endswith(".py") and (self.root / p).is_file()]
        if not existing:
            return "edit: nothing to edit"
        path = rng.choice(existing)
        lines = (self.root / path).read_bytes().splitlines(keepends=True)
        where = rng.choice(("top", "end", "inside"))
        at = {"top": 1, "end": len(lines), "inside": len(lines) // 2}[where]
        lines.insert(at, b"# hand edit\n")
        replace_file(self.root / path, b"".join(lines))
        return f"edit {where} {path}"

    def delete(self, rng: random.Random) -> str:
        existing = [p for p in self.files if (self.root / p).is_file()]
        if not existing:
            return "delete: nothing"
        path = rng.choice(existing)
        (self.root / path).unlink()
        return f"delete {path}"

    def _put_back(self, path: str) -> None:
        source, target = self.pristine / path, self.root / path
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            replace_file(target, source.read_bytes())
        elif target.is_file():
            target.unlink()

    def restore(self, rng: random.Random) -> str:
        """One file the series touches back to its pristine bytes (one that differs, if any)."""
        differ = [p for p in self.files if not self._pristine(p)]
        path = rng.choice(differ or self.files)
        self._put_back(path)
        return f"restore {path}"

    def reinstall(self) -> str:
        """Every file back to pristine, as `pip install --force-reinstall` would (the ledger in
        vllm/.m3patch/ is not vLLM's file and stays)."""
        for path in self.files:
            self._put_back(path)
        return "reinstall"

    def _pristine(self, path: str) -> bool:
        source, target = self.pristine / path, self.root / path
        if not source.is_file():
            return not target.exists()
        return target.is_file() and target.read_bytes() == source.read_bytes()


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sequences_keep_status_verify_apply_and_the_bytes_in_agreement(
        seed: int, pristine_033: Path, tmp_path: Path) -> None:
    scope = tmp_path / "scope"
    root = copy_tree(pristine_033, scope / "site-packages")
    (scope / "neighbour.txt").write_text("outside vllm/: must never change\n")
    world = World(root, scope, pristine_033, load_series(SHIPPED),
                  load_series(second_series(tmp_path)))
    rng = random.Random(seed)
    actions: list[tuple[int, Callable[[], str]]] = [
        (5, lambda: world.run("A")), (2, lambda: world.run("B")),
        (2, lambda: world.run("A", offset=True)), (1, lambda: world.run("B", offset=True)),
        (3, lambda: world.run("A", revert=True)), (2, lambda: world.run("B", revert=True)),
        (3, lambda: world.edit(rng)), (2, lambda: world.delete(rng)),
        (3, lambda: world.restore(rng)), (2, world.reinstall)]
    weights = [w for w, _ in actions]
    history: list[str] = []
    started = time.process_time()
    world.check("start")
    for _ in range(STEPS):
        (_, action), = rng.choices(actions, weights)
        history.append(action())
        world.check(" / ".join(history[-4:]))
    assert time.process_time() - started < 60, "the property test must stay bounded"
    outcomes = " ".join(history)
    assert ": 0" in outcomes and ": 5" in outcomes, outcomes  # both successes and refusals ran
    kinds = Counter(h.split(" vllm/")[0].removesuffix(" top").removesuffix(" end")
                    .removesuffix(" inside") for h in history)
    print(f"seed {seed}: {STEPS} steps, {time.process_time() - started:.1f} s CPU: "
          + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
