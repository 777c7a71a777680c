"""verify's compile check spread over forked children gives exactly the serial verdicts, and
fails closed: a child that dies or reports garbage has its share compiled again by the parent,
so a source that does not compile is never passed."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from m3patch.patching import compile_memo, compile_pool, locate, memo, verify

GOOD = b"def f(x):\n    return [y for y in range(x)]\n" * 10
BROKEN = {  # one error from each stage: parser, symbol table, code generator
    "vllm/parse.py": b"def f(:\n",
    "vllm/symtable.py": b"nonlocal x\n",
    "vllm/codegen.py": b"def f():\n    pass\nbreak\n",
}


def _items() -> list[tuple[str, bytes]]:
    items = [(f"vllm/good_{i}.py", GOOD * (1 + i % 5)) for i in range(40)]
    for n, (path, data) in enumerate(BROKEN.items()):
        items.insert(13 * n + 3, (path, data))
    return items


@pytest.fixture
def forks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Force the forked path whatever this machine's CPU count, the sources' size and the test
    runner's own threads; the pids of the children forked."""
    monkeypatch.setattr(compile_pool, "MIN_BYTES", 0)
    monkeypatch.setattr(compile_pool, "workers", lambda: 3)
    monkeypatch.setattr(compile_pool, "_may_fork", lambda: True)
    pids: list[int] = []
    real_fork = os.fork

    def fork() -> int:
        pid = real_fork()
        if pid:
            pids.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    return pids


def _serial(items: list[tuple[str, bytes]]) -> list[str | None]:
    return [compile_pool.compile_one(path, data) for path, data in items]


def test_forked_verdicts_equal_the_serial_ones(forks: list[int]) -> None:
    items = _items()
    verdicts = compile_pool.compile_all(items)
    assert len(forks) == 2  # the parent compiles the third share
    assert verdicts == _serial(items)
    failed = {path for (path, _), v in zip(items, verdicts, strict=True) if v is not None}
    assert failed == set(BROKEN)


def _dies(items: object, share: object, write_fd: int) -> None:
    os._exit(3)


def _lies(items: object, share: object, write_fd: int) -> None:
    os.write(write_fd, b"[[0, null]]")  # one verdict for a whole share: not believed
    os._exit(0)


def _says_all_good(items: object, share: list[int], write_fd: int) -> None:
    os.write(write_fd, str([[i, None] for i in share]).replace("None", "null").encode())
    os._exit(1)  # but exits non-zero: not believed either


@pytest.mark.parametrize("child", [_dies, _lies, _says_all_good])
def test_a_child_that_fails_has_its_share_compiled_by_the_parent(
        child: Callable[..., None], forks: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_pool, "_child", child)
    items = _items()
    assert compile_pool.compile_all(items) == _serial(items)
    assert len(forks) == 2


def test_shares_balance_by_size_and_cover_every_index() -> None:
    sizes = [100, 1, 1, 50, 50, 3, 0]
    parts = compile_pool.shares(sizes, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
    totals = [sum(sizes[i] for i in p) for p in parts]
    assert totals == sorted(totals, reverse=True)
    assert totals[0] == 100


def test_a_process_with_other_threads_does_not_fork() -> None:
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not compile_pool._may_fork()
    finally:
        release.set()
        other.join()


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many sources each run of another interpreter was sent (locate._compile_run)."""
    sent: list[int] = []
    real_run = locate._compile_run

    def counted(python: str, sources: dict[str, bytes]) -> tuple[str, dict[str, str]]:
        sent.append(len(sources))
        return real_run(python, sources)

    monkeypatch.setattr(locate, "_compile_run", counted)
    return sent


def test_another_interpreter_compiles_in_one_run_per_share_with_the_same_verdicts(
        runs: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """verify --python: the shares run at once, their verdicts merged as one run gives them."""
    items = _items()
    whole_version, whole = locate.compile_with(sys.executable, dict(items))
    assert runs == [len(items)]
    runs.clear()
    monkeypatch.setattr(compile_pool, "MIN_BYTES", 0)
    monkeypatch.setattr(compile_pool, "workers", lambda: 3)
    version, errors = locate.compile_with(sys.executable, dict(items))
    assert len(runs) == 3 and sum(runs) == len(items)
    assert (version, errors) == (whole_version, whole)
    assert set(errors) == set(BROKEN)


def test_another_interpreter_has_a_compile_memo_of_its_own(
        runs: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify --python: what the tree's interpreter compiled is remembered under its own key
    (a writing command), so the next verify sends it only the rest; a read-only run and a key
    that is not a key write nothing."""
    wrapper = tmp_path / "python"  # another path, so verify treats it as another interpreter
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(memo._STATE, "read_only", False)
    sources = dict(_items())
    for _ in range(2):
        who, problems = verify.content_problems(str(wrapper), dict(sources), {})
        assert who.startswith(f"{wrapper} (Python 3.")
        assert {line.split(":")[0] for line in problems} == set(BROKEN)
    assert runs == [len(sources), len(BROKEN)]  # failures are compiled again, for the message
    key = locate.interpreter_of(str(wrapper))[1]
    assert compile_memo.known_good(key) and (tmp_path / "cache" / "compiled" / f"{key}.json").is_file()

    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "read-only-cache"))
    monkeypatch.setitem(memo._STATE, "read_only", True)
    verify.content_problems(str(wrapper), dict(sources), {})
    assert not (tmp_path / "read-only-cache").exists()


@pytest.mark.parametrize("key", ["../../x-0000000a", "cpython-311", "", "A-12345678"])
def test_a_key_that_is_not_an_interpreter_key_is_no_memo(
        key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(memo._STATE, "read_only", False)
    compile_memo.remember(set(), ["0" * 64], key)
    assert compile_memo.known_good(key) == set()
    assert not (tmp_path / "cache").exists()
