"""The image memo (post-images by the lock's pins) and the parse memo's hunks made on first use:
a warm apply gives the same tree as a cold one, takes no hunk from a pack that lies, and never
trusts a pack of another lock or of the wrong shape."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from core_helpers import REPO, replace_file

from m3patch.patching import engine, image_memo, memo, parse_cache
from m3patch.patching.api import apply_series, revert_series
from m3patch.patching.diffs import parse_patch
from m3patch.patching.ledger import digest
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import copy_tree
from m3patch.patching.series import load_series


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "cache"
    monkeypatch.setenv("M3PATCH_CACHE", str(folder))
    memo.start_command(read_only=False)  # as the CLI does per command: not what ran before
    yield folder


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "vllm").rglob("*"))
            if p.is_file() and ".m3patch" not in p.parts}


def _count_post_images(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths whose post-image this process computes from the hunks."""
    computed: list[str] = []
    real = engine.post_image

    def counting(chain: engine.Chain, stage: int, data: bytes | None) -> engine.FilePlan:
        computed.append(chain.path)
        return real(chain, stage, data)

    monkeypatch.setattr(engine, "post_image", counting)
    return computed


def _apply(pristine: Path, dest: Path, series_dir: Path) -> Path:
    root = copy_tree(pristine, dest)
    apply_series(tree_at(root), load_series(series_dir))
    return root


def _rewrite_entries(cache: Path, *, head: Callable[[dict[str, Any]], None] | None = None,
                     body: Callable[[list[Any]], None] | None = None) -> None:
    """Every parse-memo entry edited in place: its header line, then its hunks."""
    for entry in (cache / "parsed").glob("*.json"):
        first, rest = entry.read_bytes().split(b"\n", 1)
        parts: list[Any] = [json.loads(first), json.loads(rest)]
        for edit, part in ((head, parts[0]), (body, parts[1])):
            if edit is not None:
                edit(part)
        entry.write_bytes(b"".join(json.dumps(part).encode() + b"\n" for part in parts))


def _shipped_patches() -> list[Path]:
    patches = sorted((REPO / "patches").glob("*/*.patch"))
    assert patches
    return patches


def _pack(series_dir: Path) -> Path:
    return image_memo._path(image_memo.pack_key(load_series(series_dir).require_lock()))


def test_a_warm_apply_takes_every_post_image_from_the_pack_and_writes_the_same_tree(
        pristine_033: Path, test_series: Path, tmp_path: Path, cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    computed = _count_post_images(monkeypatch)
    cold = _apply(pristine_033, tmp_path / "cold", test_series)
    assert computed and _pack(test_series).is_file()
    computed.clear()
    warm = _apply(pristine_033, tmp_path / "warm", test_series)
    assert computed == []  # every image came from the pack
    assert _files(warm) == _files(cold)


@pytest.mark.parametrize("lie", ["flipped byte", "swapped hashes"])
def test_an_image_that_does_not_hash_to_its_pin_is_computed_from_the_hunks(
        lie: str, pristine_033: Path, test_series: Path, tmp_path: Path, cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    computed = _count_post_images(monkeypatch)
    cold = _apply(pristine_033, tmp_path / "cold", test_series)
    pack = _pack(test_series)
    magic, header_line, rest = pack.read_bytes().split(b"\n", 2)
    header = json.loads(header_line)
    if lie == "flipped byte":  # the first image changed, its length and every other kept
        rest = bytes([rest[0] ^ 0x20]) + rest[1:]
        liars = 1
    else:
        assert len(header["images"]) > 1
        first, second = header["images"][:2]
        first[0], second[0] = second[0], first[0]
        liars = 2
    pack.write_bytes(magic + b"\n" + json.dumps(header).encode() + b"\n" + rest)
    computed.clear()
    warm = _apply(pristine_033, tmp_path / "warm", test_series)
    assert len(computed) == liars
    assert _files(warm) == _files(cold)


def test_a_pack_of_another_lock_or_of_the_wrong_shape_is_no_pack(
        pristine_033: Path, test_series: Path, tmp_path: Path, cache: Path) -> None:
    _apply(pristine_033, tmp_path / "cold", test_series)
    lock = load_series(test_series).require_lock()
    pack = _pack(test_series)
    good = pack.read_bytes()
    assert image_memo.load(lock) is not None
    magic, header_line, rest = good.split(b"\n", 2)
    header = json.loads(header_line)

    def with_header(changed: object) -> bytes:
        return magic + b"\n" + json.dumps(changed).encode() + b"\n" + rest

    first = header["images"][0]
    bad = {
        "another lock": with_header({**header, "key": "0" * 64}),
        "torn": good[:-1],
        "trailing bytes": good + b"x",
        "no magic": good[len(magic) + 1:],
        "no header end": magic + b"\n" + header_line,
        "header not JSON": magic + b"\n{" + b"\n" + rest,
        "header a list": with_header([header]),
        "negative length": with_header({**header, "images": [[first[0], -1]]}),
        "length true": with_header({**header, "images": [[first[0], True]]}),
        "not a sha256": with_header({**header, "images": [["x" * 64, first[1]]]}),
        "entry of three": with_header({**header, "images": [[*first, 0]]}),
    }
    for label, data in bad.items():
        pack.unlink()
        pack.write_bytes(data)
        assert image_memo.load(lock) is None, label
    pack.unlink()
    pack.symlink_to(tmp_path / "elsewhere.bin")
    (tmp_path / "elsewhere.bin").write_bytes(good)
    assert image_memo.load(lock) is None  # never read through a link
    pack.unlink()
    os.mkfifo(pack)
    assert image_memo.load(lock) is None  # a FIFO is refused, not waited on


def test_a_planted_link_for_the_images_folder_is_not_written_through(
        pristine_033: Path, test_series: Path, tmp_path: Path, cache: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    cache.mkdir()
    (cache / "images").symlink_to(outside)
    _apply(pristine_033, tmp_path / "cold", test_series)
    assert list(outside.iterdir()) == []


def test_hunks_from_the_parse_memo_equal_a_fresh_parse_of_every_shipped_patch(
        cache: Path) -> None:
    for path in _shipped_patches():
        data = path.read_bytes()
        fresh = parse_patch(data, str(path))
        parse_cache.parsed(data, str(path), digest(data))  # writes the memo
        stored = parse_cache.parsed(data, str(path), digest(data))
        for a, b in zip(stored.files, fresh.files, strict=True):
            assert isinstance(a.hunks, parse_cache.StoredHunks)
            assert len(a.hunks) == len(b.hunks)
            assert a == b and b == a
            assert list(a.hunks) == list(b.hunks) and a.hunks[0] == b.hunks[0]
            assert hash(a.hunks) == hash(tuple(b.hunks))


def _add_a_hunk(files: list[Any]) -> None:
    files[0].append(files[0][0])


def _drop_the_hunks(files: list[Any]) -> None:
    files[0].clear()


def _cut_a_side(files: list[Any]) -> None:
    files[0][0][4] = files[0][0][4][:-1]  # text of its own, checked only against the pins


@pytest.mark.parametrize("forge", [_add_a_hunk, _drop_the_hunks, list.clear, list.pop])
def test_parse_memo_hunks_that_are_not_what_the_header_counts_are_parsed_again(
        forge: Callable[[list[Any]], None], cache: Path) -> None:
    """The header line is read with every run, the hunks only when used: hunks that a torn or
    forged entry holds (a file with more or fewer hunks, or files missing) are not taken; the
    patch's own bytes are parsed again when they are first used."""
    for path in _shipped_patches():
        data = path.read_bytes()
        parse_cache.parsed(data, str(path), digest(data))
    _rewrite_entries(cache, body=forge)
    for path in _shipped_patches():
        data = path.read_bytes()
        assert parse_cache.parsed(data, str(path), digest(data)) == parse_patch(data, str(path))


def test_parse_memo_hunks_whose_text_is_forged_are_parsed_again_not_blamed_on_the_tree(
        cache: Path, pristine_033: Path, tmp_path: Path) -> None:
    """Hunks that keep the header's counts and shape but not a parse's text give results off
    the lock's pins. Before (a second hostile review): a revert after a warm apply, or an apply
    without the image pack, ended in 5 blaming the tree ("undoing ... gives sha256 ..."), while
    status said every patch was applied. Now a run whose stored hunks miss a pin runs once more
    on a fresh parse of the pinned bytes (which rewrites the memo): the trees of a cold run."""
    series_dir = REPO / "patches" / "vllm-0.33.0"
    cold = _files(_apply(pristine_033, tmp_path / "cold", series_dir))
    warm = copy_tree(pristine_033, tmp_path / "warm")
    apply_series(tree_at(warm), load_series(series_dir))  # the image pack: no hunk read
    _rewrite_entries(cache, body=_cut_a_side)
    revert_series(tree_at(warm), load_series(series_dir))
    assert _files(warm) == _files(pristine_033)
    _rewrite_entries(cache, body=_cut_a_side)
    _pack(series_dir).unlink()
    root = copy_tree(pristine_033, tmp_path / "no-pack")
    apply_series(tree_at(root), load_series(series_dir))
    assert _files(root) == cold
    for entry in load_series(series_dir).patches:  # the entries were written again, right
        data = (series_dir / entry.file).read_bytes()
        assert parse_cache.parsed(data, "p", digest(data)) == parse_patch(data, "p")


def test_a_true_conflict_is_still_refused_after_the_fresh_parse(
        cache: Path, pristine_033: Path, tmp_path: Path) -> None:
    """The retry on a fresh parse is no way around a conflict the tree really has."""
    from m3patch.errors import PatchConflict

    series_dir = REPO / "patches" / "vllm-0.33.0"
    _apply(pristine_033, tmp_path / "cold", series_dir)
    root = copy_tree(pristine_033, tmp_path / "edited")
    lock = load_series(series_dir).require_lock()
    target = root / next(f.path for p in lock.patches for f in p.files if f.pre is not None)
    replace_file(target, target.read_bytes() + b"# a hand edit\n")  # never through the link
    with pytest.raises(PatchConflict):
        apply_series(tree_at(root), load_series(series_dir))


def test_a_parse_memo_header_with_a_mode_no_parse_gives_is_parsed_again(
        cache: Path, pristine_033: Path, tmp_path: Path) -> None:
    """Before (a second hostile review): a header giving an added file mode 0o4777 (setuid,
    world-writable) was taken; apply wrote the file -rwsrwxrwx and status and verify passed.
    The parser refuses every mode but git's 644 and 755; so does the memo's reader now."""
    series_dir = REPO / "patches" / "vllm-0.33.0"
    cold_root = _apply(pristine_033, tmp_path / "cold", series_dir)

    def forge(head: dict[str, Any]) -> None:
        for file in head["files"]:
            if file[1] == "add":
                file[2] = 0o4777

    _rewrite_entries(cache, head=forge)
    lock = load_series(series_dir).require_lock()
    added = [f.path for p in lock.patches for f in p.files if f.pre is None]
    assert added
    for keep_pack in (True, False):
        if not keep_pack:
            _pack(series_dir).unlink()
        root = copy_tree(pristine_033, tmp_path / f"warm-{keep_pack}")
        apply_series(tree_at(root), load_series(series_dir))
        for rel in added:
            assert (root / rel).stat().st_mode == (cold_root / rel).stat().st_mode, rel


def test_a_parse_memo_with_text_that_is_no_bytes_is_parsed_again(
        cache: Path, pristine_033: Path, tmp_path: Path) -> None:
    """Before: a memo entry whose hunk text held a lone surrogate outside surrogateescape's range
    (a forged memo: no parse stores one) was accepted, and the first use of its hunks ended in
    exit 70 (UnicodeEncodeError), a revert after a warm apply that never read the hunks. Now the
    entry's hunks are refused when first used, the patch is parsed again, and apply and revert
    give the trees of a cold run."""
    series_dir = REPO / "patches" / "vllm-0.33.0"
    cold = _files(_apply(pristine_033, tmp_path / "cold", series_dir))

    def forge(files: list[Any]) -> None:
        for file in files:
            for hunk in file:
                hunk[4] += "\ud800\n"

    _rewrite_entries(cache, body=forge)
    image_memo._path(image_memo.pack_key(load_series(series_dir).require_lock())).unlink()
    series = load_series(series_dir)
    for entry in series.patches:
        data = (series_dir / entry.file).read_bytes()
        assert parse_cache.parsed(data, "p", digest(data)) == parse_patch(data, "p")
    root = copy_tree(pristine_033, tmp_path / "warm")
    apply_series(tree_at(root), series)
    assert _files(root) == cold
    revert_series(tree_at(root), series)
    assert _files(root) == _files(pristine_033)


@pytest.mark.parametrize("lie", ["path", "kind"])
def test_a_parse_memo_that_names_other_files_is_parsed_again(
        lie: str, cache: Path, pristine_033: Path, tmp_path: Path) -> None:
    """Before (found by the extended state fuzz): a memo entry naming another pinned file (or
    calling a changed file new) was taken as the patch, and verify of a tree with a file off its
    pin ended in exit 70 (KeyError): the files it classified were not the lock's. Now an entry
    whose files differ from what the lock pins for that patch is parsed again from the bytes."""
    from m3patch.patching.api import verify_tree

    series_dir = REPO / "patches" / "vllm-0.33.0"
    cold = _files(_apply(pristine_033, tmp_path / "cold", series_dir))
    series = load_series(series_dir)
    pinned = sorted({f.path for p in series.require_lock().patches for f in p.files})

    def forge(head: dict[str, Any]) -> None:
        first = head["files"][0]
        if lie == "path":
            first[0] = next(p for p in pinned if p not in {f[0] for f in head["files"]})
        else:
            first[1] = "add" if first[1] != "add" else "modify"

    _rewrite_entries(cache, head=forge)
    _pack(series_dir).unlink()
    root = copy_tree(pristine_033, tmp_path / "warm")
    apply_series(tree_at(root), series)
    assert _files(root) == cold
    changed = root / sorted(cold.keys() - _files(pristine_033).keys() or cold.keys())[0]
    changed.write_bytes(changed.read_bytes() + b"\n# edited\n")
    report = verify_tree(tree_at(root), series)
    assert not report.ok and any(str(changed.relative_to(root)) in p for p in report.problems)
