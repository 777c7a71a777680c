"""A private temporary folder for each process group m3patch launches (the server, the load
client), removed once the group is gone.

vLLM leaves run-scoped files in the temporary folder after a stop: one UUID-named ZMQ IPC socket
per channel (VLLM_RPC_BASE_PATH defaults to the temporary folder) and torch.distributed's file
store (`vllm_dist_<hex>`); AIPerf leaves its dataset folder (`aiperf_mmap_<id>`). On a shared
host they pile up in /tmp, one batch per launch. m3patch makes a fresh 0700 folder inside the
temporary folder the launch would have used (the environment's TMPDIR, TEMP or TMP, else
Python's choice) and points the child at it, so what the child leaves there is m3patch's to
delete, and deleting it touches nothing of anyone else's:

- the server gets only VLLM_RPC_BASE_PATH (unless the environment sets it: the user chose).
  Its TMPDIR stays as it was, because other processes meet the server there: a Ray cluster
  started on the node (`ray_current_cluster`, Ray's session sockets), vLLM's weight-cache
  daemon sockets, Torch Inductor's shared compile cache. The store file is left, as before;
- the load client (`vllm bench serve`, `aiperf profile`) gets TMPDIR (and TEMP/TMP where set):
  it is m3patch's own measurement process and meets nobody there. Torch Inductor's cache, which
  defaults to a folder in the temporary folder and must outlive the run, is pinned where it
  would have been (TORCHINDUCTOR_CACHE_DIR, unless the environment names one).

Where the folder would make a socket path longer than a Unix socket address holds, none is made
and the child keeps what it had (a launch that works without m3patch must not fail with it).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from m3patch.output import warn

SERVER, CLIENT = "m3patch-vllm-", "m3patch-client-"  # the folders' name prefixes
RPC_VAR = "VLLM_RPC_BASE_PATH"
# sun_path holds 108 bytes with its terminating NUL; vLLM names each socket <base>/<uuid4>
_SOCKET_PATH_MAX = 107
_SOCKET_NAME = 1 + 36


def _base(env: Mapping[str, str]) -> str:
    """The temporary folder the child's Python would pick (tempfile's order of variables)."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = env.get(name)
        if value and Path(value).is_dir():
            # tempfile's own spelling of it: abspath, links kept (resolve would follow them)
            return os.path.abspath(value)  # noqa: PTH100
    return tempfile.gettempdir()


def _user(env: Mapping[str, str]) -> str:
    """getpass.getuser() as the child would answer it, with torch's fallback for a uid that
    has no name (containers run as arbitrary uids)."""
    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        if env.get(name):
            return env[name]
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid_{os.getuid()}"


def inductor_default(base: str, env: Mapping[str, str]) -> str:
    """torch's default TORCHINDUCTOR_CACHE_DIR for a process whose temporary folder is `base`."""
    return str(Path(base) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", _user(env))))


def _make(base: str, prefix: str) -> str | None:
    """A fresh 0700 folder `prefix`XXXXXXXX in `base`; None where the base refuses it or a
    socket named in it would not fit in a socket address."""
    if len(base) + 1 + len(prefix) + 8 + _SOCKET_NAME > _SOCKET_PATH_MAX:
        return None
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=base)
    except OSError:
        return None  # the child's own use of that folder fails as it would without us


def server_env(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """The server's environment with its IPC sockets in a folder of m3patch's, and that folder
    (None when none was made)."""
    out = dict(env)
    if out.get(RPC_VAR):
        return out, None
    folder = _make(_base(env), SERVER)
    if folder is not None:
        out[RPC_VAR] = folder
    return out, folder


def client_env(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """The load client's environment with its own temporary folder, and that folder (None
    when none was made)."""
    base = _base(env)
    out = dict(env)
    folder = _make(base, CLIENT)
    if folder is None:
        return out, None
    out.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_default(base, env))
    out["TMPDIR"] = folder
    for name in ("TEMP", "TMP"):  # tempfile reads TMPDIR first; other tools read these
        if name in out:
            out[name] = folder
    return out, folder


def remove(folder: str | None) -> None:
    """Delete the private folder after its child's group is gone; a warning if it stays."""
    if folder is None:
        return
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return
    except OSError as exc:
        warn(f"{folder}: the temporary folder of m3patch's child was left: {exc.strerror}")
        return
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        warn(f"{folder}: no longer the folder m3patch made for its child; left as it is")
        return
    try:
        shutil.rmtree(folder)  # fd-based on Linux: a link planted inside is removed, not followed
    except OSError as exc:
        warn(f"{folder}: the temporary folder of m3patch's child was left: {exc.strerror or exc}")
