"""The Slurm launcher for real: a two-node loopback cluster (Debian slurm-wlm + munge,
scripts/testbed/slurm_loopback.sh), the DP recipe's sbatch job (one `serve --role/--rank` task per
node, `srun --kill-on-bad-exit`), a request through the head, and a killed node ending the whole
job within the deadline with no process left (~100 s here, in CI); and, `extended`, the sweep
through Slurm: from the batch step once the head is ready, and as an array job of one task per
cell against a running set ended by scancel, both aggregating as a local run does. On a dev
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

from m3patch.bench.runner import check_results, select_cells
from m3patch.cluster import rendezvous as rv
from m3patch.cluster.slurm import sbatch_script, sweep_array_script
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
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    # In CI a missing Slurm is a failure (CI installed it), elsewhere a skip with the reason.
    absent = pytest.fail if ci_install_status() is not None else pytest.skip
    missing = [t for t in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(t) is None
               and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        absent(f"Slurm is not installed ({', '.join(missing)} missing): "
               "apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        absent("the loopback Slurm cluster needs root (slurmd, cgroups)")
    script = REPO / "scripts" / "testbed" / "slurm_loopback.sh"
    start = subprocess.run(["bash", str(script), "start", str(tmp_path / "slurm")],
                           capture_output=True, text=True, timeout=120, check=False)
    assert start.returncode == 0, start.stderr
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
    return {**slurm, "M3PATCH_CMD": f"{sys.executable} -m m3patch", "PYTHONPATH": str(REPO),
            "M3PATCH_HEAD_ADDR": "127.0.0.1", "M3PATCH_CPU_VENV": str(cpu_venv),
            "M3PATCH_TINY_MODEL": str(tiny_model)}


def submit(script: str, path: Path, env: dict[str, str]) -> str:
    path.write_text(script)
    return subprocess.run(["sbatch", "--parsable", str(path)], env=env, capture_output=True,
                          text=True, check=True).stdout.strip().split(";")[0]


def tail_logs(run_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}"
                     for p in sorted((run_dir / "logs").glob("*.out")))


def wait_head_ready(slurm: dict[str, str], job: str, run_dir: Path) -> dict[NodeId, rv.NodeRecord]:
    deadline = time.monotonic() + READY_WAIT_S
    head = rv.record_path(run_dir, NodeId("head", 0))
    while not (head.exists() and '"state": "ready"' in head.read_text()):
        assert squeue(slurm, job), f"job {job} ended before ready:\n{tail_logs(run_dir)}"
        assert time.monotonic() < deadline, tail_logs(run_dir)
        time.sleep(2.0)
    return rv.read_records(run_dir)


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


def test_sbatch_dp_set_and_a_killed_rank_ends_the_job(slurm: dict[str, str], cpu_venv: Path,
                                                      tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    env = job_env(slurm, cpu_venv, tiny_model)
    job = submit(sbatch_script(load_recipe(RECIPE), run_dir, sweep=False), tmp_path / "job.sbatch",
                 env)
    try:
        records = wait_head_ready(slurm, job, run_dir)
        pgids = [r.pgid for r in records.values() if r.pgid is not None]
        assert records[NodeId("node", 0)].ledger_sha256 == records[NodeId("head", 0)].ledger_sha256
        body = json.dumps({"model": "tiny-moe", "prompt": "Hello", "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request("http://127.0.0.1:8775/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["choices"]
        victim = records[NodeId("node", 0)].pgid
        assert victim is not None
        os.killpg(victim, signal.SIGKILL)
        took = wait_gone(slurm, job, JOB_END_S + 60, run_dir)
        assert took < JOB_END_S, f"the job took {took:.0f} s to end"
        assert_no_process_left(pgids)
    finally:
        subprocess.run(["scancel", job], env=slurm, check=False, capture_output=True)


def small_sweep_recipe(tmp_path: Path) -> Path:
    """The DP recipe with a two-cell sweep of a few short requests: the sweep's plumbing through
    Slurm is under test here, not its numbers."""
    text = RECIPE.read_text()
    for old, new in (("series: ../patches/", f"series: {REPO / 'patches'}/"),
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


@pytest.mark.extended  # two set starts and two small sweeps on the Slurm cluster: ~6-10 min
def test_sbatch_sweeps_aggregate_as_a_local_run(slurm: dict[str, str], cpu_venv: Path,
                                                tiny_model: Path, tmp_path: Path) -> None:
    recipe = load_recipe(small_sweep_recipe(tmp_path))
    cells = sorted(cell.cell_id for cell in select_cells(recipe, ()))
    assert len(cells) == 2
    env = job_env(slurm, cpu_venv, tiny_model)
    # 1. The job's own sweep: from the batch step once the head is ready, then the set stops
    #    and the job ends by itself.
    run1 = tmp_path / "run1"
    (run1 / "logs").mkdir(parents=True)
    job = submit(sbatch_script(recipe, run1), tmp_path / "job1.sbatch", env)
    try:
        records = wait_head_ready(slurm, job, run1)
        pgids = [r.pgid for r in records.values() if r.pgid is not None]
        wait_gone(slurm, job, SWEEP_S, run1)
    finally:
        subprocess.run(["scancel", job], env=slurm, check=False, capture_output=True)
    assert_aggregated(run1 / "bench", cells, tail_logs(run1))
    assert {r.state for r in rv.read_records(run1).values()} == {"exited"}
    assert_no_process_left(pgids)
    # 2. The array fan-out: one array task per cell against a running set, then a clean scancel.
    run2 = tmp_path / "run2"
    (run2 / "logs").mkdir(parents=True)
    job = submit(sbatch_script(recipe, run2, sweep=False), tmp_path / "job2.sbatch", env)
    try:
        records = wait_head_ready(slurm, job, run2)
        pgids = [r.pgid for r in records.values() if r.pgid is not None]
        array = submit(sweep_array_script(recipe, run2, cells, "http://127.0.0.1:8775"),
                       tmp_path / "sweep.sbatch", env)
        wait_gone(slurm, array, SWEEP_S, run2)
        assert_aggregated(run2 / "bench", cells, tail_logs(run2))
        assert {r.state for r in rv.read_records(run2).values()} == {"ready"}  # the set held
        subprocess.run(["scancel", job], env=slurm, check=True, capture_output=True)
        took = wait_gone(slurm, job, JOB_END_S + 60, run2)
        assert took < JOB_END_S, f"scancel took {took:.0f} s to end the job"
    finally:
        subprocess.run(["scancel", job], env=slurm, check=False, capture_output=True)
    assert_no_process_left(pgids)
