"""Marker matching on streamed server output: split lines, split UTF-8, counts, verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3patch.errors import MarkerForbidden, MarkerMissing, UsageError
from m3patch.markers import MarkerChecker, MarkerSpec, check_log_bytes, merge_markers
from m3patch.patching.series import load_series
from m3patch.recipe.loader import load_recipe
from m3patch.serving.launch_plan import series_markers

REPO = Path(__file__).resolve().parents[2]

MOE = "(Worker pid=7) INFO 11-29 10:02:16 [unquantized.py:529] Using CPUUnquantizedExperts MoE backend"
PROV = "(APIServer pid=5) INFO [m3patch_provenance.py:50] m3patch[provenance]: series=vllm-0.32.0 patches=provenance ledger=sha256:ab"
SPECS = (
    MarkerSpec("provenance", "required", "m3patch[provenance]: series=vllm-0.32.0 ", "patch p"),
    MarkerSpec("moe", "required", "Using CPUUnquantizedExperts MoE backend", "recipe r", 1),
    MarkerSpec("emulation", "forbidden", "regex:Using '?EMULATION'? .*MoE", "patch q"),
)


def test_lines_split_across_writes_match_once_whole() -> None:
    checker = MarkerChecker(SPECS)
    data = f"{PROV}\n{MOE}\n".encode()
    for index in range(len(data)):  # one byte at a time: every possible split point
        assert checker.feed(data[index:index + 1]) == []
    checker.finish()
    assert checker.counts == {"provenance": 1, "moe": 1}
    assert checker.missing() == []
    assert checker.first_hit["moe"].line_no == 2


def test_utf8_split_inside_a_character_is_not_mangled() -> None:
    spec = MarkerSpec("logo", "required", "█▄█▀ █", "recipe r")
    checker = MarkerChecker((spec,))
    data = "INFO  █▄█▀ █     █  model\n".encode()
    cut = data.index("▄".encode()) + 1
    checker.feed(data[:cut])
    checker.feed(data[cut:])
    assert checker.counts == {"logo": 1}


def test_last_line_without_newline_counts_at_finish() -> None:
    checker = MarkerChecker(SPECS)
    checker.feed(MOE.encode())
    assert checker.counts == {}
    checker.finish()
    assert checker.counts == {"moe": 1}


def test_forbidden_regex_hit_is_returned_immediately_with_its_line() -> None:
    checker = MarkerChecker(SPECS, log_name="run/server.log")
    hits = checker.feed(b"noise\r\nINFO Using 'EMULATION' MxFp8 MoE backend.\r\n")
    assert [h.marker.id for h in hits] == ["emulation"]
    with pytest.raises(MarkerForbidden) as info:
        checker.raise_if_forbidden(hint="fix it")
    message = str(info.value)
    assert "'emulation'" in message and "patch q" in message
    assert "run/server.log:2: INFO Using 'EMULATION' MxFp8 MoE backend." in message
    assert info.value.exit_code == 13


def test_wrong_count_and_absence_are_both_named() -> None:
    data = f"{MOE}\n{MOE}\n".encode()
    with pytest.raises(MarkerMissing) as info:
        check_log_bytes(data, SPECS, log_name="server.log", hint="h")
    message = str(info.value)
    assert "'provenance'" in message and "never appeared" in message
    assert "'moe'" in message and "appeared 2 times, expected 1" in message
    assert info.value.exit_code == 12


def test_forbidden_wins_over_missing_in_a_saved_log() -> None:
    with pytest.raises(MarkerForbidden):
        check_log_bytes(b"Using EMULATION fp8 MoE\n", SPECS, log_name="l", hint="h")


def test_recipe_counts_apply_by_id_and_recipes_only_add() -> None:
    series = (SPECS[0], MarkerSpec("layer", "required", "m3patch[mxfp8->block_fp8]: ", "patch b"))
    recipe = (MarkerSpec("layer", "required", "other text", "recipe r"),)
    merged = merge_markers(series, recipe, {"layer": 58})
    assert [(m.id, m.count) for m in merged] == [("provenance", None), ("layer", 58), ("layer", None)]
    with pytest.raises(UsageError, match="no patch or recipe declares"):
        merge_markers(series, recipe, {"layr": 3})


def test_the_series_loader_builds_the_one_marker_type() -> None:
    recipe = load_recipe(REPO / "recipes" / "mi300x_tp8.yaml")
    series = load_series(recipe.series_dir)
    from_series = series_markers(recipe)
    assert from_series == series.markers_for("rocm-gfx942")  # no conversion between two shapes
    assert all(isinstance(m, MarkerSpec) for m in from_series)
    layer = next(m for m in from_series if m.id == "block-fp8-layer")
    assert layer.kind == "required" and layer.platforms == ("rocm-gfx942",)
    assert layer.declared_by == f"patch block-fp8-moe in {recipe.series_dir / 'series.yaml'}"
    assert layer.matches("x m3patch[mxfp8->block_fp8]: model.layers.0.mlp.experts: ...")


def test_a_forbidden_marker_before_the_stop_mark_still_fails_a_saved_log() -> None:
    from m3patch.markers import STOP_MARK

    data = f"Using EMULATION fp8 MoE\n{STOP_MARK}\n".encode()
    with pytest.raises(MarkerForbidden):
        check_log_bytes(data, SPECS, log_name="l", hint="h")
    after = f"{PROV}\n{MOE}\n{STOP_MARK}\r\nUsing EMULATION fp8 MoE\n{MOE}\n".encode()
    checker = check_log_bytes(after, SPECS, log_name="l", hint="h")  # passes: judged up to it
    assert checker.counts == {"provenance": 1, "moe": 1}  # the count of 1 still holds
    assert checker.after_stop == {"emulation": 1, "moe": 1}
    assert checker.stopped_at == 3
