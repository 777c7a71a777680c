"""The floor of a durable, journaled apply: only the system work m3patch's writer must do.

    python scripts/measure/release_floor.py pack PACK OLD_TREE NEW_TREE PATHS_FILE
    python scripts/measure/release_floor.py apply PACK TREE [--threads N]

`pack` writes, for the files in PATHS_FILE (one `vllm/...` path per line), their post-images
(NEW_TREE's bytes; a file absent there is deleted) into one file, as m3patch's image memo holds
them. `apply` then does, on TREE, what any apply with m3patch's crash safety has to do and
nothing else: read and hash every file; write a journal (fsync); per file a backup hard link,
the new folders and a staged post-image; one syncfs; a second journal (fsync); the renames and
unlinks; one syncfs; the backups removed; the journal removed. Per-file work runs on N threads,
each owning whole folders, as m3patch's writer does. No series, lock, patch, parse, plan, ledger
or check of any input: a lower bound for m3patch and a reference for `git apply`, which does
none of the durable steps. bench_release.py times it in the same pairs as `git apply`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path


def pack(out: Path, old: Path, new: Path, paths: list[str]) -> None:
    """PACK: a JSON index (path, offset, length; -1 for a deletion) then the images."""
    index, blobs, offset = [], [], 0
    for rel in paths:
        target = new / rel
        if target.is_file():
            data = target.read_bytes()
            index.append([rel, offset, len(data), (old / rel).exists()])
            blobs.append(data)
            offset += len(data)
        else:
            index.append([rel, offset, -1, True])
    head = json.dumps(index).encode()
    out.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


Item = tuple[str, int, int, bool]  # path, offset, length (-1: delete), the file exists before


def _by_folder(items: list[Item], threads: int) -> list[list[Item]]:
    groups: dict[str, list[Item]] = {}
    for item in items:
        top = item[0].split("/")[:2]  # vllm/<pkg>: folders a new file may create stay together
        groups.setdefault("/".join(top), []).append(item)
    shares: list[list[Item]] = [[] for _ in range(threads)]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(shares, key=len).extend(group)
    return [s for s in shares if s]


def _on_threads(work: Callable[[list[Item]], None], shares: list[list[Item]]) -> None:
    others = [threading.Thread(target=work, args=(s,)) for s in shares[1:]]
    for thread in others:
        thread.start()
    work(shares[0])
    for thread in others:
        thread.join()


def _write(path: str, data: bytes | memoryview, flags: int, *, sync: bool) -> None:
    """A journal (fsynced) or a staged post-image (its owner and mode read back, as m3patch's
    writer does; flushed with the rest by syncfs)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    os.write(fd, data)
    if sync:
        os.fsync(fd)
    else:
        os.fstat(fd)
    os.close(fd)


def apply(pack_file: Path, tree: Path, threads: int) -> None:
    raw = pack_file.read_bytes()
    (size,) = struct.unpack_from("<Q", raw)
    index: list[Item] = [(str(p), int(o), int(n), bool(e)) for p, o, n, e in json.loads(raw[8:8 + size])]
    body = memoryview(raw)[8 + size:]
    libc = ctypes.CDLL(None, use_errno=True)
    root = str(tree)
    journal = f"{root}/vllm/.floor-journal"

    def stage(share: list[Item]) -> None:
        for rel, offset, length, existed in share:
            target = f"{root}/{rel}"
            folder, _, name = target.rpartition("/")
            if existed:
                with open(target, "rb") as handle:
                    hashlib.sha256(handle.read()).hexdigest()
                os.link(target, f"{folder}/.{name}.pre")
            else:
                os.makedirs(folder, exist_ok=True)
            if length >= 0:
                _write(f"{folder}/.{name}.new", body[offset:offset + length], os.O_EXCL, sync=False)

    def swap(share: list[Item]) -> None:
        for rel, _, length, _ in share:
            target = f"{root}/{rel}"
            folder, _, name = target.rpartition("/")
            if length >= 0:
                os.replace(f"{folder}/.{name}.new", target)
            else:
                os.unlink(target)

    def drop(share: list[Item]) -> None:
        for rel, _, _, existed in share:
            folder, _, name = f"{root}/{rel}".rpartition("/")
            if existed:
                os.unlink(f"{folder}/.{name}.pre")

    shares = _by_folder(index, threads)
    names = json.dumps([i[0] for i in index]).encode()
    fd = os.open(root, os.O_RDONLY)
    _write(journal, b"stage " + names, os.O_TRUNC, sync=True)
    _on_threads(stage, shares)
    libc.syncfs(fd)
    _write(journal, b"commit " + names, os.O_TRUNC, sync=True)
    _on_threads(swap, shares)
    libc.syncfs(fd)
    _on_threads(drop, shares)
    os.unlink(journal)
    os.close(fd)


def main(argv: list[str]) -> int:
    if argv[:1] == ["pack"] and len(argv) == 5:
        paths = Path(argv[4]).read_text().split()
        pack(Path(argv[1]), Path(argv[2]), Path(argv[3]), paths)
        return 0
    if argv[:1] == ["apply"] and len(argv) in (3, 5):
        threads = int(argv[4]) if len(argv) == 5 else 2
        apply(Path(argv[1]), Path(argv[2]), threads)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
