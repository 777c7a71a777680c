"""`m3patch recipe validate/show`, `serve --dry-run` and `markers check` through the real CLI."""

from __future__ import annotations

import fcntl
import os
import pty
import shlex
import shutil
import struct
import subprocess
import sys
import termios
from collections.abc import Callable
from pathlib import Path

import pytest

from m3patch.recipe.loader import load_recipe
from m3patch.serving.launch_plan import all_markers

REPO = Path(__file__).resolve().parents[2]
Cli = Callable[..., subprocess.CompletedProcess[str]]
PROV = ("(APIServer pid=5) INFO 11-29 10:01:37 [m3patch_provenance.py:50] m3patch[provenance]: "
        "series=vllm-0.32.0 patches=provenance ledger=sha256:98")
MOE = "(Worker pid=7) INFO 11-29 10:02:16 [unquantized.py:529] Using CPUUnquantizedExperts MoE backend"
ARCH = "(APIServer pid=5) INFO 11-29 10:01:30 [model.py:733] Resolved architecture: Qwen3MoeForCausalLM"


def test_validate_all_shipped_recipes(m3patch_cli: Cli) -> None:
    files = sorted(str(p) for p in (REPO / "recipes").glob("*.yaml"))
    result = m3patch_cli("recipe", "validate", *files, timeout=300)  # the marker lint of each
    assert result.returncode == 0, result.stderr
    assert f"recipe validate: {len(files)} of {len(files)} recipe(s) ok" in result.stderr
    # summarised once, never a line per recipe (the README's first command runs this)
    assert all(Path(f).name not in result.stderr for f in files[1:]), result.stderr
    assert result.stderr.count("markers not linted") <= 1


def test_validate_reports_every_bad_file_with_exit_2(m3patch_cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
                   .replace("vllm-args:", "vllm_args:")
                   .replace("series: vllm-0.32.0", f"series: {REPO / 'patches' / 'vllm-0.32.0'}"))
    result = m3patch_cli("recipe", "validate", str(bad), "recipes/cpu_tiny_moe.yaml")
    assert result.returncode == 2
    assert "unknown key 'vllm_args'. Perhaps you meant 'vllm-args'?" in result.stderr
    assert "recipe validate: 1 of 2 recipe(s) ok" in result.stderr


def test_show_server_groups_fit_a_terminal(m3patch_cli: Cli) -> None:
    """The server-groups table summarises cells by shape and names only what a group changes."""
    show = m3patch_cli("recipe", "show", "mi355x_tp4", env={"COLUMNS": "110"})
    assert show.returncode == 0, show.stderr
    groups = show.stdout[show.stdout.index("server groups"):].splitlines()
    assert max(len(line) for line in groups) <= 110, groups
    # each cell's server gets InferenceX's isl + osl + 256 (GPU recipes size per cell)
    assert [line.split()[1:] for line in groups[-3:]] == [
        ["1024/1024:", "c1,2,4,8,16,32,64", "--max-model-len", "2304"],
        ["8192/1024:", "c1,2,4,8,16,32", "--max-model-len", "9472"],
        ["8192/1024:", "c64,128", "--linear-backend", "emulation", "--max-model-len", "9472"]]


def test_show_and_dry_run_print_the_launch_and_start_nothing(m3patch_cli: Cli,
                                                             tmp_path: Path) -> None:
    show = m3patch_cli("recipe", "show", "recipes/mi300x_tp8_eagle3.yaml", env={"COLUMNS": "250"})
    assert show.returncode == 0, show.stderr
    joined = show.stdout.replace(" \\\n   ", " ")  # the launch's lines as the shell reads them
    assert "-m vllm.entrypoints.cli.main serve MiniMaxAI/MiniMax-M3-MXFP8" in joined
    assert '"model":"Inferact/MiniMax-M3-EAGLE3-GQA"' in show.stdout
    assert "VLLM_HOST_IP=127.0.0.1" in show.stdout
    assert "m3patch[provenance]: series=vllm-0.33.0" in show.stdout  # the series' marker
    assert "m3patch[mxfp8->block_fp8]: " in show.stdout  # a gfx942-only marker applies here
    dry = m3patch_cli("serve", "recipes/cpu_tiny_moe.yaml", "--dry-run", "--run-dir",
                      str(tmp_path / "run"), env={"COLUMNS": "250"})
    assert dry.returncode == 0, dry.stderr
    assert "--dtype float32 --enforce-eager" in dry.stdout
    assert not (tmp_path / "run").exists()


def test_markers_check_exit_codes_on_a_saved_log(m3patch_cli: Cli, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(f"{ARCH}\n{PROV}\n{MOE}\n")
    ok = m3patch_cli("markers", "check", str(log), "--recipe", "recipes/cpu_tiny_moe.yaml",
                     env={"COLUMNS": "250"})
    assert ok.returncode == 0, ok.stderr
    log.write_text(f"{ARCH}\n{MOE}\n")
    missing = m3patch_cli("markers", "check", str(log), "--recipe", "recipes/cpu_tiny_moe.yaml")
    assert missing.returncode == 12
    assert "'provenance'" in missing.stderr and "patch provenance in" in missing.stderr
    log.write_text(f"{ARCH}\n{PROV}\n{MOE}\nERROR EngineCore failed: EngineDeadError\n")
    forbidden = m3patch_cli("markers", "check", str(log), "--recipe", "recipes/cpu_tiny_moe.yaml")
    assert forbidden.returncode == 13
    assert f"{log}:4: ERROR EngineCore failed: EngineDeadError" in forbidden.stderr


BOX = set("│┃━─┏┓┗┛┡┩└┘┌┐╇┳┻╋")


def _on_an_80_column_terminal(*args: str) -> str:
    """Run the CLI with stdout on a real pseudo-terminal 80 columns wide; return what it drew."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "m3patch", *args], stdout=terminal,
                            stderr=subprocess.DEVNULL, cwd=REPO, env=env)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_show_keeps_every_marker_text_whole_at_80_columns() -> None:
    recipe = REPO / "recipes" / "h200_tp8_block_fp8.yaml"
    drawn = _on_an_80_column_terminal("recipe", "show", str(recipe))
    assert BOX & set(drawn), "stdout is a terminal here: the sweep is a boxed table"
    lines = drawn.splitlines()
    specs = all_markers(load_recipe(recipe), None)
    assert max(len(m.text) for m in specs) > 80  # the tuned-table path is wider than the screen
    for spec in specs:
        assert f"      {spec.text!r}" in lines, spec.id  # whole, on its own line, ready to copy
    # the source of a group once, not its long manifest path on every marker's line
    assert sum(line.strip().startswith("declared by patch moe-split-k") for line in lines) == 1


def test_tables_to_a_pipe_are_plain_text(m3patch_cli: Cli, tmp_path: Path) -> None:
    show = m3patch_cli("recipe", "show", "recipes/mi355x_tp4.yaml")
    assert show.returncode == 0, show.stderr
    assert not BOX & set(show.stdout)
    waiver = next(line for line in show.stdout.splitlines() if line.startswith("packed-e8m0 "))
    assert waiver.endswith("recipes/mi355x_tp4_native.yaml gates the packed path")  # not cut
    log = tmp_path / "server.log"
    log.write_text(f"{ARCH}\n{PROV}\n{MOE}\n")
    check = m3patch_cli("markers", "check", str(log), "--recipe", "recipes/cpu_tiny_moe.yaml")
    assert check.returncode == 0, check.stderr
    assert not BOX & set(check.stdout)
    rows = [line.split() for line in check.stdout.splitlines()]
    assert ["cpu-moe-backend", "required", "Using", "CPUUnquantizedExperts", "MoE", "backend", "1", "1",
            "recipe", "recipes/cpu_tiny_moe.yaml"] in rows


def test_a_copied_shipped_recipe_validates_anywhere(m3patch_cli: Cli, tmp_path: Path) -> None:
    """Before: the shipped recipes kept `series: ../patches/...`, so a copy put anywhere else
    failed with 2 ("no series manifest; fix: pass --series NAME", a flag neither command has)
    before any other check: a GPU recipe's flag typo never reached 24. Now they name their
    series, a copy resolves to the same series, and an old-style copy is refused at `series:`
    with the name to write."""
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        copy = tmp_path / "elsewhere" / path.name
        copy.parent.mkdir(exist_ok=True)
        copy.write_text(path.read_text())
        assert load_recipe(copy).series_dir == load_recipe(path).series_dir, path.name
    typo = tmp_path / "elsewhere" / "mi300x_tp8.yaml"
    typo.write_text(typo.read_text().replace("async-scheduling", "async-schedulng"))
    result = m3patch_cli("recipe", "validate", str(typo))
    assert result.returncode == 24, result.stderr
    assert "async-schedulng" in result.stderr and "async-scheduling" in result.stderr
    old = tmp_path / "old-style.yaml"
    old.write_text((REPO / "recipes" / "mi300x_tp8.yaml").read_text()
                   .replace("series: vllm-0.33.0", "series: ../patches/vllm-0.33.0"))
    result = m3patch_cli("recipe", "validate", str(old))
    assert result.returncode == 2, result.stderr
    assert "At key: series" in result.stderr and "write `series: vllm-0.33.0`" in result.stderr


def test_the_launch_is_one_shell_command_over_lines_a_terminal_shows_whole(
        m3patch_cli: Cli) -> None:
    """Before: `recipe show` printed the env and the argv as two lines of some 400 and 500
    columns. Now lines of at most 100 columns, joined by ` \\`, that a shell reads back as the
    exact words, an option beside its value and the interpreter starting its own line."""
    show = m3patch_cli("recipe", "show", "mi300x_tp8")
    assert show.returncode == 0, show.stderr
    lines = show.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("env "))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith(" \\"))
    launch = lines[start:end + 1]
    assert all(len(line) <= 100 for line in launch), launch
    assert any(line.startswith((f"   {sys.executable} ", f"   {shlex.quote(sys.executable)} "))
               for line in launch), launch
    # an option beside its value, wherever the interpreter's path (its length) puts the break
    assert any("--tensor-parallel-size 8" in line for line in launch), launch
    words = subprocess.run(["bash", "-c", 'printf "%s\\n" ' + "\n".join(launch)],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert words[0] == "env" and "VLLM_ROCM_USE_AITER=1" in words
    assert words[words.index("--tensor-parallel-size") + 1] == "8"
    assert words[-2:] == ["--max-num-batched-tokens", "16384"]


def test_shell_lines_keep_every_word_even_one_past_the_width() -> None:
    from m3patch.commands.recipe import shell_lines

    argv = ["/py", "-m", "vllm", "serve", "x" * 150, "--flag", "a b", "--switch", "--n", "1"]
    lines = shell_lines([("K", "v w")], argv, width=40)
    assert lines[0] == "env K='v w' \\" and lines[1].startswith("   /py -m vllm")
    joined = " ".join(line.removesuffix(" \\") for line in lines)
    assert shlex.split(joined) == ["env", "K=v w", *argv]


def _markers_check(log: str, *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`markers check LOG` through bash, so LOG may be a process substitution; a deadline, as
    a read that blocks forever is the failure some of these tests look for."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    command = (f"exec {shlex.quote(sys.executable)} -m m3patch markers check {log}"
               " --recipe recipes/cpu_tiny_moe.yaml")
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO,
                          env={**env, "COLUMNS": "250"}, timeout=timeout, check=False)


def test_markers_check_reads_a_process_substitution(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(f"{ARCH}\n{PROV}\n{MOE}\n")
    done = _markers_check(f"<(cat {shlex.quote(str(log))})")
    assert done.returncode == 0, done.stderr
    log.write_text(f"{ARCH}\n{MOE}\n")
    assert _markers_check(f"<(sleep 1; cat {shlex.quote(str(log))})").returncode == 12


def test_markers_check_reads_a_fifo_whose_writer_waits(tmp_path: Path) -> None:
    fifo = tmp_path / "server.fifo"
    os.mkfifo(fifo)
    command = f"cat > {shlex.quote(str(fifo))}"
    with subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, text=True) as writer:
        done = None
        try:
            assert writer.stdin is not None
            writer.stdin.write(f"{ARCH}\n{PROV}\n{MOE}\n")
            writer.stdin.close()
            done = _markers_check(shlex.quote(str(fifo)))
        finally:
            writer.kill()
    assert done.returncode == 0, done.stderr


def test_markers_check_refuses_a_fifo_nobody_writes_to(tmp_path: Path) -> None:
    """Before: the open waited for a writer forever. Now a writer has 10 s to come."""
    fifo = tmp_path / "server.fifo"
    os.mkfifo(fifo)
    done = _markers_check(shlex.quote(str(fifo)), timeout=40)
    assert done.returncode == 2, done.stderr
    assert f"{fifo}: cannot read the log: a FIFO no writer opened within 10 s" in done.stderr
    assert "Traceback" not in done.stderr


def test_markers_check_started_before_its_fifos_writer_reads_it(tmp_path: Path) -> None:
    """`markers check F &` then `cat server.log > F`: the writer comes a second later."""
    fifo, log = tmp_path / "server.fifo", tmp_path / "server.log"
    os.mkfifo(fifo)
    log.write_text(f"{ARCH}\n{PROV}\n{MOE}\n")
    later = f"sleep 1; cat {shlex.quote(str(log))} > {shlex.quote(str(fifo))}"
    with subprocess.Popen(["bash", "-c", later]) as writer:
        done = _markers_check(shlex.quote(str(fifo)))
        writer.wait(timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("log", ["<(true)", "/dev/stdin < <(true)", "/dev/stdin <<< ''"])
def test_markers_check_of_an_empty_shell_pipe_is_an_empty_log(log: str) -> None:
    """A server that died before it printed, its log piped in: before this, 2 ("a FIFO nobody
    writes to") when the writer had already closed. An empty log misses its required markers:
    12, as an empty file."""
    done = _markers_check(log)
    assert done.returncode == 12, done.stderr


def test_markers_check_refuses_a_device(tmp_path: Path) -> None:
    done = _markers_check("/dev/zero", timeout=20)
    assert done.returncode == 2, done.stderr
    assert "/dev/zero: cannot read the log: not a regular file" in done.stderr


def test_show_escapes_control_characters_in_the_recipes_path(m3patch_cli: Cli,
                                                             tmp_path: Path) -> None:
    """Before: the `# series` line printed the series folder's path raw, so an ESC in a folder
    name reached the terminal (it could clear or recolour it); now escaped as everywhere else."""
    folder = tmp_path / "team\x1b[2J"
    folder.mkdir()
    shutil.copytree(REPO / "patches" / "vllm-0.33.0", folder / "vllm-0.33.0")
    text = (REPO / "recipes" / "mi355x_tp4.yaml").read_text()
    recipe = folder / "mine.yaml"
    recipe.write_text(text.replace("series: vllm-0.33.0", "series: ./vllm-0.33.0"))
    show = m3patch_cli("recipe", "show", str(recipe))
    assert show.returncode == 0, show.stderr
    assert "\x1b" not in show.stdout
    assert "# series " + str(folder).replace("\x1b", "\\x1b") in show.stdout
