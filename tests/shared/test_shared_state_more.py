"""What the widened state fuzz (tests/shared/state_fuzz_more.py) found, each kept as a
regression test: a recipe in a FIFO's or /dev/zero's place, cache folders planted as links, a
tune cache planted as a link or FIFO, and a node record that says it holds no tree."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from core_helpers import REPO, TEST_SERIES

from m3patch.cluster import rendezvous as rv
from m3patch.errors import NodeMismatch, UsageError
from m3patch.main import main
from m3patch.patching.pristine import copy_tree
from m3patch.recipe.topology import NodeId
from m3patch.tune.cache import Result, ResultCache
from m3patch.yamlio import load_yaml_file


def outside(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "victim").write_text("keep\n")
    return folder


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_a_recipe_that_never_ends_is_refused(tmp_path: Path, kind: str) -> None:
    """Before: `recipe validate`, `recipe show` and `serve --dry-run` of a recipe that is a FIFO
    (or a link to one) hung; a link to /dev/zero read until the machine ran out of memory."""
    path = tmp_path / "recipe.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(b"# " + b"x" * (17 << 20) + b"\n")
    with pytest.raises(UsageError, match="cannot read"):
        load_yaml_file(path)
    assert main(["recipe", "validate", str(path)]) == UsageError.exit_code


def test_a_recipe_reached_through_a_link_still_loads(tmp_path: Path) -> None:
    """Users link recipes: a link to a plain file is followed."""
    real = tmp_path / "real.yaml"
    real.write_text("a: 1\n")
    (tmp_path / "link.yaml").symlink_to(real)
    assert load_yaml_file(tmp_path / "link.yaml") == {"a": 1}


@pytest.mark.parametrize("folder", ["parsed", "compiled"])
def test_memo_folders_planted_as_links_are_never_written_through(
        pristine_033: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str) -> None:
    """Before: with `M3PATCH_CACHE/parsed` (or `compiled`) a link to another folder, apply and
    revert wrote their memo files into the link's target."""
    target = outside(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / folder).symlink_to(target)
    monkeypatch.setenv("M3PATCH_CACHE", str(cache))
    root = copy_tree(pristine_033, tmp_path / "site-packages")
    tree = ["--vllm-root", str(root), "--series", str(TEST_SERIES)]
    for command in (["apply", "--verify"], ["revert"], ["apply", "--verify"]):
        assert main([*command, *tree]) == 0, command  # a memo only saves time
    assert sorted(p.name for p in target.iterdir()) == ["victim"]


def test_the_parser_cache_folder_planted_as_a_link_is_never_written_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from m3patch.serving import vllm_parser

    target = outside(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "vllm-cli").symlink_to(target)
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    vllm_parser._store("/usr/bin/python3", "0.33.0", {"vllm_version": "0.33.0", "actions": []})
    assert sorted(p.name for p in target.iterdir()) == ["victim"]


@pytest.mark.parametrize("kind", ["link", "fifo", "dangling"])
def test_a_tune_cache_planted_as_a_link_or_fifo_is_never_appended_to(tmp_path: Path,
                                                                    kind: str) -> None:
    """Before: the tuner appended its results through a link (into the victim, or creating the
    dangling link's target) and a FIFO in the cache's place hung the read."""
    target = outside(tmp_path)
    path = tmp_path / "tune-cache.jsonl"
    if kind == "link":
        path.symlink_to(target / "victim")
    elif kind == "dangling":
        path.symlink_to(target / "absent")
    else:
        os.mkfifo(path)
    cache = ResultCache(path)
    cache.add(Result("s", 1, "c", "quick", 10.0, None, ""))
    assert cache.get("s", 1, "c", "quick") is not None  # kept in memory
    assert sorted(p.name for p in target.iterdir()) == ["victim"]
    assert (target / "victim").read_text() == "keep\n"


def test_a_vllm_node_publishing_no_series_is_not_counted_ready(tmp_path: Path) -> None:
    """Before: a well-formed record of a node that runs vLLM, with `series: null`, skipped the
    tree check (only the P/D proxy holds no tree), so the set counted it ready on any tree."""
    node, proxy = NodeId("worker", 0), NodeId("router", 0)
    base = {"set_id": "set-1", "host": "h", "address": "127.0.0.1", "pid": 1, "pgid": None,
            "series": None, "ledger_sha256": None, "tree_sha256": None, "verified": False,
            "state": "ready"}
    for each in (node, proxy):
        rv.publish(tmp_path, rv.NodeRecord(**{**base, "role": each.role,  # type: ignore[arg-type]
                                              "rank": each.rank}))
    records = rv.read_records(tmp_path, "set-1", (node, proxy))
    assert rv.compare((proxy,), records, "s", "ab" * 32, "fix", treeless=(proxy,)) == []
    with pytest.raises(NodeMismatch, match="published no series"):
        rv.compare((node, proxy), records, "s", "ab" * 32, "fix", treeless=(proxy,))
    assert json.loads(rv.record_path(tmp_path, "set-1", node).read_text())["series"] is None


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_series_launch_spec_that_never_ends_is_refused(tmp_path: Path, kind: str) -> None:
    """Before: the series' pinned `vllm-cli.json` as a FIFO hung `recipe validate` and
    `serve --dry-run` (and a link to /dev/zero read until memory ran out)."""
    from m3patch.patching.series import load_series
    from m3patch.serving.vllm_parser import series_spec

    series = Path(shutil.copytree(REPO / "patches" / "vllm-0.32.0", tmp_path / "s"))
    spec = series / "vllm-cli.json"
    spec.unlink()
    if kind == "fifo":
        os.mkfifo(spec)
    else:
        spec.symlink_to("/dev/zero")
    with pytest.raises(UsageError, match="cannot read the series' launch spec"):
        series_spec(load_series(series))
    assert main(["series", "show", "--series", str(series)]) == 0  # the spec is not needed there


def test_a_name_longer_than_the_file_system_allows_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before (found by the extended fuzz): a recipe whose `series:` or `target.python` is 10,000
    characters, and a RECIPE or --series argument that long, ended in 70 (ENAMETOOLONG from
    is_dir / is_file / exists); now each says which series or recipe it cannot find (2), and a
    python that long is one this machine does not have."""
    long = "x" * 10_000
    # The model on disk whatever this machine has built so far, so `bench` reaches the series.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("M3PATCH_TINY_MODEL", str(model))
    recipe = tmp_path / "recipe.yaml"
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    recipe.write_text("\n".join(f"series: {long}" if line.startswith("series:") else line
                                for line in text.splitlines()) + "\n")
    for argv in (["recipe", "validate", str(recipe)], ["bench", str(recipe), "--no-plots"],
                 ["serve", str(recipe), "--dry-run"], ["recipe", "validate", long],
                 ["status", "--vllm-root", str(tmp_path), "--series", long]):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's type= refusals
            code = int(exc.code or 0)
        assert code == UsageError.exit_code, argv[:2]
        assert "internal error" not in capsys.readouterr().err
    # target.python that long: not on this machine (a recipe for another host validates);
    # an empty cache: the marker lint finds no pristine tree and only asks about the python
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    text = text.replace("series: vllm-", f"series: {REPO}/patches/vllm-")
    recipe.write_text(re.sub(r"python: .*", f"python: {long}", text, count=1))
    assert main(["recipe", "validate", str(recipe)]) == 0
    assert "internal error" not in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["cells", "raw", "logs"])
def test_a_run_folder_part_planted_as_a_link_is_never_written_through(
        tmp_path: Path, sub: str) -> None:
    """Before: the sweep made cells/, raw/ and logs/ with mkdir(exist_ok=True), which takes a
    link to a folder for the folder, and then wrote the run's files into the link's target."""
    from m3patch.bench.sweep import SweepSettings, prepare_run_dir
    from m3patch.errors import UnsafeState

    run, victim = tmp_path / "run", tmp_path / "victim"
    run.mkdir()
    victim.mkdir()
    (run / sub).symlink_to(victim)
    with pytest.raises(UnsafeState):
        prepare_run_dir(SweepSettings(run, resume=True))
    assert list(victim.iterdir()) == []
    (run / sub).unlink()  # the control: a plain run folder is prepared
    prepare_run_dir(SweepSettings(run, resume=True))
    assert all((run / part).is_dir() for part in ("cells", "raw", "logs"))


# ------------------------------------------------- a cache root the user moved with a link


def _stranger_owns(path: Path) -> None:
    """Give `path` (not followed) to a uid that is neither this user nor root."""
    os.lchown(path, 54321, 54321)


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's link or folder needs root")
def test_a_cache_root_moved_with_the_users_own_link_keeps_the_memos(
        pristine_033: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `M3PATCH_CACHE` (or ~/.cache/m3patch) a link to another disk turned every memo off
    without a word (each write refused the link) while the agentic trace cache refused it with
    40. Now a link this user owns leads to the real folder, which is written below; a link or
    folder another user owns is still refused."""
    from m3patch.bench.agentic import synthesize
    from m3patch.errors import AgenticTraceError

    disk = tmp_path / "other-disk" / "m3patch"
    disk.mkdir(parents=True)
    link = tmp_path / "cache-link"
    link.symlink_to(disk)
    monkeypatch.setenv("M3PATCH_CACHE", str(link))
    root = copy_tree(pristine_033, tmp_path / "site-packages")
    assert main(["apply", "--verify", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
    assert {p.name for p in disk.iterdir()} >= {"parsed", "compiled", "images"}
    assert all(not p.is_symlink() for p in disk.iterdir())
    assert synthesize._cache_folder() == disk.resolve() / synthesize.CACHE_DIR

    stranger = tmp_path / "strangers-link"
    stranger.symlink_to(disk)
    _stranger_owns(stranger)
    monkeypatch.setenv("M3PATCH_CACHE", str(stranger))
    with pytest.raises(AgenticTraceError, match=r"link .* owned by uid 54321"):
        synthesize._cache_folder()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    _stranger_owns(foreign)
    (tmp_path / "link-to-foreign").symlink_to(foreign)
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "link-to-foreign"))
    with pytest.raises(AgenticTraceError, match="owned by uid 54321"):
        synthesize._cache_folder()
    revert = ["revert", "--vllm-root", str(root), "--series", str(TEST_SERIES)]
    assert main(revert) == 0
    assert main(["apply", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
    assert list(foreign.iterdir()) == []  # a memo is only time: nothing written there


def test_a_cache_link_that_leads_nowhere_makes_no_folder_there(
        pristine_033: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `~/.cache/m3patch` a link to a folder that does not exist (a stale link to an
    unmounted disk, `/nonexistent`) was followed and its target made: `markers lint` put 393 MB
    in a new /nonexistent. Now the way to a missing target is not the path the user named:
    nothing is made there; the memos are off with one warning (apply exits 0 at cold speed)
    and a command that must write there (the agentic trace cache) stops naming the link. The
    path's own missing folders (a fresh HOME's .cache) are still made."""
    from m3patch.bench.agentic import synthesize
    from m3patch.errors import AgenticTraceError

    target = tmp_path / "unmounted" / "m3patch"
    link = tmp_path / "cache-link"
    link.symlink_to(target)
    monkeypatch.setenv("M3PATCH_CACHE", str(link))
    root = copy_tree(pristine_033, tmp_path / "site-packages")
    assert main(["apply", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
    with pytest.raises(AgenticTraceError, match=r"leads to .*unmounted.*which does not exist"):
        synthesize._cache_folder()
    assert not (tmp_path / "unmounted").exists()
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "fresh-home" / ".cache" / "m3patch"))
    assert main(["revert", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
    assert main(["apply", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
    assert (tmp_path / "fresh-home" / ".cache" / "m3patch" / "parsed").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's folder needs root")
def test_a_tune_cache_folder_another_user_owns_is_never_appended_to(tmp_path: Path) -> None:
    """Before: a `--cache` file in a folder another user owns (who could swap its entries for
    links between two appends) was appended to; only the file itself was checked (O_NOFOLLOW).
    The user's own link to their folder is followed."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    _stranger_owns(foreign)
    cache = ResultCache(foreign / "tune.jsonl")
    cache.add(Result("s", 1, "c", "quick", 10.0, None, ""))
    assert cache.get("s", 1, "c", "quick") is not None  # kept in memory
    assert list(foreign.iterdir()) == []
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "my-link").symlink_to(mine)
    cache = ResultCache(tmp_path / "my-link" / "tune.jsonl")
    cache.add(Result("s", 1, "c", "quick", 10.0, None, ""))
    assert len((mine / "tune.jsonl").read_text().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's link or folder needs root")
def test_a_cache_reached_through_anything_another_user_controls_is_never_written(
        pristine_033: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: only the first link was checked, then the whole chain followed, so the user's link
    to another user's link wrote every memo where that user pointed; and a cache folder inside a
    folder another user can write (who can rename it and plant a link between the check and the
    write) was used. Now every link and folder on the way from / is checked: such a cache is
    not written (a memo is only time), and apply still applies."""
    victim = tmp_path / "victim"
    victim.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "link").symlink_to(victim)
    _stranger_owns(theirs / "link")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "their-link").symlink_to(victim)  # their link in my folder: still theirs
    _stranger_owns(mine / "their-link")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may rename what lies in it
    caches = [(tmp_path / "via-their-folder", theirs / "link"),
              (tmp_path / "via-their-link", mine / "their-link"),
              (tmp_path / "in-shared", shared / "cache")]
    for name, target in caches:
        if name.name != "in-shared":
            name.symlink_to(target)
        monkeypatch.setenv("M3PATCH_CACHE", str(name if name.name != "in-shared" else target))
        root = copy_tree(pristine_033, tmp_path / f"tree-{name.name}")
        assert main(["apply", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
        assert main(["verify", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
    assert list(victim.iterdir()) == []
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's folder needs root")
def test_a_tune_cache_below_another_users_folder_makes_no_folder_there(tmp_path: Path) -> None:
    """Before: the missing folders of `--cache` were made first (`mkdir(parents=True)`), inside
    another user's folder too, and only then was the last one checked."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    _stranger_owns(foreign)
    cache = ResultCache(foreign / "sub" / "tune.jsonl")
    cache.add(Result("s", 1, "c", "quick", 10.0, None, ""))
    assert cache.get("s", 1, "c", "quick") is not None
    assert list(foreign.iterdir()) == []


def _acl_giving_write_to(uid: int) -> bytes:
    """A POSIX access ACL (the kernel's xattr form) that adds write for one named user."""
    every = 0xFFFFFFFF
    entries = [(0x01, 7, every), (0x02, 7, uid), (0x04, 5, every), (0x10, 7, every),
               (0x20, 5, every)]
    return (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + who.to_bytes(4, "little")
        for tag, perm, who in entries)


def test_a_folder_an_acl_opens_to_another_user_is_not_on_a_trusted_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a folder whose mode read 0775 with this user's own group passed, though its ACL
    gave write to another uid (the ACL's mask shows as the group bits), who could then rename
    the cache away and plant a link. Now a named ACL entry with write for another user (or a
    group this user is not in) refuses the way; the cache is then not used at all, with one
    warning, and nothing is written below that folder."""
    from m3patch.errors import UnsafeState
    from m3patch.fsio import trusted_dir
    from m3patch.patching import pristine

    shared = tmp_path / "acl-shared"
    shared.mkdir()
    try:
        os.setxattr(shared, "system.posix_acl_access", _acl_giving_write_to(54321))
    except OSError as exc:
        pytest.skip(f"this file system keeps no POSIX ACLs ({exc.strerror})")
    with pytest.raises(UnsafeState, match="gives write to uid 54321 by an ACL"):
        trusted_dir(shared / "cache", create=True)
    monkeypatch.setenv("M3PATCH_CACHE", str(shared / "cache"))
    assert pristine.cache_root() == pristine.REFUSED_CACHE
    assert pristine.cache_root() == pristine.REFUSED_CACHE
    assert capsys.readouterr().err.count("the cache is not used") == 1
    assert pristine.cached_file("0.33.0", "vllm/envs.py") is None
    with pytest.raises(UnsafeState, match="by an ACL"):
        pristine.pristine_tree("0.33.0")
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's link needs root")
def test_a_pristine_tree_behind_another_users_link_is_never_read(
        pristine_033: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: only memo writes checked the way; pristine trees (which `series lock` and the
    marker lint trust) and every memo read went through `M3PATCH_CACHE` as named, so a cache
    reached through another user's link served their planted `envs.py`."""
    from m3patch.errors import UnsafeState
    from m3patch.patching import pristine

    planted = tmp_path / "planted"
    tree = planted / "tree-vllm-0.33.0"
    shutil.copytree(pristine_033, tree, symlinks=True)
    (tree / "vllm" / "envs.py").write_text("planted\n")
    theirs = tmp_path / "their-link"
    theirs.symlink_to(planted)
    _stranger_owns(theirs)
    (tmp_path / "my-link").symlink_to(theirs)
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "my-link"))
    assert pristine.cached_file("0.33.0", "vllm/envs.py") is None
    with pytest.raises(UnsafeState, match="owned by uid 54321"):
        pristine.pristine_tree("0.33.0")


def test_a_cache_whose_way_cannot_be_looked_up_costs_time_not_the_command(
        pristine_033: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a cache path the file system refuses to look up (a name over NAME_MAX here; a
    folder this user may not search, as `sudo -u` without -H leaves HOME) ended `apply` in 70
    (`is_file` raised). Now the cache is not used, with one warning, and apply applies; a
    relative cache from a working folder that was removed is refused by name, not a
    traceback."""
    from m3patch.errors import UnsafeState
    from m3patch.fsio import resolve_way

    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / ("c" * 300)))
    root = copy_tree(pristine_033, tmp_path / "site-packages")
    assert main(["apply", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
    assert main(["verify", "--vllm-root", str(root), "--series", str(TEST_SERIES)]) == 0
    err = capsys.readouterr().err
    assert "the cache is not used" in err
    assert "internal error" not in err
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(UnsafeState, match="cannot tell where it is"):
        resolve_way(Path("relative-cache"))
    assert resolve_way(tmp_path)[0] == tmp_path.resolve()


ROOTLESS_CHECK = """
import sys
from pathlib import Path
from m3patch.fsio import trusted_dir
print(trusted_dir(Path(sys.argv[1]), create=True))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_a_rootless_user_namespace_keeps_its_cache(tmp_path: Path) -> None:
    """Before: in a user namespace that does not map root (rootless containers, Apptainer,
    `unshare -U`), / and /tmp show as the overflow uid, so every cache way was refused. Now the
    overflow uid counts as root there. A real namespace: uid 1000 unshares its own."""
    import subprocess
    import tempfile

    if not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("util-linux's unshare/setpriv are not installed")
    code = Path(tempfile.mkdtemp(prefix="m3patch-rootless-"))  # readable by uid 1000
    try:
        code.chmod(0o755)
        shutil.copytree(REPO / "m3patch", code / "m3patch",
                        ignore=shutil.ignore_patterns("__pycache__"))
        home = code / "home"
        home.mkdir()
        os.chown(home, 1000, 1000)
        cmd = ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "unshare",
               "-U", "--map-current-user", "/usr/bin/python3", "-c", ROOTLESS_CHECK,
               str(home / "cache" / "m3patch")]
        proc = subprocess.run(cmd, env={"PYTHONPATH": str(code), "PATH": os.environ["PATH"]},
                              capture_output=True, text=True, check=False, timeout=60)
        if "Operation not permitted" in proc.stderr and "unshare" in proc.stderr:
            pytest.skip(f"unprivileged user namespaces are off here: {proc.stderr.strip()}")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(home / "cache" / "m3patch")
        assert (home / "cache" / "m3patch").is_dir()
    finally:
        shutil.rmtree(code)
