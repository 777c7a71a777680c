"""The Unix sockets a server's processes bound on the file system, removed once the server is
gone (Linux /proc; no psutil).

vLLM binds its ZMQ IPC channels as UUID-named socket files in the temporary folder (or
VLLM_RPC_BASE_PATH) and leaves them there when it stops: a batch per launch, piling up in /tmp
on a shared host. Moving them elsewhere is not safe: other processes meet the server in its
temporary folder (a Ray cluster started on the node, vLLM's weight-cache daemon), Ray copies
every VLLM_* variable to workers on other hosts, and connectors name sockets up to ~90 bytes
long under the same folder (LMCache's lookup and offload channels), which one more folder level
pushes past the 107 bytes a socket address holds. So the server's environment is left as it
is, and what it leaves is cleaned up by proof of ownership instead:
- while the server runs (on each poll until it is ready, which catches the start-up
  handshake's socket that vLLM closes but leaves, and again just before the stop), the sockets
  its processes hold are matched by inode with /proc/net/unix, which names the path each is
  bound to;
- after the whole group is gone, each such path is unlinked only if it is still the same socket
  file (device, inode and change time, as seen while the server ran), of this user, that no
  process has bound any more (a path someone unlinked and bound again is left).
Sockets of a process that exited before either look are not known, and stay.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

_UNIX_TABLE = Path("/proc/net/unix")
_FIELDS = 7  # Num RefCount Protocol Flags Type St Inode, then the path (if any)


def _bound_paths() -> dict[int, str]:
    """Socket inode -> the file-system path it is bound to (abstract and unnamed sockets left
    out), for this network namespace."""
    try:
        lines = _UNIX_TABLE.read_bytes().split(b"\n")[1:]
    except OSError:
        return {}
    table = {}
    for line in lines:
        parts = line.split(None, _FIELDS)
        if len(parts) == _FIELDS + 1 and parts[_FIELDS].startswith(b"/"):
            with contextlib.suppress(ValueError):
                table[int(parts[6])] = os.fsdecode(parts[_FIELDS])
    return table


def _socket_inodes(pids: Iterable[int]) -> set[int]:
    """The inodes of the sockets these processes hold open (those they may read)."""
    found = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # exited, or not ours to read
            continue
        for fd in fds:
            with contextlib.suppress(OSError, ValueError):
                target = str(fd.readlink())
                if target.startswith("socket:["):
                    found.add(int(target[8:-1]))
    return found


# path -> (st_dev, st_ino, st_ctime_ns) of the socket file: a freed inode is handed out again
# at once, so a socket file made anew at the path can have the old number, never the old time
SocketFiles = dict[str, tuple[int, int, int]]


def bound_by(pids: Iterable[int]) -> SocketFiles:
    """The socket files these processes have bound and hold now, each with its identity."""
    inodes = _socket_inodes(pids)
    found: SocketFiles = {}
    for inode, path in _bound_paths().items() if inodes else ():
        if inode in inodes:
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid():
                    found[path] = (info.st_dev, info.st_ino, info.st_ctime_ns)
    return found


def remove_unbound(files: SocketFiles) -> list[str]:
    """After the processes are gone: unlink each file that is still the same socket file and
    that no process has bound any more; the paths removed."""
    if not files:
        return []
    still_bound = set(_bound_paths().values())
    removed = []
    for path, identity in sorted(files.items()):
        if path in still_bound:
            continue
        try:
            info = os.lstat(path)
        except OSError:
            continue  # gone already (vLLM unlinked it), or nothing we can see
        if (info.st_dev, info.st_ino, info.st_ctime_ns) == identity and stat.S_ISSOCK(info.st_mode):
            with contextlib.suppress(OSError):
                Path(path).unlink()
                removed.append(path)
    return removed
