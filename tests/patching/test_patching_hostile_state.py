"""State that an earlier run, another user or a forged file leaves behind in the real 0.33.0 tree:
never trusted, never a false all-clear, never a write or a delete outside what m3patch owns.
Each test reproduces one finding through the CLI entry (in-process) on a private copy of the
real tree; the docstring says what happened before the fix."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from core_helpers import (
    CliRunner,
    append_diff,
    make_series,
    new_file_diff,
    revert_before_first_verify,
)

from m3patch import errors
from m3patch.main import main

ENVS = "vllm/envs.py"


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def series_of(folder: Path, *patches: str) -> Path:
    """An unlocked series of these diffs (each test locks it, or expects the lock to refuse)."""
    return make_series(folder, None, list(patches))


def state(root: Path) -> Path:
    return root / "vllm" / ".m3patch"


# ------------------------------------------------------------- a series path that is a staging name


def test_a_series_adding_the_writers_staging_name_is_refused(vllm_tree: Path, pristine_033: Path,
                                                            tmp_path: Path) -> None:
    """Before: lock and apply exited 0; envs.py became the added file's bytes, the added file was
    gone, and revert refused (5)."""
    envs = (vllm_tree / ENVS).read_bytes()
    edit = (f"diff --git a/{ENVS} b/{ENVS}\n--- a/{ENVS}\n+++ b/{ENVS}\n@@ -1,1 +1,2 @@\n"
            f" {envs.decode().splitlines()[0]}\n+# edited\n")
    series = series_of(tmp_path / "s", new_file_diff("vllm/.envs.py.m3patch-new", ["boom"]), edit)
    code, _, err = cli("series", "lock", "--series", str(series), "--tree", str(pristine_033))
    assert code == errors.HostilePatch.exit_code, err
    assert "staging" in err
    assert (vllm_tree / ENVS).read_bytes() == envs


@pytest.mark.parametrize("name", ["vllm/.envs.py.m3patch-pre", "vllm/x/.y.m3patch-new"])
def test_every_writer_name_is_refused_as_a_patch_path(name: str) -> None:
    from m3patch.patching.diffs import check_rel_path

    with pytest.raises(errors.HostilePatch):
        check_rel_path(name, "p.patch")


def test_the_path_check_remembers_only_what_it_accepted() -> None:
    """Accepted paths are answered from memory (each is asked four times per apply); a refused
    one is refused every time it is asked, and a path's normal form never stands in for it."""
    from m3patch.patching.diffs import check_rel_path

    for _ in range(2):
        assert check_rel_path("vllm/./a//b.py", "p.patch") == "vllm/a/b.py"
        with pytest.raises(errors.HostilePatch, match="climbs out"):
            check_rel_path("vllm/a/../../etc/passwd", "p.patch")
        with pytest.raises(errors.HostilePatch, match="not under vllm/"):
            check_rel_path("vllm", "p.patch")


# ------------------------------------------------------------- a forged offset ledger


def forged_offset_ledger(root: Path, series: Path) -> None:
    """The ledger an attacker (or a stale copy) leaves: mode offset, every file's post-image its
    current, pristine hash, so the ledger claims an applied tree that is not."""
    lock = json.loads((series / "series.lock.json").read_text())
    files = {}
    for patch in lock["patches"]:
        for pin in patch["files"]:
            path = root / pin["path"]
            current = sha(path.read_bytes()) if path.exists() else None
            files.setdefault(pin["path"], {"path": pin["path"], "pre": current, "post": current})
    ledger = {"schema": 1, "tool": "m3patch 0.1.0", "series": lock["series"], "mode": "offset",
              "vllm_version": "0.33.0", "vllm_commit": None, "version_note": "0.33.0 accepted",
              "patches": [p["id"] for p in lock["patches"]], "files": list(files.values()),
              "time": "2026-01-01T00:00:00Z"}
    state(root).mkdir(exist_ok=True)
    (state(root) / "ledger.json").write_text(json.dumps(ledger))


def test_a_forged_offset_ledger_gives_no_false_all_clear(vllm_tree: Path, test_series: Path) -> None:
    """Before: `apply --verify` printed "already applied ... verified" and `verify` exited 0 on an
    unpatched tree whose forged offset ledger recorded the pristine hashes as post-images."""
    forged_offset_ledger(vllm_tree, test_series)
    root = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    code, _, err = cli("verify", *root)
    assert code == errors.VerifyFailed.exit_code, err
    code, out, err = cli("apply", "--verify", *root)
    assert code == 0, err
    assert "3 applied" in out + err, out + err
    assert cli("verify", *root)[0] == 0
    assert cli("status", *root)[0] == 0


# ------------------------------------------------------------- a well-formed, lying journal


def write_journal(root: Path, body: dict[str, object]) -> None:
    state(root).mkdir(exist_ok=True)
    (state(root) / "journal.json").write_text(json.dumps(body))


def test_a_lying_stage_journal_never_deletes_a_file_it_did_not_write(vllm_tree: Path,
                                                                   test_series: Path) -> None:
    """Before: the next apply "rolled back" a new-file entry for vllm/envs.py by deleting it, then
    exited 0 with status all clear and vLLM broken."""
    envs = (vllm_tree / ENVS).read_bytes()
    write_journal(vllm_tree, {"phase": "stage", "ledger": None, "entries": [
        {"path": ENVS, "pre": None, "post": "0" * 64, "stage": ".envs.py.m3patch-new",
         "backup": None}]})
    code, _, err = cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert code == 0, err
    assert (vllm_tree / ENVS).read_bytes() == envs


def test_a_lying_commit_journal_never_deletes_a_file_without_the_writers_backup(
        vllm_tree: Path, test_series: Path) -> None:
    """Before: a commit-phase deletion entry for vllm/envs.py (its real pre-image hash, no backup
    ever made) counted as completable, and recovery deleted envs.py."""
    envs = (vllm_tree / ENVS).read_bytes()
    write_journal(vllm_tree, {"phase": "commit", "ledger": None, "entries": [
        {"path": ENVS, "pre": sha(envs), "post": None, "stage": None,
         "backup": ".envs.py.m3patch-pre"}]})
    code, _, err = cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert code == 0, err
    assert (vllm_tree / ENVS).read_bytes() == envs


def test_a_journal_with_a_forged_ledger_is_refused(vllm_tree: Path, test_series: Path) -> None:
    """A commit journal carries the ledger it records on completion: a ledger that does not
    parse is refused (7) before anything is recorded."""
    write_journal(vllm_tree, {"phase": "commit", "entries": [], "ledger": '{"schema": 1}'})
    code, _, err = cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert code == errors.TreeIOError.exit_code, err
    assert not (state(vllm_tree) / "ledger.json").exists()


# ------------------------------------------------------------- symlinks in the state folder


def test_a_symlinked_state_folder_is_refused_and_nothing_outside_is_touched(
        vllm_tree: Path, test_series: Path, tmp_path: Path) -> None:
    """Before: apply wrote the ledger and lock into the link's target, and recovery deleted a
    planted `.bashrc.tmp42` there."""
    outside = tmp_path / "home"
    outside.mkdir()
    (outside / ".bashrc.tmp42").write_text("keep me")
    os.symlink(outside, state(vllm_tree))
    code, _, err = cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert code == errors.HostilePatch.exit_code, err
    assert sorted(p.name for p in outside.iterdir()) == [".bashrc.tmp42"]


def test_a_dangling_lock_link_is_refused_and_its_target_not_created(
        vllm_tree: Path, test_series: Path, tmp_path: Path) -> None:
    """Before: apply created the dangling link's target."""
    state(vllm_tree).mkdir()
    target = tmp_path / "created-through-the-link"
    os.symlink(target, state(vllm_tree) / "lock")
    code, _, err = cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert code == errors.HostilePatch.exit_code, err
    assert not target.exists()


def test_a_symlinked_vllm_folder_gets_no_lock_through_it(vllm_tree: Path, test_series: Path,
                                                         tmp_path: Path) -> None:
    """Before: the symlinked vllm/ was refused (9), but .m3patch/lock was created through it."""
    box = tmp_path / "box"
    box.mkdir()
    os.symlink(vllm_tree / "vllm", box / "vllm")
    code, _, err = cli("apply", "--vllm-root", str(box), "--series", str(test_series))
    assert code == errors.HostilePatch.exit_code, err
    assert not state(vllm_tree).exists()


def test_a_state_file_link_to_dev_zero_or_a_fifo_is_refused(vllm_tree: Path,
                                                           test_series: Path) -> None:
    """A ledger that is a link to /dev/zero (never ends) or a FIFO (blocks) is a state file
    m3patch cannot read: 7, at once."""
    state(vllm_tree).mkdir()
    os.symlink("/dev/zero", state(vllm_tree) / "ledger.json")
    root = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert cli("status", *root)[0] == 0  # the files decide; the ledger is only noted
    (state(vllm_tree) / "ledger.json").unlink()
    os.mkfifo(state(vllm_tree) / "journal.json")
    code, _, err = cli("apply", *root)
    assert code == errors.TreeIOError.exit_code, err


@pytest.mark.parametrize("kind", ["fifo", "char device", "sparse 8 GB", "socket"])
def test_a_fifo_device_or_huge_file_at_a_pinned_path_is_refused_at_once(
        kind: str, vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    """A FIFO where the series pins vllm/logger.py hung status, verify and apply (apply while
    holding the tree lock); a character device gave 70 or ran out of memory. Only a regular
    file within a source's size is read: 5 naming the file, nothing written."""
    target = vllm_tree / "vllm" / "logger.py"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "char device":
        if os.geteuid() != 0:
            pytest.skip("mknod of a character device needs root")
        os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(target))
    else:
        with open(target, "wb") as sparse:
            sparse.truncate(8 << 30)
    root = ("--vllm-root", str(vllm_tree), "--series", str(test_series))
    for command in ("status", "verify", "apply"):
        proc = m3patch_cli(command, *root, timeout=60)
        assert proc.returncode == errors.PatchConflict.exit_code, (command, proc.stderr)
        assert "vllm/logger.py" in proc.stderr and "Traceback" not in proc.stderr
        assert "pip install --force-reinstall" in proc.stderr
    assert not (state(vllm_tree) / "ledger.json").exists()


# ------------------------------------------------------------- file modes


@pytest.mark.parametrize("mode", ["104755", "100777", "102644", "100999"])
def test_a_new_file_mode_other_than_644_or_755_is_refused(mode: str, pristine_033: Path,
                                                         tmp_path: Path) -> None:
    """Before: 104755 and 100777 created setuid and world-writable files (lock and apply 0);
    100999 ended in 70."""
    series = series_of(tmp_path / "s", new_file_diff("vllm/m3_mode.py", ["x = 1"], mode))
    code, _, err = cli("series", "lock", "--series", str(series), "--tree", str(pristine_033))
    assert code == errors.HostilePatch.exit_code, err
    assert mode in err


def test_a_file_diff_with_dev_null_on_both_sides_is_a_usage_error(pristine_033: Path,
                                                                  tmp_path: Path) -> None:
    """Before: exit 70 (IndexError)."""
    diff = "--- /dev/null\n+++ /dev/null\n@@ -0,0 +1 @@\n+x\n"
    series = series_of(tmp_path / "s", diff)
    code, _, err = cli("series", "lock", "--series", str(series), "--tree", str(pristine_033))
    assert code == errors.UsageError.exit_code, err


# ------------------------------------------------------------- apply --verify racing a revert


def test_apply_verify_racing_a_revert_retries_under_the_lock(
        vllm_tree: Path, test_series: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a revert that ran between apply's unlocked fast path and its verify made
    `apply --verify` (serve, bench and ci's path) fail with 6 or 7."""
    from m3patch.patching import api
    from m3patch.patching.locate import find_vllm
    from m3patch.patching.series import load_series

    root = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert cli("apply", *root)[0] == 0
    calls = revert_before_first_verify(monkeypatch)
    ensured = api.ensure_series(find_vllm(vllm_root=vllm_tree), load_series(test_series))
    assert ensured.verify.ok and len(calls) == 2
    assert ensured.ledger_bytes == (state(vllm_tree) / "ledger.json").read_bytes()


# ------------------------------------------------------------- recovery errors are the tree's


def test_recovery_failing_on_the_disk_is_the_trees_error(vllm_tree: Path, test_series: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: recovering a commit-phase journal on a full disk (here: an injected I/O error)
    exited 27, blaming stdout."""
    root = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert cli("apply", *root)[0] == 0
    ledger = (state(vllm_tree) / "ledger.json").read_text()
    version = vllm_tree / "vllm" / "version.py"
    write_journal(vllm_tree, {"phase": "commit", "ledger": ledger, "entries": [
        {"path": "vllm/version.py", "pre": "0" * 64, "post": sha(version.read_bytes()),
         "stage": ".version.py.m3patch-new", "backup": ".version.py.m3patch-pre"}]})
    monkeypatch.setenv("M3PATCH_FAULT", "fail-after:1")
    code, _, err = cli("apply", *root)
    assert code == errors.TreeIOError.exit_code, err
    assert "recover" in err


def test_a_folder_named_ledger_json_is_the_trees_error(vllm_tree: Path, test_series: Path) -> None:
    """Before: exit 70."""
    (state(vllm_tree) / "ledger.json").mkdir(parents=True)
    for command in (["apply"], ["apply", "--verify"], ["revert"]):
        code, _, err = cli(*command, "--vllm-root", str(vllm_tree), "--series", str(test_series))
        assert code == errors.TreeIOError.exit_code, (command, err)


# ------------------------------------------------------------- lows: depth, header-only patch


def test_a_ledger_nested_2000_deep_is_a_corrupt_ledger(vllm_tree: Path, test_series: Path) -> None:
    """Before: exit 70 (RecursionError)."""
    state(vllm_tree).mkdir()
    (state(vllm_tree) / "ledger.json").write_text("[" * 2000 + "]" * 2000)
    root = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    for command in ("apply", "status", "verify", "revert"):
        code, _, err = cli(command, *root)
        assert code != errors.INTERNAL_ERROR_EXIT, (command, err)


def test_a_deeply_nested_new_json_payload_fails_verify_cleanly(vllm_tree: Path, pristine_033: Path,
                                                               tmp_path: Path) -> None:
    """Before: a new .json file nested 3,000 deep ended verify in 70 (RecursionError)."""
    series = series_of(tmp_path / "s", new_file_diff("vllm/m3_deep.json",
                                                     ["[" * 3000 + "]" * 3000]))
    assert cli("series", "lock", "--series", str(series), "--tree", str(pristine_033))[0] == 0
    root = ["--vllm-root", str(vllm_tree), "--series", str(series)]
    code, _, err = cli("apply", "--verify", *root)
    assert code in (0, errors.VerifyFailed.exit_code), err
    assert cli("verify", *root)[0] in (0, errors.VerifyFailed.exit_code)


def test_a_header_only_patch_is_refused_at_lock_time(pristine_033: Path, tmp_path: Path) -> None:
    """Before: it locked with 0 and every later command refused the lock (2)."""
    series = series_of(tmp_path / "s", "diff --git a/vllm/envs.py b/vllm/envs.py\n"
                                       "--- a/vllm/envs.py\n+++ b/vllm/envs.py\n")
    code, _, err = cli("series", "lock", "--series", str(series), "--tree", str(pristine_033))
    assert code == errors.UsageError.exit_code, err




@pytest.mark.parametrize("body", ["[]", '{"dir_info": []}', '{"dir_info": {"editable": "yes"}}',
                                  "[" * 5000 + "]" * 5000])
def test_a_hostile_direct_url_json_never_breaks_locate(vllm_tree: Path, test_series: Path,
                                                       body: str) -> None:
    """Before: a dist-info direct_url.json of `[]` or `{"dir_info": []}` ended `locate` (and
    every command that describes the tree) in 70."""
    dist = next(vllm_tree.glob("vllm-*.dist-info"))
    (dist / "direct_url.json").unlink(missing_ok=True)
    (dist / "direct_url.json").write_text(body)
    code, _, err = cli("locate", "--vllm-root", str(vllm_tree))
    assert code == 0, err
    code, _, err = cli("status", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert code == 0, err


def test_series_port_out_as_a_link_is_refused_before_any_work(pristine_033: Path, test_series: Path,
                                                              tmp_path: Path) -> None:
    """Before: `--out LINK` (a link to an empty folder) ended in 70 after the whole proof and left
    `.LINK.tmp<PID>` behind."""
    empty = tmp_path / "empty"
    empty.mkdir()
    link = tmp_path / "out"
    link.symlink_to(empty)
    code, _, err = cli("series", "port", str(test_series), "--tree", str(pristine_033),
                       "--out", str(link))
    assert code == errors.UnsafeState.exit_code, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]
    assert list(empty.iterdir()) == []


# ------------------------------------------------------------- --json on every way out


def test_a_command_line_error_under_json_prints_the_json_object(m3patch_cli: CliRunner) -> None:
    """Before: argparse's usage text and exit 2, no JSON on stdout."""
    done = m3patch_cli("status", "--json", "--no-such-flag")
    assert done.returncode == errors.UsageError.exit_code
    report = json.loads(done.stdout)
    assert report["error"]["type"] == "UsageError" and "--no-such-flag" in report["error"]["message"]


def _apply_json_signalled_in_the_lock_wait(vllm_tree: Path, test_series: Path,
                                           sent: tuple[str, ...]) -> tuple[int, str, str]:
    """`apply --json` as a child, the tree lock held, then the signals `sent` at once."""
    from m3patch.patching import writer

    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}

    def as_a_terminal_leaves_it() -> None:
        # a shell starts a background job with SIGQUIT (and SIGINT) ignored and nohup ignores
        # SIGHUP; exec passes that on and m3patch keeps an ignored signal ignored, by design
        for name in sent:
            signal.signal(getattr(signal, name), signal.SIG_DFL)

    with writer.tree_lock(vllm_tree):
        proc = subprocess.Popen([sys.executable, "-m", "m3patch", "apply", "--json", "--vllm-root",
                                 str(vllm_tree), "--series", str(test_series)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=as_a_terminal_leaves_it)
        _wait_until_it_holds_open(proc.pid, writer.safe_state_dir(vllm_tree, create=True) / "lock")
        for name in sent:
            proc.send_signal(getattr(signal, name))
        out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def _wait_until_it_holds_open(pid: int, path: Path) -> None:
    """Until process `pid` has `path` open: past its start-up (its handlers are set) and in the
    lock wait; a fixed sleep was too short on a loaded machine."""
    target, deadline = os.path.realpath(path), time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                return
        time.sleep(0.05)
    pytest.fail(f"process {pid} never opened {path}")


@pytest.mark.parametrize("sig", ["SIGHUP", "SIGQUIT"])
def test_a_hangup_during_the_lock_wait_ends_with_130_and_the_json(
        vllm_tree: Path, test_series: Path, sig: str) -> None:
    """Before: SIGHUP or SIGQUIT while waiting for the tree lock ended with no JSON and no
    documented code (the signal's default: killed, or a core dump)."""
    code, out, err = _apply_json_signalled_in_the_lock_wait(vllm_tree, test_series, (sig,))
    assert code == errors.Interrupted.exit_code, err
    assert json.loads(out)["error"]["type"] == "Interrupted"


@pytest.mark.parametrize("sent", [("SIGTERM", "SIGINT"), ("SIGINT", "SIGQUIT"),
                                  ("SIGHUP", "SIGINT", "SIGTERM")])
def test_several_stop_signals_during_the_lock_wait_end_with_130_and_one_json_object(
        vllm_tree: Path, test_series: Path, sent: tuple[str, ...]) -> None:
    """Before: two or three stop signals at once (a terminal's Ctrl-C with a CI runner's
    SIGTERM) ended in a traceback, exit 1 or killed by SIGINT, and no JSON: CPython runs each
    pending handler at its next check, and the second raised inside the error report of the
    first. Now stops that arrive together are one stop: the first is raised, the rest kept."""
    code, out, err = _apply_json_signalled_in_the_lock_wait(vllm_tree, test_series, sent)
    assert code == errors.Interrupted.exit_code, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert json.loads(out)["error"]["type"] in ("Interrupted", "KeyboardInterrupt")


def test_a_swallowed_sigterm_of_serve_is_kept_for_the_next_wait() -> None:
    """Before: serve's (and bench's, ci's) SIGTERM handler raised without keeping the stop, so a
    best-effort step that swallowed it lost it, and as serve ignores a second SIGTERM the server
    then ran until SIGKILL. Now the stop is kept and the next wait raises it."""
    from m3patch.commands import bench, ci, serve

    previous = signal.getsignal(signal.SIGTERM)
    try:
        for handler in (serve._on_sigterm, bench._on_sigterm, ci._on_sigterm):
            errors.forget_interrupts()
            with contextlib.suppress(errors.M3PatchError):  # a memo read's best-effort catch
                handler(signal.SIGTERM, None)
            with pytest.raises(errors.Interrupted, match="SIGTERM"):
                errors.raise_if_interrupted()
    finally:
        signal.signal(signal.SIGTERM, previous)
        errors.forget_interrupts()


def test_a_later_ctrl_c_still_stops_after_a_stop_was_swallowed() -> None:
    """Stops sent together are one stop (the second is only kept); a later one is the user
    asking again. Found by a hostile review of the first version of that rule: once a stop had
    been raised, every later Ctrl-C and SIGTERM only returned, so a stop a best-effort step
    swallowed (or a first Ctrl-C stuck in a library's thread-pool join) left a wait with no way
    out. Here the first is swallowed; a Ctrl-C past the burst window ends the wait."""
    previous = signal.signal(signal.SIGINT, errors.on_sigint)
    errors.forget_interrupts()
    try:
        with contextlib.suppress(errors.M3PatchError):  # a best-effort step's catch
            errors.interrupt(errors.Interrupted("received signal SIGTERM", hint="none"))
        with pytest.raises(errors.Interrupted):  # a signal with it, kept: the wait raises it
            errors.stop(errors.Interrupted("received signal SIGHUP", hint="none"))
            errors.raise_if_interrupted()
        time.sleep(errors.STOP_BURST_S + 0.1)
        timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # a wait that never asks for kept stops
                time.sleep(0.01)
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
        errors.forget_interrupts()


def test_an_in_process_main_gives_sigint_back() -> None:
    """A program (or test) calling main(argv) keeps Python's own SIGINT handler afterwards."""
    before = signal.getsignal(signal.SIGINT)
    assert main(["series", "list"]) == 0
    assert signal.getsignal(signal.SIGINT) is before


# ------------------------------------------------------------- a non-ASCII file name, ASCII locale

ASCII_LOCALE = {"LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def test_a_non_ascii_patched_name_under_an_ascii_locale_is_refused_before_anything_is_written(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    """Before: every tree command ended in 70 (UnicodeEncodeError from os.lstat). The
    file-system encoding of that process has no bytes for the name, so the command refuses
    (35) naming the path and the locale fix, on a pristine and on an applied tree alike."""
    series = make_series(tmp_path / "s", pristine_033, [
        new_file_diff("vllm/données_é.py", ["x = 1"]), append_diff(pristine_033, ENVS, "# m")])
    root = ["--vllm-root", str(vllm_tree), "--series", str(series)]

    def refused_everywhere() -> None:
        for command in (["apply", "--verify"], ["apply"], ["status"], ["verify"], ["revert"],
                        ["status", "--json"], ["series", "lock", "--tree", str(pristine_033)]):
            argv = [*command, *(root if command[0] != "series" else ["--series", str(series)])]
            before = {p.name for p in (vllm_tree / "vllm").iterdir()}
            done = m3patch_cli(*argv, env=ASCII_LOCALE)
            assert done.returncode == errors.FileNameEncoding.exit_code, (command, done.stderr)
            text = done.stdout if "--json" in command else done.stderr
            assert "vllm/donn\\xe9es_\\xe9.py" in text or "donn\\u00e9es" in text, text
            assert "LC_ALL=C.UTF-8" in text and "Traceback" not in done.stderr
            assert {p.name for p in (vllm_tree / "vllm").iterdir()} == before

    refused_everywhere()
    assert not state(vllm_tree).exists()  # not even the lock
    assert cli("apply", "--verify", *root)[0] == 0  # a UTF-8 locale applies it
    applied = (vllm_tree / ENVS).read_bytes()
    refused_everywhere()
    assert (vllm_tree / ENVS).read_bytes() == applied
    assert cli("revert", *root)[0] == 0


def test_a_lone_surrogate_in_a_ledger_path_is_a_corrupt_ledger(vllm_tree: Path,
                                                               test_series: Path) -> None:
    """No locale has bytes for a lone surrogate (JSON can spell one: "\\ud800"): such a ledger
    path is confined like any hostile one, never a crash."""
    from m3patch.patching.diffs import check_rel_path

    with pytest.raises(errors.HostilePatch, match="not a file name in any encoding"):
        check_rel_path("vllm/\ud800.py", "ledger.json")
    root = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert cli("apply", *root)[0] == 0
    ledger = state(vllm_tree) / "ledger.json"
    doc = json.loads(ledger.read_text())
    doc["files"][0]["path"] = "vllm/\ud800.py"
    ledger.write_text(json.dumps(doc))
    code, _, err = cli("status", *root)
    assert code in (0, errors.PatchConflict.exit_code), err
    assert "Traceback" not in err


def _stopped_in_the_first_memo_read(monkeypatch: pytest.MonkeyPatch, sig: signal.Signals) -> None:
    """The stop signal delivered in the parse memo's first read (by the command's handler, as
    the kernel would, which a real server cannot time); later reads miss, as a bad memo does."""
    from m3patch.commands import common
    from m3patch.patching import parse_cache

    delivered: list[bool] = []

    def read_and_get_stopped(*args: object, **kwargs: object) -> object:
        if not delivered:
            delivered.append(True)
            common._on_sigterm(sig, None)
            raise AssertionError  # unreachable: the command's first stop is raised
        raise errors.TreeIOError("memo unreadable", hint="none")  # a miss, as the read's catch

    monkeypatch.setattr(parse_cache, "read_state", read_and_get_stopped)


def test_a_stop_signal_a_memo_read_swallowed_still_ends_the_lock_wait(
        vllm_tree: Path, test_series: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a stop signal that landed while a best-effort memo read was running raised
    Interrupted inside its `except M3PatchError` (a memo that cannot be read is only time), so
    the signal was lost and the apply went on to wait for a held tree lock until its timeout
    (exit 8 after 30 s here, 5 min by default). Now a stop signal is kept
    and every lock-wait turn raises it again: 130 at once. The signal is delivered in the memo
    read itself (by its handler, as the kernel would), which a real server cannot time."""
    import fcntl

    from m3patch.patching import writer

    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("M3PATCH_LOCK_TIMEOUT", "30")
    where = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert main(["apply", *where]) == 0  # fills the parse memo the next apply reads
    assert main(["revert", *where]) == 0

    _stopped_in_the_first_memo_read(monkeypatch, signal.SIGQUIT)
    monkeypatch.setattr(errors, "_pending_interrupts", [], raising=False)
    lock = writer.safe_state_dir(vllm_tree, create=True) / "lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another run's hold: a separate open file description
        start = time.monotonic()
        assert main(["apply", *where]) == 130
        assert time.monotonic() - start < 10
    finally:
        os.close(fd)


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".m3patch" not in p.parts}


@pytest.mark.parametrize("json_out", [False, True])
def test_a_stop_a_memo_read_swallowed_writes_nothing_and_exits_130(
        json_out: bool, vllm_tree: Path, test_series: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: with the tree lock free, a stop signal swallowed by the parse memo's read (its
    `except M3PatchError`) let the apply go on, patch every file and exit 0: a Ctrl-\\ or a CI
    runner's SIGTERM ignored. Now the writer raises the kept stop before its journal: nothing
    written, 130, and under --json the one object is Interrupted's. The signal is delivered in
    the memo read itself (by its handler, as the kernel would), which a real server cannot time."""
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    where = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert main(["apply", *where]) == 0  # fills the parse memo the next apply reads
    assert main(["revert", *where]) == 0
    before = _tree_bytes(vllm_tree)

    _stopped_in_the_first_memo_read(monkeypatch, signal.SIGTERM)
    code, out, err = cli("apply", *where, *(["--json"] if json_out else []))
    assert code == 130, err
    assert "received signal SIGTERM" in err
    assert _tree_bytes(vllm_tree) == before
    assert not (vllm_tree / "vllm" / ".m3patch" / "journal.json").exists()
    if json_out:
        report = json.loads(out)  # exactly one object
        assert (report["exit_code"], report["error"]["type"]) == (130, "Interrupted")


def test_a_stop_swallowed_after_the_transaction_exits_130_with_one_json_object(
        vllm_tree: Path, test_series: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a stop signal swallowed while the image memo was written (after the transaction
    committed) ended in exit 0, the success object printed. Now: 130, one JSON object, the
    Interrupted one; the transaction stands, and the next apply finds every file applied."""
    from m3patch.commands import common
    from m3patch.patching import image_memo

    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    where = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]

    def write_and_get_stopped(*args: object, **kwargs: object) -> None:
        common._on_sigterm(signal.SIGTERM, None)

    monkeypatch.setattr(image_memo, "write_cache_bytes", write_and_get_stopped)
    code, out, err = cli("apply", *where, "--json")
    assert code == 130, err
    report = json.loads(out)
    assert (report["exit_code"], report["error"]["type"]) == (130, "Interrupted")
    code, out, err = cli("apply", *where, "--json")
    again = json.loads(out)
    assert code == 0 and again["already_applied"] and not again["applied"], err


def test_a_lone_surrogate_or_escape_in_the_ledger_series_is_printed_escaped(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    """Before: `status` printed the ledger's series "\\ud800" into a table: UnicodeEncodeError on
    stdout, exit 70; an ESC in it reached the terminal raw."""
    root = ["--vllm-root", str(vllm_tree), "--series", str(test_series)]
    assert cli("apply", *root)[0] == 0
    ledger = state(vllm_tree) / "ledger.json"
    doc = json.loads(ledger.read_text())
    doc["series"] = "\ud800\x1b]0;owned\x07"
    ledger.write_text(json.dumps(doc))
    done = m3patch_cli("status", *root, env={"PYTHONIOENCODING": "utf-8"})
    assert done.returncode in (0, errors.PatchConflict.exit_code), done.stderr
    assert "\\ud800\\x1b]0;owned\\x07" in done.stdout + done.stderr
    assert "\x1b" not in done.stdout + done.stderr


def test_a_lone_surrogate_in_a_journals_ledger_is_the_trees_error(vllm_tree: Path,
                                                                  test_series: Path) -> None:
    """Before: read_journal encoded the journal's ledger text to bytes outside its checks: a
    lone surrogate ("\\ud800" in the JSON) ended in UnicodeEncodeError, exit 70."""
    write_journal(vllm_tree, {"phase": "commit", "entries": [], "ledger": "\ud800"})
    code, _, err = cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert code == errors.TreeIOError.exit_code, err
    assert "invalid journal" in err and "\\ud800" in err
