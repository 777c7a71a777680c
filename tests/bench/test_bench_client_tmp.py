"""The load client's own temporary folder (bench.client_tmp): where it is made, what the
client's environment says, what is kept as the user set it, and the folder's removal.

The real clients' use of it (nothing of theirs left after a run) is shown with the real
`vllm bench serve` and `aiperf profile` in test_bench_serve.py and test_run_agentic.py; here
the folder's own rules, on real files.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from m3patch.bench import client_tmp


def test_the_client_gets_its_own_temporary_folder(short_tmp: Path) -> None:
    env = {"TMPDIR": str(short_tmp), "TMP": "/elsewhere", "USER": "alice", "PATH": "/usr/bin"}
    out, folder = client_tmp.client_env(env)
    assert folder is not None and Path(folder).parent == short_tmp
    assert Path(folder).name.startswith(client_tmp.PREFIX)
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    assert out["TMPDIR"] == out["TMP"] == folder and "TEMP" not in out
    assert out["PATH"] == "/usr/bin" and env["TMPDIR"] == str(short_tmp)  # the caller's kept
    # the compile cache stays where torch would have put it, shared by later runs
    assert out["TORCHINDUCTOR_CACHE_DIR"] == str(short_tmp / "torchinductor_alice")
    client_tmp.remove(folder)
    assert list(short_tmp.iterdir()) == []


def test_the_folder_goes_where_tempfile_would_look(short_tmp: Path) -> None:
    """tempfile passes over a variable naming no folder and takes the next: so does m3patch."""
    chosen = {"TMPDIR": str(short_tmp / "missing"), "TEMP": str(short_tmp),
              "TORCHINDUCTOR_CACHE_DIR": "/cache/inductor"}
    out, folder = client_tmp.client_env(chosen)
    assert folder is not None and Path(folder).parent == short_tmp
    assert out["TORCHINDUCTOR_CACHE_DIR"] == "/cache/inductor"
    client_tmp.remove(folder)


def test_no_folder_where_the_sockets_would_not_fit(short_tmp: Path) -> None:
    """A Unix socket address holds 107 bytes; a ZMQ IPC socket is named <base>/<uuid4>: under a
    50-byte base it fits (87 bytes), under m3patch's folder in it it would not (111). Bytes,
    not characters: a 40-character base with ten two-byte letters is 50 bytes deep."""
    room = 40 - len(str(short_tmp)) - 1
    for name in ("d" * (room + 10), "é" * 10 + "d" * (room - 10)):
        deep = short_tmp / name
        deep.mkdir()
        assert len(os.fsencode(deep)) == 50
        env = {"TMPDIR": str(deep)}
        assert client_tmp.client_env(env) == (env, None)
        assert list(deep.iterdir()) == []


def test_removal_takes_sockets_and_links_but_nothing_they_point_at(short_tmp: Path) -> None:
    base = short_tmp / "tmp"
    base.mkdir()
    outside = short_tmp / "precious.txt"
    outside.write_text("keep")
    _, folder = client_tmp.client_env({"TMPDIR": str(base)})
    assert folder is not None
    with socket.socket(socket.AF_UNIX) as sock:  # as ZMQ IPC channels leave them
        sock.bind(f"{folder}/0f3e8c1a-5c1d-4d7e-9a57-0d5d5d6b9d21")
    (Path(folder) / "aiperf_mmap_0123").mkdir()
    (Path(folder) / "sub").mkdir()
    (Path(folder) / "sub" / "link").symlink_to(outside)
    client_tmp.remove(folder)
    assert list(base.iterdir()) == [] and outside.read_text() == "keep"


def test_a_folder_swapped_for_a_link_is_left_with_a_warning(
        short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, folder = client_tmp.client_env({"TMPDIR": str(short_tmp)})
    assert folder is not None
    victim = short_tmp / "victim"
    victim.mkdir()
    (victim / "data").write_text("keep")
    os.rmdir(folder)
    Path(folder).symlink_to(victim)
    client_tmp.remove(folder)
    assert (victim / "data").read_text() == "keep"
    assert "no longer the folder m3patch made for its load client" in capsys.readouterr().err
    client_tmp.remove(str(short_tmp / "gone"))  # already gone: nothing to say
    assert capsys.readouterr().err == ""


def test_a_folder_whose_client_outlived_the_stop_is_left_with_a_warning(
        short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, folder = client_tmp.client_env({"TMPDIR": str(short_tmp)})
    assert folder is not None
    client_tmp.remove_after(folder, [4242])
    assert Path(folder).is_dir()
    assert "processes 4242 of its group outlived the stop" in capsys.readouterr().err
    client_tmp.remove_after(folder, [])
    assert not Path(folder).exists()
