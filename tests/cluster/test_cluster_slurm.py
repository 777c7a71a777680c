"""The Slurm launcher for real: a two-node cluster across network namespaces (Debian slurm-wlm +
munge, scripts/testbed/slurm_netns.sh: one slurmd per namespace of the test bed, NodeAddr its address),
the DP recipe's sbatch job as `serve --write-sbatch` writes it (no folder made by hand; one
`serve --role/--rank` task per node, `srun --kill-on-bad-exit`), the nodes on their own
addresses, a request from the machine through the head's address, and a killed node ending the
whole job within the deadline with no process left (in CI); and, `extended`, the sweep from the
batch step once the head is ready, aggregating as a local run does. On a dev
machine without Slurm (or not root) they skip with the reason; in CI they fail instead: .ci/run
installs slurm-wlm + munge beside the venv setup and sets M3PATCH_CI_SLURM to a folder where it
writes the install's exit status (`rc`) and log, which the fixture waits for. Run under
`flock /tmp/m3patch-serve.lock`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import Bed, set_records

from m3patch.bench.runner import check_results, select_cells
from m3patch.cluster import rendezvous as rv
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.topology import NodeId
from m3patch.serving.processes import group_members

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "cpu_tiny_moe_dp2.yaml"
READY_WAIT_S = 420
JOB_END_S = 60.0
SWEEP_S = 300.0
CI_SLURM_VAR = "M3PATCH_CI_SLURM"
CI_INSTALL_WAIT_S = 600


def ci_install_status() -> Path | None:
    """CI's promise of Slurm: the folder .ci/run's background install reports into, once it has
    finished (waited for); None on a dev machine. Fails the test when the install failed."""
    folder = os.environ.get(CI_SLURM_VAR)
    if not folder:
        return None
    rc_file, deadline = Path(folder) / "rc", time.monotonic() + CI_INSTALL_WAIT_S
    while not rc_file.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{CI_SLURM_VAR}={folder}: the Slurm install did not finish within "
                        f"{CI_INSTALL_WAIT_S} s (log {folder}/install.log)")
        time.sleep(1.0)
    rc = rc_file.read_text().strip()
    if rc != "0":
        log = (Path(folder) / "install.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"CI's slurm-wlm + munge install exited {rc}:\n{log}")
    return Path(folder)


@pytest.fixture
def slurm(tmp_path: Path, netns_bed: Bed) -> Iterator[dict[str, str]]:
    # In CI a missing Slurm is a failure (CI installed it), elsewhere a skip with the reason.
    absent = pytest.fail if ci_install_status() is not None else pytest.skip
    missing = [t for t in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(t) is None
               and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        absent(f"Slurm is not installed ({', '.join(missing)} missing): "
               "apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        absent("the Slurm cluster needs root (slurmd, cgroups)")
    script = REPO / "scripts" / "testbed" / "slurm_netns.sh"
    try:
        start = subprocess.run(["bash", str(script), "start", str(tmp_path / "slurm"),
                                netns_bed.name, netns_bed.subnet],
                               capture_output=True, text=True, timeout=120, check=False)
        assert start.returncode == 0, start.stderr
    except BaseException:
        subprocess.run(["bash", str(script), "stop", str(tmp_path / "slurm")], check=False)
        raise
    env = {**os.environ, "SLURM_CONF": start.stdout.strip()}
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, check=False,
                       capture_output=True)
        subprocess.run(["bash", str(script), "stop", str(tmp_path / "slurm")], check=False)


def squeue(env: dict[str, str], job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True,
                          check=False).stdout.strip()


def job_env(slurm: dict[str, str], cpu_venv: Path, tiny_model: Path) -> dict[str, str]:
    env = {**slurm, "M3PATCH_CMD": f"{sys.executable} -m m3patch", "PYTHONPATH": str(REPO),
           "M3PATCH_CPU_VENV": str(cpu_venv), "M3PATCH_TINY_MODEL": str(tiny_model)}
    for name in ("M3PATCH_HEAD_ADDR", "M3PATCH_SET_ID", "VLLM_HOST_IP"):
        env.pop(name, None)  # the job finds the head's address and its set id itself
    return env


def write_job(recipe: Path, run_dir: Path, path: Path) -> str:
    """The job exactly as `serve --write-sbatch` writes it (it also makes RUN/logs)."""
    proc = subprocess.run([sys.executable, "-m", "m3patch", "serve", str(recipe),
                           "--write-sbatch", str(path), "--run-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return path.read_text()


def submit(script: str, path: Path, env: dict[str, str]) -> str:
    path.write_text(script)
    return subprocess.run(["sbatch", "--parsable", str(path)], env=env, capture_output=True,
                          text=True, check=True).stdout.strip().split(";")[0]


def tail_logs(run_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}"
                     for p in sorted((run_dir / "logs").glob("*.out")))


def wait_head_ready(slurm: dict[str, str], job: str, run_dir: Path) -> dict[NodeId, rv.NodeRecord]:
    deadline = time.monotonic() + READY_WAIT_S
    head = rv.record_path(run_dir, f"slurm-{job}.0", NodeId("head", 0))
    while not (head.exists() and '"state": "ready"' in head.read_text()):
        assert squeue(slurm, job), f"job {job} ended before ready:\n{tail_logs(run_dir)}"
        assert time.monotonic() < deadline, tail_logs(run_dir)
        time.sleep(2.0)
    return set_records(run_dir)


def wait_gone(slurm: dict[str, str], job: str, limit_s: float, run_dir: Path) -> float:
    start = time.monotonic()
    while squeue(slurm, job) and time.monotonic() - start < limit_s:
        time.sleep(0.5)
    took = time.monotonic() - start
    assert not squeue(slurm, job), f"job {job} still there after {took:.0f} s:\n{tail_logs(run_dir)}"
    return took


def assert_no_process_left(pgids: list[int]) -> None:
    time.sleep(2.0)
    for pgid in pgids:
        assert group_members(pgid) == [], f"process group {pgid} outlived the job"


def test_sbatch_dp_set_and_a_killed_rank_ends_the_job(slurm: dict[str, str], netns_bed: Bed,
                                                      cpu_venv: Path, tiny_model: Path,
                                                      tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = job_env(slurm, cpu_venv, tiny_model)
    script = write_job(RECIPE, run_dir, tmp_path / "written.sbatch")
    job = submit_without_sweep(script, tmp_path, env)
    try:
        records = wait_head_ready(slurm, job, run_dir)
        pgids = [r.pgid for r in records.values() if r.pgid is not None]
        head, node = records[NodeId("head", 0)], records[NodeId("node", 0)]
        # one slurmd per namespace: the head task ran on n2 (10.x.y.11), the node on n1
        assert (node.host, head.host) == ("n1", "n2")
        assert (node.address, head.address) == (netns_bed.address(0), netns_bed.address(1))
        assert node.ledger_sha256 == head.ledger_sha256
        body = json.dumps({"model": "tiny-moe", "prompt": "Hello", "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://{head.address}:8775/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["choices"]
        victim = node.pgid
        assert victim is not None
        os.killpg(victim, signal.SIGKILL)
        took = wait_gone(slurm, job, JOB_END_S + 60, run_dir)
        assert took < JOB_END_S, f"the job took {took:.0f} s to end"
        assert_no_process_left(pgids)
    finally:
        subprocess.run(["scancel", job], env=slurm, check=False, capture_output=True)


def submit_without_sweep(script: str, tmp_path: Path, env: dict[str, str]) -> str:
    """The written job with its sweep left out (the set only): everything up to the sweep as
    written, then wait for srun."""
    head, sep, _sweep = script.partition("# The sweep runs from the batch step")
    assert sep, "the written job has no sweep section"
    return submit(head + 'wait "$SET"\n', tmp_path / "job.sbatch", env)


def small_sweep_recipe(tmp_path: Path) -> Path:
    """The DP recipe with a two-cell sweep of a few short requests: the sweep's plumbing through
    Slurm is under test here, not its numbers."""
    text = RECIPE.read_text()
    for old, new in (("series: vllm-", f"series: {REPO / 'patches'}/vllm-"),
                     ("prompts-per-concurrency: 10", "prompts-per-concurrency: 2"),
                     ("warmups-per-concurrency: 2", "warmups-per-concurrency: 1"),
                     ("{isl: 32, osl: 128, concurrency: [1, 2, 4]}",
                      "{isl: 32, osl: 16, concurrency: [1, 2]}")):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / RECIPE.name
    path.write_text(text)
    return path


def assert_aggregated(bench_dir: Path, cells: list[str], logs: str) -> None:
    """What a local run's results step checks: every cell file and aggregate.json read back and
    validated, the aggregate covering every cell of the sweep."""
    assert (bench_dir / "aggregate.json").is_file(), logs
    files, aggregate = check_results(bench_dir)
    assert sorted(p.stem for p in files) == cells
    assert sorted(row["cell_id"] for row in aggregate["rows"]) == cells, aggregate["rows"]
    assert (bench_dir / "aggregate.csv").is_file()


@pytest.mark.extended  # a set start and a small sweep on the Slurm cluster: ~5 min
def test_sbatch_sweeps_aggregate_as_a_local_run(slurm: dict[str, str], cpu_venv: Path,
                                                tiny_model: Path, tmp_path: Path) -> None:
    recipe = load_recipe(small_sweep_recipe(tmp_path))
    cells = sorted(cell.cell_id for cell in select_cells(recipe, ()))
    assert len(cells) == 2
    env = job_env(slurm, cpu_venv, tiny_model)
    # 1. The job's own sweep: from the batch step once the head is ready, then the set stops
    #    and the job ends by itself.
    run1 = tmp_path / "run1"
    job = submit(write_job(recipe.path, run1, tmp_path / "job1.sbatch"), tmp_path / "job1.sbatch",
                 env)
    try:
        records = wait_head_ready(slurm, job, run1)
        pgids = [r.pgid for r in records.values() if r.pgid is not None]
        wait_gone(slurm, job, SWEEP_S, run1)
    finally:
        subprocess.run(["scancel", job], env=slurm, check=False, capture_output=True)
    assert_aggregated(run1 / "bench", cells, tail_logs(run1))
    assert {r.state for r in set_records(run1).values()} == {"exited"}
    assert_no_process_left(pgids)
