"""Recipe YAML -> frozen `Recipe`: what to patch, how to launch `vllm serve`, what to sweep.

Strict: unknown keys are errors with a suggestion, every error names the file and key path.
Paths may use `~` and `${VAR:-default}`; `series` is relative to the recipe file. The argv is
resolved here (pure); starting the process is the supervisor's job.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from m3patch.markers import MarkerSpec
from m3patch.recipe import sections as sec
from m3patch.recipe.argv import flatten_vllm_args
from m3patch.recipe.sections import Deadlines, ModelSpec, Parallelism, Target, expand
from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_choice,
    expect_int,
    expect_mapping,
    expect_number,
    expect_str,
    in_file,
)
from m3patch.yamlio import load_yaml_file

TOP_KEYS = ("description", "server", "parallelism", "vllm-args", "env", "speculative", "markers",
            "deadlines", "results")
DRAFT_METHODS = ("eagle", "eagle3", "draft_model")
T = TypeVar("T")


@dataclass(frozen=True)
class SweepRow:
    isl: int
    osl: int
    concurrencies: tuple[int, ...]


@dataclass(frozen=True)
class Sweep:
    rows: tuple[SweepRow, ...]
    prompts_per_concurrency: int
    warmups_per_concurrency: int
    range_ratio: float

    def num_prompts(self, concurrency: int) -> int:
        return self.prompts_per_concurrency * concurrency

    def num_warmups(self, concurrency: int) -> int:
        return self.warmups_per_concurrency * concurrency


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    description: str
    target: Target
    series_dir: Path
    model: ModelSpec
    host: str
    port: int
    parallelism: Parallelism
    vllm_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    speculative_json: str | None
    sweep: Sweep
    markers: tuple[MarkerSpec, ...]
    marker_counts: tuple[tuple[str, int], ...]
    marker_waivers: tuple[tuple[str, str], ...]
    deadlines: Deadlines
    results_dir: Path

    def serve_args(self) -> tuple[str, ...]:
        """Arguments after `vllm serve` (the model first, as the CLI wants it)."""
        spec = ("--speculative-config", self.speculative_json) if self.speculative_json else ()
        pin = ("--revision", self.model.revision) if self.model.revision else ()
        return (self.model.source, "--host", self.host, "--port", str(self.port),
                "--served-model-name", self.model.served_name, *pin,
                *self.parallelism.argv(), *spec, *self.vllm_args)


def doubling(start: int, end: int) -> tuple[int, ...]:
    """1..6 -> 1, 2, 4, 6: double from start, clamp the last step to end."""
    out, conc = [], start
    while conc < end:
        out.append(conc)
        conc *= 2
    return (*out, end)


def _sweep_row(raw: object) -> SweepRow:
    data = expect_mapping(raw)
    check_keys(data, required=("isl", "osl"), optional=("concurrency", "conc-start", "conc-end"))
    isl, osl = expect_int(data["isl"], minimum=1), expect_int(data["osl"], minimum=1)
    if ("concurrency" in data) == ("conc-start" in data or "conc-end" in data):
        msg = "give either concurrency: [..] or conc-start and conc-end"
        raise SchemaError(msg)
    if "concurrency" in data:
        with at_key("concurrency"):
            values = data["concurrency"]
            if not isinstance(values, list) or not values:
                msg = "expected a non-empty list of concurrencies"
                raise SchemaError(msg)
            concs = tuple(expect_int(v, minimum=1) for v in values)
        return SweepRow(isl, osl, concs)
    check_keys(data, required=("isl", "osl", "conc-start", "conc-end"))
    start, end = expect_int(data["conc-start"], minimum=1), expect_int(data["conc-end"], minimum=1)
    if start > end:
        msg = f"conc-start {start} is above conc-end {end}"
        raise SchemaError(msg)
    return SweepRow(isl, osl, doubling(start, end))


def _sweep(raw: object) -> Sweep:
    data = expect_mapping(raw)
    check_keys(data, required=("rows",), optional=(
        "prompts-per-concurrency", "warmups-per-concurrency", "range-ratio"))
    rows = []
    with at_key("rows"):
        if not isinstance(data["rows"], list) or not data["rows"]:
            msg = "expected a non-empty list of rows"
            raise SchemaError(msg)
        for index, row in enumerate(data["rows"]):
            with at_key(index):
                rows.append(_sweep_row(row))
    with at_key("range-ratio"):
        # vLLM >= 0.9 samples lengths in [L(1-r), L(1+r)] and rejects r >= 1 at bench time;
        # catch it here, with the recipe key, before any server starts.
        ratio = expect_number(data.get("range-ratio", 0.0), minimum=0.0)
        if ratio >= 1.0:
            msg = f"range-ratio must be in [0, 1), got {ratio}"
            raise SchemaError(msg)
    return Sweep(tuple(rows), expect_int(data.get("prompts-per-concurrency", 10), minimum=1),
                 expect_int(data.get("warmups-per-concurrency", 2), minimum=0), ratio)


def _section(data: dict[str, Any], key: str, parse: Callable[[dict[str, Any]], T]) -> T:
    with at_key(key):
        return parse(expect_mapping(data.get(key, {})))


def load_recipe(path: Path) -> Recipe:
    data = load_yaml_file(path)
    with in_file(path):
        return _build(expect_mapping(data, "a recipe mapping"), path)


def _build(data: dict[str, Any], path: Path) -> Recipe:
    check_keys(data, required=("schema", "name", "series", "model", "target", "sweep"),
               optional=TOP_KEYS)
    with at_key("schema"):
        if data["schema"] != 1:
            msg = f"unsupported schema {data['schema']!r}; this m3patch reads schema 1"
            raise SchemaError(msg)
    with at_key("name"):
        name = expect_str(data["name"])
    with at_key("series"):
        series_dir = (path.parent / expand(expect_str(data["series"]))).resolve()
    model = _section(data, "model", sec.model)
    spec = _section(data, "speculative", dict)
    with at_key("speculative"):
        spec_json = _speculative_json(spec, model.draft)
    with at_key("results"):
        results = Path(expand(expect_str(data.get("results", f"results/{name}"))))
    markers, counts, waivers = _section(data, "markers",
                                        partial(sec.markers, source=f"recipe {path}"))
    host, port = _section(data, "server", sec.server)
    sweep = _section(data, "sweep", _sweep)
    _check_lengths_fit(sweep, data.get("vllm-args"))
    return Recipe(
        name=name, path=path, description=str(data.get("description", "")).strip(),
        target=_section(data, "target", sec.target), series_dir=series_dir, model=model,
        host=host, port=port, parallelism=_section(data, "parallelism", sec.parallelism),
        vllm_args=_section(data, "vllm-args", flatten_vllm_args),
        env=_section(data, "env", sec.env), speculative_json=spec_json,
        sweep=sweep, markers=markers, marker_counts=counts,
        marker_waivers=waivers,
        deadlines=_section(data, "deadlines", sec.deadlines), results_dir=results,
    )


def _check_lengths_fit(sweep: Sweep, vllm_args: object) -> None:
    """Every sampled prompt + output must fit `max-model-len`, or requests fail mid-sweep.

    vLLM's random dataset samples lengths in [L(1-r), L(1+r)] (InferenceX's old vendored
    client used [rL, L]), so the longest request is ceil(isl(1+r)) + ceil(osl(1+r)).
    """
    limit = vllm_args.get("max-model-len") if isinstance(vllm_args, dict) else None
    if isinstance(limit, bool) or not isinstance(limit, int):
        return
    for index, row in enumerate(sweep.rows):
        longest = math.ceil(row.isl * (1 + sweep.range_ratio)) + math.ceil(
            row.osl * (1 + sweep.range_ratio))
        if longest > limit:
            msg = (f"isl {row.isl} + osl {row.osl} with range-ratio {sweep.range_ratio} reach "
                   f"{longest} tokens, over vllm-args.max-model-len {limit}; lower range-ratio "
                   f"or raise max-model-len")
            with at_key("sweep"), at_key("rows"), at_key(index):
                raise SchemaError(msg)


def _speculative_json(spec: dict[str, Any], draft: str | None) -> str | None:
    if not spec:
        if draft is not None:
            msg = "model.draft is set but there is no speculative section to use it"
            raise SchemaError(msg)
        return None
    method = expect_choice(spec.get("method"), ("mtp", *DRAFT_METHODS))
    if method in DRAFT_METHODS:
        if draft is None:
            msg = f"method {method} needs model.draft (the draft model)"
            raise SchemaError(msg)
        if "model" in spec:
            msg = "give the draft model as model.draft, not speculative.model"
            raise SchemaError(msg)
        spec = {"method": method, "model": draft, **{k: v for k, v in spec.items() if k != "method"}}
    return json.dumps(spec, separators=(",", ":"))


def recipe_dir_default() -> Path:
    """The shipped recipes (repo checkout layout: <repo>/recipes)."""
    return Path(__file__).resolve().parent.parent / "recipes"


__all__ = ["Deadlines", "ModelSpec", "Parallelism", "Recipe", "Sweep", "SweepRow", "Target",
           "doubling", "expand", "load_recipe"]
