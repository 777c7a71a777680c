"""Series markers reach every recipe; counts by id; waivers are explicit, reasoned and limited."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from m3patch.errors import M3PatchError, UsageError
from m3patch.markers import check_log_bytes
from m3patch.patching.series import load_series
from m3patch.recipe.loader import load_recipe
from m3patch.serving.launch_plan import all_markers

REPO = Path(__file__).resolve().parents[2]


def gpu_variant(tmp_path: Path, name: str, markers: dict[str, object]) -> Path:
    data = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.33.0")
    data["markers"] = markers
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def by_id(recipe_path: Path) -> dict[str, list[object]]:
    out: dict[str, list[object]] = {}
    for spec in all_markers(load_recipe(recipe_path), None):
        out.setdefault(spec.id, []).append(spec)
    return out


@pytest.mark.parametrize(("name", "count"), [("mi300x_tp8", 57), ("mi300x_tp8_mtp", 58),
                                             ("mi300x_tp8_eagle3", 57), ("mi300x_tp8_ep8", 57)])
def test_gfx942_recipes_require_one_conversion_line_per_moe_layer(name: str, count: int) -> None:
    markers = by_id(REPO / "recipes" / f"{name}.yaml")
    (layer,) = markers["block-fp8-layer"]
    assert layer.kind == "required" and layer.count == count  # type: ignore[attr-defined]
    for forbidden in ("mxfp8-emulation-backend", "mxfp8-emulation-experts", "mxfp8-bf16-dequant"):
        assert markers[forbidden][0].kind == "forbidden"  # type: ignore[attr-defined]
    assert "provenance" in markers


def test_native_gfx950_recipe_requires_the_packed_path_and_aiter_waives_it() -> None:
    native = by_id(REPO / "recipes" / "mi355x_tp4_native.yaml")
    assert native["packed-e8m0"][0].kind == "required"  # type: ignore[attr-defined]
    aiter = by_id(REPO / "recipes" / "mi355x_tp4.yaml")
    assert "packed-e8m0" not in aiter and "unpacked-e8m0" in aiter
    assert "aiter-mxfp8-backend" in aiter


def test_a_waiver_must_name_a_series_marker(tmp_path: Path) -> None:
    path = gpu_variant(tmp_path, "mi300x_tp8", {"waive": {"block-fp8-layr": "typo"}})
    with pytest.raises(UsageError, match="Perhaps you meant 'block-fp8-layer'"):
        all_markers(load_recipe(path), None)


def test_provenance_can_never_be_waived(tmp_path: Path) -> None:
    path = gpu_variant(tmp_path, "mi300x_tp8", {"waive": {"provenance": "not today"}})
    with pytest.raises(UsageError, match="proves the server runs the patched tree"):
        all_markers(load_recipe(path), None)


def test_a_waiver_needs_a_reason(tmp_path: Path) -> None:
    from m3patch.schema import SchemaError

    path = gpu_variant(tmp_path, "mi300x_tp8", {"waive": {"block-fp8-layer": ""}})
    with pytest.raises(SchemaError, match="non-empty string"):
        load_recipe(path)


def test_a_recipe_marker_cannot_hide_a_series_one(tmp_path: Path) -> None:
    # Re-declaring an id adds a second spec; the series one still has to hold.
    extra = {"required": [{"id": "block-fp8-layer", "text": "something else"}]}
    markers = by_id(gpu_variant(tmp_path, "mi300x_tp8", extra))
    assert len(markers["block-fp8-layer"]) == 2


def test_the_mtp_recipe_drafts_with_the_checkpoints_mtp_layer_not_eagle3() -> None:
    # The 58 above is only right for method "mtp": an EAGLE3 draft is dense and adds no MoE layer.
    mtp = load_recipe(REPO / "recipes" / "mi300x_tp8_mtp.yaml")
    eagle3 = load_recipe(REPO / "recipes" / "mi300x_tp8_eagle3.yaml")
    assert mtp.speculative_json is not None and '"method":"mtp"' in mtp.speculative_json
    assert mtp.model.draft is None
    assert eagle3.speculative_json is not None and '"method":"eagle3"' in eagle3.speculative_json


FUSED_MOE = Path("vllm/model_executor/layers/fused_moe")
EMULATION_AB_WAIVERS = ("mxfp8-emulation-backend", "mxfp8-emulation-experts",
                        "mxfp8-bf16-dequant", "block-fp8-layer", "block-fp8-selfcheck")


def _log_formats(source: Path, start: str) -> list[str]:
    """The logger format strings of the real tree that start with `start` (joined if split)."""
    text = re.sub(r'"\s*\n\s*"', "", source.read_text())  # implicit string concatenation
    return re.findall(r'"(' + re.escape(start) + r'[^"]*)"', text)


def _emulation_log(pristine: Path) -> list[str]:
    """What the forced emulation path logs on gfx942, from vLLM 0.33.0's own format strings."""
    backend = _log_formats(pristine / FUSED_MOE / "oracle" / "mxfp8.py", "Using '%s' MxFp8 MoE")
    experts = _log_formats(pristine / FUSED_MOE / "experts" / "mxfp8_emulation_moe.py",
                           "Using Mxfp8EmulationTritonExperts")
    dequant = _log_formats(pristine / "vllm/model_executor/layers/quantization/modelopt.py",
                           "MXFP8->BF16 load-time dequant complete")
    assert len(backend) == 2 and len(experts) == 1 and len(dequant) == 1
    return [*(f % "EMULATION" for f in backend), experts[0], dequant[0] % 128]


def test_the_emulation_marker_matches_the_auto_and_the_forced_line(pristine_033: Path) -> None:
    forced, auto, *_ = _emulation_log(pristine_033)  # in source order
    assert forced.endswith("(user-requested).") and auto.endswith("backend.")
    spec = next(m for m in load_series(REPO / "patches" / "vllm-0.33.0").markers_for(
        "rocm-gfx942") if m.id == "mxfp8-emulation-backend")
    assert spec.kind == "forbidden" and spec.matches(auto) and spec.matches(forced)
    assert not spec.matches(forced.replace("EMULATION", "TRITON"))


def test_an_emulation_ab_recipe_passes_with_the_waivers_the_series_readme_names(
    tmp_path: Path, pristine_033: Path
) -> None:
    readme = (REPO / "patches" / "vllm-0.33.0" / "README.md").read_text()
    assert all(f"`{marker_id}`" in readme for marker_id in EMULATION_AB_WAIVERS)
    log = "\n".join(["m3patch[provenance]: series=vllm-0.33.0 patches=provenance ledger=x",
                     *_emulation_log(pristine_033)]).encode()
    for waived, verdict in ((EMULATION_AB_WAIVERS, None), (EMULATION_AB_WAIVERS[:1], 13),
                            (EMULATION_AB_WAIVERS[:3], 12)):
        path = gpu_variant(tmp_path, "mi300x_tp8", {"waive": {w: "A/B: forced emulation"
                                                               for w in waived}})
        specs = all_markers(load_recipe(path), None)
        if verdict is None:
            check_log_bytes(log, specs, log_name="server.log", hint="-")
            continue
        with pytest.raises(M3PatchError) as info:
            check_log_bytes(log, specs, log_name="server.log", hint="-")
        assert info.value.exit_code == verdict, waived
