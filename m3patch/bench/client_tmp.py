"""A private temporary folder for each load client (`vllm bench serve`, `aiperf profile`),
removed once its process group is gone.

AIPerf leaves its dataset folder (`aiperf_mmap_<id>`) and its IPC sockets in the temporary
folder after a run: on a shared host they pile up in /tmp, a batch per cell. The client is
m3patch's own measurement process and meets no other process there, so it gets TMPDIR (and
TEMP/TMP where set) pointing at a fresh 0700 folder m3patch makes in the temporary folder the
client would have used (the first of TMPDIR, TEMP, TMP, /tmp, /var/tmp, /usr/tmp that takes a
folder, tempfile's order): what the client leaves there is m3patch's to delete, and deleting it
touches nothing of anyone else's. Torch Inductor's cache, which defaults to a folder in the
temporary folder and must outlive the run, is pinned where it would have been
(TORCHINDUCTOR_CACHE_DIR, unless the environment names one).

The server is not given one: other processes meet it in its temporary folder (a Ray cluster on
the node, vLLM's weight-cache daemon), Ray copies every VLLM_* variable to workers on other
hosts, and connectors name sockets of up to ~90 bytes there, so neither TMPDIR nor
VLLM_RPC_BASE_PATH can move; what it leaves there stays (docs/reliability.md says why).
Where the folder would make a UUID-named socket path longer than a Unix socket address holds,
none is made and the client keeps what it had. The folder of an m3patch killed with SIGKILL
stays (nothing runs to remove it); its name says whose it is.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from m3patch.output import warn

PREFIX = "m3patch-client-"
# sun_path holds 108 bytes with its terminating NUL; ZMQ IPC names here are <folder>/<uuid4>
_SOCKET_PATH_MAX = 107
_SOCKET_NAME = 1 + 36
_FALLBACKS = ("/tmp", "/var/tmp", "/usr/tmp")  # tempfile's own list, after the variables


def _candidates(env: Mapping[str, str]) -> Iterator[str]:
    for name in ("TMPDIR", "TEMP", "TMP"):
        if env.get(name):
            # tempfile's own spelling: abspath, links kept (resolve would follow them)
            yield os.path.abspath(env[name])  # noqa: PTH100
    yield from _FALLBACKS


def _user(env: Mapping[str, str]) -> str:
    """getpass.getuser() as the client would answer it, with torch's fallback for a uid that
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


def _make(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(base, folder): a fresh folder in the first candidate that takes one, as tempfile picks
    the client's; None where that base is too deep for a socket path under the folder."""
    for base in _candidates(env):
        if not (Path(base).is_dir() and os.access(base, os.W_OK | os.X_OK)):
            continue  # tempfile moves on past a base it cannot write in
        if len(os.fsencode(base)) + 1 + len(PREFIX) + 8 + _SOCKET_NAME > _SOCKET_PATH_MAX:
            return None  # the client would use this base; one level more would not fit
        try:
            return base, tempfile.mkdtemp(prefix=PREFIX, dir=base)
        except OSError:
            continue
    return None


def client_env(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """The client's environment with its own temporary folder, and that folder (None when none
    was made)."""
    out = dict(env)
    made = _make(env)
    if made is None:
        return out, None
    base, folder = made
    out.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_default(base, env))
    out["TMPDIR"] = folder
    for name in ("TEMP", "TMP"):  # tempfile reads TMPDIR first; other tools read these
        if name in out:
            out[name] = folder
    return out, folder


def remove_after(folder: str | None, survivors: list[int]) -> None:
    """Remove the folder once the client's group is gone; with members still alive (they
    outlived every signal) a member could still be writing there: left, with a warning."""
    if folder is not None and survivors:
        warn(f"{folder}: the load client's temporary folder was left: processes "
             f"{', '.join(map(str, survivors[:5]))} of its group outlived the stop")
        return
    remove(folder)


def remove(folder: str | None) -> None:
    """Delete the folder after its client's group is gone; a warning if it stays."""
    if folder is None:
        return
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return
    except OSError as exc:
        warn(f"{folder}: the load client's temporary folder was left: {exc.strerror}")
        return
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        warn(f"{folder}: no longer the folder m3patch made for its load client; left as it is")
        return
    try:
        shutil.rmtree(folder)  # fd-based on Linux: a link planted inside is removed, not followed
    except OSError as exc:
        warn(f"{folder}: the load client's temporary folder was left: {exc.strerror or exc}")
