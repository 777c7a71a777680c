"""The agentic-code trace source: AIPerf's Mooncake trace checked row by row, the cache entry read
as hostile input (a tampered, linked or truncated entry is never replayed), the run's own copy
with its sha256, a local tokenizer laid out as the hub cache AIPerf's offline mode reads, and
one real synthesis by AIPerf 0.13.0 (deterministic for a seed) where its venv is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from m3patch.bench.agentic import synthesize
from m3patch.bench.agentic.aiperf import (
    LOCAL_TOKENIZER_REPO,
    AgenticTarget,
    client_env,
    tokenizer_view,
    trace_args,
)
from m3patch.bench.agentic.synthesize import (
    cache_key,
    cache_state,
    check_trace,
    manifest_block_size,
    synthesize_argv,
    synthesized,
)
from m3patch.errors import AgenticTraceError, UnsafeState
from m3patch.recipe.agentic import AGENTIC_CODE, AgenticScenario, TraceSource

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "recipes" / "traces" / "cpu_tiny_agentic_code.json"
AIPERF_PYTHON = Path.home() / ".cache" / "m3patch" / "aiperf-venv" / "bin" / "python"
# Two sessions as AIPerf 0.13.0 writes them (16-token blocks; the shared prefix is hash 0-7).
ROWS = [
    {"session_id": "sess-a", "input_length": 161, "output_length": 16,
     "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102], "timestamp": 0.0, "group_id": 0},
    {"session_id": "sess-a", "input_length": 22, "output_length": 16, "hash_ids": [103, 104],
     "delay": 15.7},
    {"session_id": "sess-b", "input_length": 140, "output_length": 16,
     "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 200], "timestamp": 0.0, "group_id": 0},
]


def lines(rows: list[dict[str, object]]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def trace_of(manifest: Path, **extra: int) -> TraceSource:
    values = {"sessions": 2, "seed": 0, **extra}
    return TraceSource(AGENTIC_CODE, synthetic=tuple(values.items()), manifest=manifest)


def test_a_valid_trace_is_summarized() -> None:
    summary = check_trace(lines(ROWS), 16, "t.jsonl")
    assert (summary.rows, summary.sessions, summary.input_tokens) == (3, 2, 323)


def test_a_raw_line_separator_inside_a_json_string_is_content() -> None:
    # U+2028 is legal raw inside a JSON string; only "\n" ends a JSON line
    rows = [dict(row, session_id="sess\u2028a") for row in ROWS[:2]]
    data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)
    assert "\u2028".encode() in data
    assert check_trace(data, 16, "t.jsonl").rows == 2


def changed(index: int, **fields: object) -> list[dict[str, object]]:
    rows = [dict(row) for row in ROWS]
    rows[index].update(fields)
    return [{k: v for k, v in row.items() if v is not None} for row in rows]


@pytest.mark.parametrize(("rows", "expected"), [
    (changed(0, hash_ids=[0, 1]), "2 hash_ids do not cover input_length 161 in blocks of 16"),
    (changed(1, group_id=0), "belong on a session's first row only"),
    (changed(1, delay=None), "later row needs delay >= 0"),
    (changed(0, timestamp=-1.0), "first row needs timestamp >= 0"),
    (changed(0, input_length=True), "input_length must be an integer from 1 to"),
    (changed(2, output_length=0), "output_length must be an integer from 1 to"),
    (changed(2, output_length=99_999_999_999), "output_length must be an integer from 1 to"),
    (changed(0, prompt="x"), "unknown key(s) ['prompt']"),
    (changed(0, session_id=""), "session_id must be a non-empty string"),
    (changed(1, hash_ids=[103, -1]), "hash_ids must be a list of integers >= 0"),
    ([*ROWS, ROWS[0]], "session 'sess-a' resumes after another session's rows"),
])
def test_a_row_off_mooncake_rules_is_refused_naming_its_line(rows: list[dict[str, object]],
                                                             expected: str) -> None:
    with pytest.raises(AgenticTraceError) as info:
        check_trace(lines(rows), 16, "t.jsonl")
    assert expected in info.value.message and "t.jsonl:" in info.value.message


@pytest.mark.parametrize(("data", "expected"), [
    (b"", "no rows"), (b"\xff\xfe", "not UTF-8"), (b"[1]\n", "expected a JSON object"),
    (b'{"session_id": "a", "input_length": NaN}\n', "not JSON"),
])
def test_bytes_that_are_no_trace_are_refused(data: bytes, expected: str) -> None:
    with pytest.raises(AgenticTraceError) as info:
        check_trace(data, 16, "t.jsonl")
    assert expected in info.value.message


def test_the_block_size_comes_from_the_manifest_or_aiperfs_default() -> None:
    assert manifest_block_size(MANIFEST.read_bytes(), "m") == 16
    assert manifest_block_size(b"{}", "m") == 512
    wrapped = json.dumps({"seed": 1, "generation_params": {"block_size": 64}}).encode()
    assert manifest_block_size(wrapped, "m") == 64
    for bad in (b'{"block_size": 0}', b'{"block_size": true}', b"[]", b"{"):
        with pytest.raises(AgenticTraceError):
            manifest_block_size(bad, "m")


def test_the_cache_key_and_argv_follow_every_input(tmp_path: Path) -> None:
    trace = trace_of(MANIFEST, **{"max-isl": 300})
    data = MANIFEST.read_bytes()
    key = cache_key(trace, data)
    assert key != cache_key(trace, data + b" ")
    assert key != cache_key(trace_of(MANIFEST, **{"max-isl": 300, "seed": 1}), data)
    assert key != cache_key(trace_of(MANIFEST), data)
    argv = synthesize_argv("/v/bin/python", trace, tmp_path / "m.json", tmp_path / "out")
    assert argv == ["/v/bin/aiperf", "synthesize", "agentic-code", "--config",
                    str(tmp_path / "m.json"), "--num-sessions", "2", "--seed", "0",
                    "--max-isl", "300", "--output", str(tmp_path / "out")]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("M3PATCH_CACHE", str(root))
    return root


def seeded(cache: Path, data: bytes, trace: TraceSource) -> Path:
    entry = cache / synthesize.CACHE_DIR / f"{cache_key(trace, MANIFEST.read_bytes())}.jsonl"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(data)
    return entry


def test_a_valid_cache_entry_serves_without_aiperf(cache: Path, tmp_path: Path) -> None:
    trace = trace_of(MANIFEST)
    entry = seeded(cache, lines(ROWS), trace)
    made = synthesized(trace, str(tmp_path / "no-venv" / "bin" / "python"))
    assert made.data == lines(ROWS) and made.cached == entry and made.block_size == 16
    assert made.sha256 == hashlib.sha256(lines(ROWS)).hexdigest()
    assert cache_state(trace) == (entry, None)


def test_a_tampered_cache_entry_is_never_replayed(cache: Path, tmp_path: Path) -> None:
    trace = trace_of(MANIFEST)
    entry = seeded(cache, lines(changed(0, hash_ids=[0])), trace)
    # The read-only check says why and leaves the entry alone.
    path, problem = cache_state(trace)
    assert path == entry and problem is not None and "invalid" in problem and entry.is_file()
    # A run drops it and synthesizes again: here without AIPerf, so that fails, closed.
    with pytest.raises(AgenticTraceError) as info:
        synthesized(trace, str(tmp_path / "no-venv" / "bin" / "python"))
    assert "AIPerf is not installed" in info.value.message and not entry.exists()


def test_a_linked_cache_entry_is_not_followed(cache: Path, tmp_path: Path) -> None:
    trace = trace_of(MANIFEST)
    elsewhere = tmp_path / "theirs.jsonl"
    elsewhere.write_bytes(lines(ROWS))
    entry = seeded(cache, b"", trace)
    entry.unlink()
    entry.symlink_to(elsewhere)
    assert "unreadable" in str(cache_state(trace)[1])
    with pytest.raises(AgenticTraceError):
        synthesized(trace, str(tmp_path / "no-venv" / "bin" / "python"))
    assert not entry.is_symlink() and elsewhere.read_bytes() == lines(ROWS)


def test_a_linked_cache_folder_is_refused(cache: Path, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    cache.mkdir()
    (cache / synthesize.CACHE_DIR).symlink_to(tmp_path / "other")
    with pytest.raises(AgenticTraceError) as info:
        synthesized(trace_of(MANIFEST), str(AIPERF_PYTHON))
    assert "a symlink" in info.value.message


def test_a_missing_manifest_is_one_error(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(AgenticTraceError) as info:
        synthesized(trace_of(tmp_path / "absent.json"), str(AIPERF_PYTHON))
    assert "absent.json: cannot read" in info.value.message


def test_the_run_replays_its_own_copy(cache: Path, tmp_path: Path) -> None:
    trace = trace_of(MANIFEST)
    seeded(cache, lines(ROWS), trace)
    scenario = AgenticScenario((), trace, None, 3, 0, None, None, None, False, (),
                               str(tmp_path / "no-venv" / "bin" / "python"))
    run = tmp_path / "run"
    ready, record = synthesize.for_run(scenario, run)
    assert ready.trace.path == run / "trace" / "dataset.jsonl"
    assert ready.trace.path.read_bytes() == lines(ROWS)
    assert record["sha256"] == hashlib.sha256(lines(ROWS)).hexdigest()
    assert (record["rows"], record["sessions"], record["block_size"]) == (3, 2, 16)
    assert trace_args(ready.trace) == [
        "--input-file", str(run / "trace" / "dataset.jsonl"), "--custom-dataset-type",
        "mooncake_trace", "--isl-block-size", "16", "--no-fixed-schedule"]


def test_a_local_tokenizer_is_handed_over_as_a_hub_cache_repo(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    target = AgenticTarget("http://127.0.0.1:1", "m", str(folder))
    hub = tmp_path / "hub"
    dataset = TraceSource("public-dataset", loader="x", dataset="owner/name")
    moved, view = tokenizer_view(target, dataset, tmp_path / "view", {"HF_HUB_CACHE": str(hub)})
    assert moved.tokenizer == LOCAL_TOKENIZER_REPO and view == tmp_path / "view"
    repo = view / "models--m3patch-local--tokenizer"
    assert (repo / "refs" / "main").read_text() == "local"
    assert (repo / "snapshots" / "local" / "tokenizer.json").resolve() == folder / "tokenizer.json"
    assert os.readlink(view / "datasets--owner--name") == str(hub / "datasets--owner--name")
    env = client_env(view)
    assert env["HF_HUB_CACHE"] == str(view) and env["HF_HUB_OFFLINE"] == "1"
    hub_target = AgenticTarget("http://127.0.0.1:1", "m", "org/model")
    assert tokenizer_view(hub_target, dataset, tmp_path / "v2", {}) == (hub_target, None)


def test_a_planted_link_at_the_tokenizer_view_is_refused_never_written_through(
        tmp_path: Path) -> None:
    """Before: RUN/hub-view as a link to another folder was emptied silently in vain
    (rmtree(ignore_errors=True) on a link), then the hub layout was made inside the link's
    target, and a second run ended in FileExistsError (70). Now the link is refused (34) and
    the target is left as it was; a view of this run's own is rebuilt each time."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    target = AgenticTarget("http://127.0.0.1:1", "m", str(folder))
    trace = TraceSource("file", path=tmp_path / "t.jsonl")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    view = tmp_path / "run" / "hub-view"
    view.parent.mkdir()
    view.symlink_to(victim)
    for _ in range(2):
        with pytest.raises(UnsafeState) as info:
            tokenizer_view(target, trace, view, {})
        assert info.value.exit_code == 34 and str(view) in info.value.message
    assert sorted(p.name for p in victim.iterdir()) == ["keep"]
    view.unlink()
    for _ in range(2):  # the run's own view: emptied and made again, no FileExistsError
        moved, made = tokenizer_view(target, trace, view, {})
        assert moved.tokenizer == LOCAL_TOKENIZER_REPO and made == view and not view.is_symlink()
        assert (view / "models--m3patch-local--tokenizer" / "refs" / "main").read_text() == "local"


@pytest.mark.skipif(os.environ.get("M3PATCH_SKIP_SERVE") == "1",
                    reason="M3PATCH_SKIP_SERVE=1: AIPerf's venv is set up with the servers'")
def test_aiperf_synthesizes_the_shipped_manifest_the_same_for_a_seed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real AIPerf 0.13.0: two syntheses into two empty caches give the same bytes, which pass
    the row checks: 6 sessions of 3 turns sharing the manifest's 128-token prefix (hash 0-7)."""
    made = []
    for name in ("a", "b"):
        monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / name))
        made.append(synthesized(trace_of(MANIFEST, sessions=6), str(AIPERF_PYTHON)))
    assert made[0].data == made[1].data and made[0].sha256 == made[1].sha256
    assert (made[0].summary.rows, made[0].summary.sessions) == (18, 6)
    firsts = [json.loads(line) for line in made[0].data.splitlines()
              if b'"timestamp"' in line]
    assert len(firsts) == 6 and all(row["hash_ids"][:8] == list(range(8)) for row in firsts)


def test_the_agentic_codes_are_unique_and_in_both_tables() -> None:
    from m3patch import errors

    codes = [cls.exit_code for cls in errors.ALL_ERRORS]
    assert len(codes) == len(set(codes))
    doc = (REPO / "docs" / "exit-codes.md").read_text()
    for cls, code in ((errors.AgenticClientError, 31), (errors.KvOffloadError, 32),
                      (AgenticTraceError, 40)):
        assert cls in errors.ALL_ERRORS and cls.exit_code == code
        assert re.search(rf"^\| {code} +\| {cls.__name__} ", doc, re.M), cls.__name__
        assert re.search(rf"^\| {code} +\| {cls.__name__} ", errors.__doc__ or "", re.M)


def test_resume_keeps_a_cell_only_for_the_trace_it_replayed(tmp_path: Path) -> None:
    """An edited manifest keeps its name (the cell's trace label) but not its sessions: a resumed
    run measures the cell again instead of mixing two traces in one table."""
    from m3patch.bench.agentic.results import cell_document, finished
    from m3patch.bench.agentic.scoring import score
    from m3patch.bench.cells import AgenticCell, Parallelism
    from m3patch.bench.results import write_result
    from m3patch.bench.runner import all_finished
    from m3patch.recipe.agentic import KvOffload

    cell = AgenticCell(Parallelism(tp=1), 2, KvOffload(), trace_of(MANIFEST).label, None, 3, 0)
    record = {"metadata": {"benchmark_phase": "profiling", "request_start_ns": 0,
                           "request_end_ns": 10**9},
              "metrics": {"request_latency": {"value": 1000.0, "unit": "ms"},
                          "time_to_first_token": {"value": 50.0, "unit": "ms"},
                          "inter_token_latency": {"value": 10.0, "unit": "ms"},
                          "output_sequence_length": {"value": 10, "unit": "tokens"},
                          "input_sequence_length": {"value": 100, "unit": "tokens"}},
              "error": None}
    key = synthesize.trace_key(trace_of(MANIFEST))
    assert key and key == cache_key(trace_of(MANIFEST), MANIFEST.read_bytes())
    document = cell_document(cell, score([record], 1), {"aiperf_version": "0.13.0"},
                             provenance={"agentic_trace": {"key": key}}, client_seconds=1.0,
                             aiperf_version="0.13.0", artifacts="raw/x", dram_gb=0)
    path = tmp_path / "cells" / f"{cell.cell_id}.json"
    path.parent.mkdir()
    write_result(path, document)
    assert finished(path, cell, key) and finished(path, cell)
    assert not finished(path, cell, "another-manifest")
    assert all_finished(tmp_path, [cell], None, key)
    assert not all_finished(tmp_path, [cell], None, synthesize.trace_key(trace_of(tmp_path / "x")))
