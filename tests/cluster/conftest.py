"""The multi-host test bed (scripts/testbed/netns_testbed.sh): network namespaces on a bridge, each a
"host" with its own address, hostname and loopback, no route anywhere else. Torn down even when
the test fails; the fixture then checks that no namespace or link of it is left.

On a dev machine that cannot build it (not root, no iproute2) the tests skip with the reason;
in CI (M3PATCH_CI_SLURM set, as .ci/run does; CI runs as root) they fail instead."""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import SCRIPT, Bed

CI_VAR = "M3PATCH_CI_SLURM"  # set by .ci/run: the CI machine, root, iproute2 installed


def _free_subnet() -> str:
    """A private /24 no interface of this machine is on (other runs may hold one)."""
    taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                           check=True).stdout
    nets = [ipaddress.ip_interface(w).network for line in taken.splitlines()
            for w in line.split() if "/" in w and w[0].isdigit()]
    for _ in range(100):
        subnet = f"10.{random.randint(100, 199)}.{random.randint(0, 255)}"
        candidate = ipaddress.ip_network(f"{subnet}.0/24")
        if not any(candidate.overlaps(n) for n in nets):
            return subnet
    pytest.fail("no free private /24 found for the test bed")


def _leftovers(name: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=False).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                           check=False).stdout
    return [w for w in (netns + links).replace(":", " ").replace("@", " ").split()
            if w.startswith(name)]


@pytest.fixture
def netns_bed() -> Iterator[Bed]:
    """Three hosts on one bridge (a P/D set uses all three, a DP set two); torn down after the
    test whatever happened."""
    absent = pytest.fail if os.environ.get(CI_VAR) else pytest.skip
    if os.geteuid() != 0:
        absent("the network-namespace test bed needs root")
    missing = [t for t in ("ip", "nsenter", "unshare") if shutil.which(t) is None]
    if missing:
        absent(f"the network-namespace test bed needs {', '.join(missing)} (iproute2, util-linux)")
    bed = Bed(f"m3{secrets.token_hex(3)}", _free_subnet(), 3)
    up = subprocess.run(["bash", str(SCRIPT), "up", bed.name, bed.subnet, str(bed.hosts)],
                        capture_output=True, text=True, timeout=60, check=False)
    try:
        assert up.returncode == 0, up.stderr
        yield bed
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", bed.name, str(bed.hosts)],
                       capture_output=True, timeout=120, check=False)
        assert _leftovers(bed.name) == [], "the test bed left namespaces or links behind"


@pytest.fixture(scope="session")
def router_venv() -> Path:
    """The vllm-router venv (scripts/setup/setup_router.sh). Skipped only with M3PATCH_SKIP_SERVE=1;
    missing is an error, since scripts/test.sh installs it."""
    if os.environ.get("M3PATCH_SKIP_SERVE") == "1":
        pytest.skip("M3PATCH_SKIP_SERVE=1")
    venv = Path(os.environ.get("M3PATCH_ROUTER_VENV",
                               Path.home() / ".cache" / "m3patch" / "vllm-router-venv"))
    if not (venv / "bin" / "vllm-router").is_file():
        pytest.fail(f"no vllm-router at {venv}: run scripts/setup/setup_router.sh {venv}")
    return venv
