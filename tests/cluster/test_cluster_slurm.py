"""The Slurm launcher for real: a two-node loopback cluster (Debian slurm-wlm + munge,
scripts/slurm_loopback.sh), the DP recipe's sbatch job (one `serve --role/--rank` task per
node, `srun --kill-on-bad-exit`), a request through the head, and a killed node ending the whole
job within the deadline with no process left. On a dev machine without Slurm (or not root) it is
skipped with the reason; in CI it fails instead: .ci/run installs slurm-wlm + munge beside the
venv setup and sets M3PATCH_CI_SLURM to a folder where it writes the install's exit status (`rc`)
and log, which this test waits for. ~75 s here. Run under `flock /tmp/m3patch-serve.lock`."""

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

from m3patch.cluster import rendezvous as rv
from m3patch.cluster.slurm import sbatch_script
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.topology import NodeId
from m3patch.serving.processes import group_members

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "cpu_tiny_moe_dp2.yaml"
READY_WAIT_S = 420
JOB_END_S = 60.0
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
    script = REPO / "scripts" / "slurm_loopback.sh"
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


def test_sbatch_dp_set_and_a_killed_rank_ends_the_job(slurm: dict[str, str], cpu_venv: Path,
                                                      tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    job_file = tmp_path / "job.sbatch"
    job_file.write_text(sbatch_script(load_recipe(RECIPE), run_dir, sweep=False))
    env = {**slurm, "M3PATCH_CMD": f"{sys.executable} -m m3patch", "PYTHONPATH": str(REPO),
           "M3PATCH_HEAD_ADDR": "127.0.0.1", "M3PATCH_CPU_VENV": str(cpu_venv),
           "M3PATCH_TINY_MODEL": str(tiny_model)}
    job = subprocess.run(["sbatch", "--parsable", str(job_file)], env=env, capture_output=True,
                         text=True, check=True).stdout.strip().split(";")[0]
    pgids: list[int] = []
    try:
        deadline = time.monotonic() + READY_WAIT_S
        head = rv.record_path(run_dir, NodeId("head", 0))
        while not (head.exists() and '"state": "ready"' in head.read_text()):
            logs = "\n".join(p.read_text()[-2000:] for p in (run_dir / "logs").glob("*.out"))
            assert squeue(slurm, job), f"job {job} ended before ready:\n{logs}"
            assert time.monotonic() < deadline, logs
            time.sleep(2.0)
        records = rv.read_records(run_dir)
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
        start = time.monotonic()
        os.killpg(victim, signal.SIGKILL)
        while squeue(slurm, job) and time.monotonic() - start < JOB_END_S + 60:
            time.sleep(0.5)
        took = time.monotonic() - start
        assert not squeue(slurm, job), f"job {job} still running {took:.0f} s after a rank died"
        assert took < JOB_END_S, f"the job took {took:.0f} s to end"
        time.sleep(2.0)
        for pgid in pgids:
            assert group_members(pgid) == [], f"process group {pgid} outlived the job"
    finally:
        subprocess.run(["scancel", job], env=slurm, check=False, capture_output=True)
