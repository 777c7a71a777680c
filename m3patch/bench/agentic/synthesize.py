"""The `agentic-code` trace source: `aiperf synthesize agentic-code` run offline from the recipe's
distribution manifest, the Mooncake trace it writes checked, cached and copied into the run.

    <cache>/agentic-traces/<key>.jsonl     key: sha256 of the manifest's bytes, the session count,
                                           the seed, the clips and AIPerf's version

AIPerf's generator is deterministic for a seed (same manifest, sessions and seed: the same bytes),
so one synthesis serves every later run. The cached file is hostile input like every file m3patch
reads back: read without following a link, bounded, and checked row by row against Mooncake's
rules (AIPerf's writer: `input_length = (len(hash_ids) - 1) * block_size + last`, 1 <= last <=
block_size) before a byte of it is used; one that fails is synthesized again. A run replays its
own copy (`trace/dataset.jsonl` in the run folder), never the cache entry another run may replace,
and records the copy's sha256 beside its cells.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from m3patch.bench.agentic.aiperf import AIPERF_VERSION, SETUP_HINT, aiperf_binary
from m3patch.bench.client import POLL_SECONDS, STOP_LADDER
from m3patch.errors import AgenticTraceError, TreeIOError, UnsafeState
from m3patch.fsio import owned_dir, parse_json, read_state, write_bytes_atomic
from m3patch.patching.pristine import cache_root, writable_cache_root
from m3patch.recipe.agentic import AGENTIC_CODE, AgenticScenario, TraceSource
from m3patch.serving.processes import start_group, stop_group

CACHE_DIR = "agentic-traces"
RUN_TRACE = Path("trace") / "dataset.jsonl"
DEFAULT_BLOCK_SIZE = 512  # AIPerf's SessionDistributionConfig.block_size
MANIFEST_MAX_BYTES = 1 << 20
TRACE_MAX_BYTES = 1 << 30
SYNTHESIZE_TIMEOUT_S = 1800.0
LOG_TAIL_LINES = 8
MOONCAKE_LOADER = "mooncake_trace"
FIRST_TURN_KEYS = frozenset({"timestamp", "group_id", "is_restart"})
MAX_ROW_TOKENS = 10_000_000  # past any model's context: a length beyond it is a broken trace
ROW_KEYS = frozenset({"session_id", "input_length", "output_length", "hash_ids", "delay"}
                     | FIRST_TURN_KEYS)


@dataclass(frozen=True)
class TraceSummary:
    rows: int
    sessions: int
    input_tokens: int  # the rows' input_length summed: the new tokens of every turn


@dataclass(frozen=True)
class SynthesizedTrace:
    data: bytes
    sha256: str
    block_size: int
    summary: TraceSummary
    cached: Path


def _hint(trace: TraceSource) -> str:
    return (f"check {trace.manifest} (AIPerf's agentic-code config or a manifest.json), then "
            f"`m3patch model fetch RECIPE` to synthesize it again")


def read_manifest(trace: TraceSource) -> bytes:
    """The manifest's bytes, read once: the cache key, the block size and AIPerf all see these."""
    assert trace.manifest is not None
    try:
        return read_state(trace.manifest, MANIFEST_MAX_BYTES, links=True)
    except OSError as exc:
        msg = f"agentic-code manifest {trace.manifest}: cannot read ({exc.strerror or exc})"
        raise AgenticTraceError(msg, hint=_hint(trace)) from None


def manifest_block_size(data: bytes, where: str) -> int:
    """The block a hash_id stands for: the manifest's block_size (under generation_params in a
    manifest.json a synthesis wrote), AIPerf's 512 when it names none."""
    hint = "give the manifest a JSON object as AIPerf's `synthesize --config` takes"
    doc = parse_json(data, where, error=AgenticTraceError, hint=hint, expect=dict)
    params = doc.get("generation_params", doc)
    if not isinstance(params, dict):
        msg = f"{where}: generation_params is not a JSON object"
        raise AgenticTraceError(msg, hint=hint)
    size = params.get("block_size", DEFAULT_BLOCK_SIZE)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        msg = f"{where}: block_size must be a positive integer, got {size!r}"
        raise AgenticTraceError(msg, hint=hint)
    return size


def cache_key(trace: TraceSource, manifest: bytes) -> str:
    inputs = {"manifest_sha256": hashlib.sha256(manifest).hexdigest(), "aiperf": AIPERF_VERSION,
              **dict(trace.synthetic)}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def synthesize_argv(python: str, trace: TraceSource, config: Path, output: Path) -> list[str]:
    synth = dict(trace.synthetic)
    clips = [arg for key, flag in (("max-isl", "--max-isl"), ("max-osl", "--max-osl"))
             if key in synth for arg in (flag, str(synth[key]))]
    return [str(aiperf_binary(python)), "synthesize", "agentic-code", "--config", str(config),
            "--num-sessions", str(synth["sessions"]), "--seed", str(synth["seed"]), *clips,
            "--output", str(output)]


def check_trace(data: bytes, block_size: int, where: str) -> TraceSummary:
    """A Mooncake trace as AIPerf's agentic-code writer lays it out, or AgenticTraceError naming
    the line: one JSON object per line, a session's rows together, its first row timestamped and
    every later one delayed, each row's hash_ids covering exactly its input_length."""
    hint = "delete the file; the next run (or `m3patch model fetch RECIPE`) synthesizes it again"
    try:
        # JSON lines end at "\n" only: str.splitlines would also break a line at a raw U+2028
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as exc:
        msg = f"{where}: not UTF-8 (byte {exc.start})"
        raise AgenticTraceError(msg, hint=hint) from None
    seen: set[str] = set()
    current = None
    rows = tokens = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where}:{number}"
        row = parse_json(line, at, error=AgenticTraceError, hint=hint, expect=dict)
        problem = _row_problem(row, block_size, first=row.get("session_id") != current)
        if problem is None and row["session_id"] != current and row["session_id"] in seen:
            problem = f"session {row['session_id']!r} resumes after another session's rows"
        if problem is not None:
            msg = f"{at}: {problem}"
            raise AgenticTraceError(msg, hint=hint)
        current = row["session_id"]
        seen.add(current)
        rows += 1
        tokens += row["input_length"]
    if not rows:
        msg = f"{where}: no rows"
        raise AgenticTraceError(msg, hint=hint)
    return TraceSummary(rows, len(seen), tokens)


def _count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _row_problem(row: dict[str, Any], block_size: int, *, first: bool) -> str | None:
    unknown = sorted(set(row) - ROW_KEYS)
    if unknown:
        return f"unknown key(s) {unknown} (AIPerf's writer sets {sorted(ROW_KEYS)})"
    session = row.get("session_id")
    if not isinstance(session, str) or not session:
        return "session_id must be a non-empty string"
    for key in ("input_length", "output_length"):
        if not _count(row.get(key), 1) or row[key] > MAX_ROW_TOKENS:
            return (f"{key} must be an integer from 1 to {MAX_ROW_TOKENS:,}, "
                    f"got {row.get(key)!r}")
    hashes = row.get("hash_ids")
    if not isinstance(hashes, list) or not all(_count(h, 0) for h in hashes):
        return "hash_ids must be a list of integers >= 0"
    if len(hashes) != math.ceil(row["input_length"] / block_size):
        return (f"{len(hashes)} hash_ids do not cover input_length {row['input_length']} "
                f"in blocks of {block_size}")
    timing = "timestamp" if first else "delay"
    value = row.get(timing)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        return f"a session's {'first' if first else 'later'} row needs {timing} >= 0"
    if not first and FIRST_TURN_KEYS & set(row):
        return f"{sorted(FIRST_TURN_KEYS & set(row))} belong on a session's first row only"
    return None


def trace_key(trace: TraceSource) -> str | None:
    """What a resumed cell must have replayed: the cache key of an agentic-code trace (None for
    another source; "" when the manifest cannot be read, which no cell matches)."""
    if trace.kind != AGENTIC_CODE:
        return None
    try:
        return cache_key(trace, read_manifest(trace))
    except AgenticTraceError:
        return ""


def cache_state(trace: TraceSource) -> tuple[Path, str | None]:
    """Read-only: the cache entry for `trace` and why it cannot serve a run (None: it can)."""
    manifest = read_manifest(trace)
    block = manifest_block_size(manifest, str(trace.manifest))
    path = cache_root() / CACHE_DIR / f"{cache_key(trace, manifest)}.jsonl"
    try:
        check_trace(read_state(path, TRACE_MAX_BYTES), block, str(path))
    except FileNotFoundError:
        return path, "not synthesized yet: the run makes it first, or `m3patch model fetch`"
    except OSError as exc:
        return path, f"unreadable ({exc.strerror or exc}): synthesized again at the next run"
    except AgenticTraceError as exc:
        return path, f"invalid ({exc.message}): synthesized again at the next run"
    return path, None


def synthesized(trace: TraceSource, python: str, *, log: Path | None = None) -> SynthesizedTrace:
    """The trace for `trace`: the valid cache entry, or a fresh synthesis written to the cache.
    `log` keeps AIPerf's output (a temporary file otherwise)."""
    manifest = read_manifest(trace)
    where = str(trace.manifest)
    block = manifest_block_size(manifest, where)
    folder = _cache_folder()
    path = folder / f"{cache_key(trace, manifest)}.jsonl"
    data = _valid_cached(path, block)
    if data is None:
        data = _synthesize(trace, python, manifest, folder, log)
        summary = check_trace(data, block, f"AIPerf's synthesis from {where}")
        write_bytes_atomic(path, data, error=AgenticTraceError)
    else:
        summary = check_trace(data, block, str(path))
    return SynthesizedTrace(data, hashlib.sha256(data).hexdigest(), block, summary, path)


def _cache_folder() -> Path:
    """<cache>/agentic-traces as this user's real folder (a link there is refused, not followed)."""
    try:  # a cache moved with the user's own link is followed; nothing another user controls
        base = writable_cache_root()
    except (TreeIOError, UnsafeState) as exc:
        raise AgenticTraceError(exc.message, hint=exc.hint or "set M3PATCH_CACHE to a writable "
                                "folder of your own") from None
    return owned_dir(base / CACHE_DIR, create=True, error=AgenticTraceError)


def _valid_cached(path: Path, block: int) -> bytes | None:
    """The cache entry's bytes when they are a valid trace; None (synthesize again) otherwise."""
    try:
        data = read_state(path, TRACE_MAX_BYTES)
        check_trace(data, block, str(path))
    except FileNotFoundError:
        return None
    except (OSError, AgenticTraceError):
        if path.is_symlink() or path.is_file():
            path.unlink()  # ours to replace: the cache folder is checked as this user's
        return None
    return data


def _synthesize(trace: TraceSource, python: str, manifest: bytes, folder: Path,
                log: Path | None) -> bytes:
    binary = aiperf_binary(python)
    if not binary.is_file():
        msg = f"AIPerf is not installed: no {binary} (it synthesizes the agentic-code trace)"
        raise AgenticTraceError(msg, hint=SETUP_HINT)
    work = Path(tempfile.mkdtemp(prefix=".synth-", dir=folder))
    try:
        config = work / "manifest.json"  # the bytes the key was made of, not the file's now
        config.write_bytes(manifest)
        log_path = log or work / "synthesize.log"
        code = _run(synthesize_argv(python, trace, config, work / "out"), log_path)
        if code != 0:
            msg = (f"aiperf synthesize agentic-code exited with status {code} for "
                   f"{trace.manifest}; last lines:\n{_tail(log_path)}")
            raise AgenticTraceError(msg, hint=_hint(trace))
        written = sorted((work / "out").glob("*/dataset.jsonl"))
        if len(written) != 1:
            msg = f"aiperf synthesize agentic-code wrote {len(written)} dataset.jsonl, not one"
            raise AgenticTraceError(msg, hint=_hint(trace))
        try:
            return read_state(written[0], TRACE_MAX_BYTES)
        except OSError as exc:
            msg = f"cannot read AIPerf's synthesis {written[0]}: {exc.strerror or exc}"
            raise AgenticTraceError(msg, hint=_hint(trace)) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(argv: list[str], log_path: Path) -> int:
    """AIPerf's synthesis in its own process group, stopped by the one ladder past its deadline."""
    deadline = time.monotonic() + SYNTHESIZE_TIMEOUT_S
    with open(log_path, "wb") as log:
        try:
            proc = start_group(argv, stdout=log, stderr=subprocess.STDOUT)
        except OSError as exc:
            msg = f"cannot start aiperf synthesize: {exc.strerror or exc}"
            raise AgenticTraceError(msg, hint=SETUP_HINT) from None
        try:
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    return proc.wait(timeout=POLL_SECONDS)
                if time.monotonic() > deadline:
                    msg = f"aiperf synthesize still running after {SYNTHESIZE_TIMEOUT_S:g} s"
                    raise AgenticTraceError(msg, hint="synthesize fewer sessions")
        finally:
            stop_group(proc, STOP_LADDER)


def _tail(log_path: Path) -> str:
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.strip().splitlines()[-LOG_TAIL_LINES:])


def for_run(scenario: AgenticScenario, run_dir: Path) -> tuple[AgenticScenario, dict[str, Any]]:
    """The scenario with an agentic-code trace pointed at the run's own validated copy, and the
    provenance of that copy; any other source unchanged, with no provenance."""
    trace = scenario.trace
    if trace.kind != AGENTIC_CODE:
        return scenario, {}
    made = synthesized(trace, scenario.client_python)
    copy = run_dir / RUN_TRACE
    write_bytes_atomic(copy, made.data, error=AgenticTraceError)
    record = {"source": trace.label, "manifest": str(trace.manifest), "sha256": made.sha256,
              "key": made.cached.stem,
              "rows": made.summary.rows, "sessions": made.summary.sessions,
              "block_size": made.block_size, "file": str(RUN_TRACE)}
    return replace(scenario, trace=replace(trace, path=copy, block_size=made.block_size)), record
