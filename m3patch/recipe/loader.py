"""Recipe YAML -> frozen `Recipe`: the top-level keys, each section parsed by its subject's module.

Sections by subject: target.py (what to serve: target, model, speculative), launch.py (how to
launch: server, parallelism, env, vllm-args -> argv), gates.py (markers, counts, waivers),
sweep.py (what to sweep), deadlines.py, evals.py (the accuracy gate), inferencex.py (the
identity InferenceX keys results by); paths.py expands `~` and `${VAR:-default}`.
Strict: unknown keys are errors with a suggestion, every error names the file and key path.
`series` is relative to the recipe file. The argv is resolved here (pure); starting the process
is the supervisor's job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from m3patch.fsio import path_is
from m3patch.markers import MarkerSpec
from m3patch.recipe import gates, launch
from m3patch.recipe import target as served
from m3patch.recipe.deadlines import Deadlines, deadlines
from m3patch.recipe.evals import EvalSpec, evals
from m3patch.recipe.inferencex import Identity, identity
from m3patch.recipe.launch import Parallelism, flatten_vllm_args
from m3patch.recipe.paths import expand, expand_vars
from m3patch.recipe.sweep import Sweep, SweepRow, check_lengths_fit, doubling, sweep
from m3patch.recipe.target import ModelSpec, Target
from m3patch.recipe.topology import Topology, check_placeholders, topology
from m3patch.schema import SchemaError, at_key, check_keys, expect_mapping, expect_str, in_file
from m3patch.shipped import shipped_dir
from m3patch.yamlio import load_yaml_file

TOP_KEYS = ("description", "server", "parallelism", "vllm-args", "env", "speculative", "markers",
            "deadlines", "results", "topology", "eval", "inferencex")
T = TypeVar("T")


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
    topology: Topology | None = None  # a multi-node set (recipe/topology.py); None: one server
    eval: EvalSpec | None = None  # the accuracy gate (recipe/evals.py); None: no eval step
    vllm_args_raw: tuple[tuple[str, Any], ...] = ()  # as written: regions merge over it
    inferencex: Identity | None = None  # InferenceX's result identity (recipe/inferencex.py)
    # A topology node's launch (cluster.node_plan.role_recipes): the role whose vllm-args and env
    # follow the recipe's own, so the launch check names the role's keys by the role
    launch_role: str | None = None

    def serve_args(self) -> tuple[str, ...]:
        """Arguments after `vllm serve` (the model first, as the CLI wants it)."""
        spec = ("--speculative-config", self.speculative_json) if self.speculative_json else ()
        pin = ("--revision", self.model.revision) if self.model.revision else ()
        return (self.model.source, "--host", self.host, "--port", str(self.port),
                "--served-model-name", self.model.served_name, *pin,
                *self.parallelism.argv(), *spec, *self.vllm_args)


def _section(data: dict[str, Any], key: str, parse: Callable[[dict[str, Any]], T]) -> T:
    with at_key(key):
        return parse(expect_mapping(data.get(key, {})))


def _series_dir(path: Path, text: str) -> Path:
    """`series:` is a folder relative to the recipe, or the name of a shipped series
    (`vllm-0.33.0`, as `m3patch series list` prints it) when no such folder is there."""
    named = expand_vars(text)  # as written: `./vllm-0.33.0` is a path, `vllm-0.33.0` a name
    relative = (path.parent / expand(text)).resolve()
    shipped = shipped_dir("patches")
    # a folder beside the recipe wins only when it is a series: an unpacked vLLM sdist or an
    # empty folder of that name must not hide the shipped series
    if "/" not in named and not named.startswith("~") \
            and not path_is(relative / "series.yaml", "file") \
            and shipped is not None and path_is(shipped / named / "series.yaml", "file"):
        return (shipped / named).resolve()
    if not path_is(relative / "series.yaml", "file"):
        _no_series(text, relative, shipped)
    return relative


def _no_series(text: str, relative: Path, shipped: Path | None) -> None:
    """A recipe copied out of a checkout keeps its `../patches/NAME`: say what to write."""
    names = sorted(p.name for p in shipped.iterdir()
                   if path_is(p / "series.yaml", "file")) if shipped is not None else []
    msg = f"{text!r} is no series folder (no series.yaml in {relative})"
    if relative.name in names:
        msg += (f"; write `series: {relative.name}` for the series of that name that ships with "
                "m3patch (a name works wherever the recipe is)")
    else:
        listed = ", ".join(names) or "none"
        msg += (f"; give a folder holding series.yaml, relative to the recipe, or the name of a "
                f"shipped series ({listed})")
    raise SchemaError(msg)



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
        series_dir = _series_dir(path, expect_str(data["series"]))
    model = _section(data, "model", served.model)
    spec = _section(data, "speculative", dict)
    with at_key("speculative"):
        spec_json = served.speculative_json(spec, model.draft)
    with at_key("results"):
        results = Path(expand(expect_str(data.get("results", f"results/{name}"))))
    marker_gates = _section(data, "markers", partial(gates.markers, source=f"recipe {path}"))
    host, port = _section(data, "server", launch.server)
    goal = _section(data, "target", served.target)
    platform = goal.platform
    stated = any(str(key).replace("_", "-") == "max-model-len"
                 for key in expect_mapping(data.get("vllm-args", {})))
    swept = _section(data, "sweep", partial(sweep, gpu=platform != "cpu", base=path.parent,
                                            sized_by_recipe=stated or "topology" in data,
                                            speculative=spec_json is not None))
    check_lengths_fit(swept, data.get("vllm-args"))
    if swept.agentic is not None and swept.agentic.speculative and spec_json is None:
        with at_key("sweep"), at_key("speculative"):
            msg = "overrides a speculative config the recipe does not have (add `speculative:`)"
            raise SchemaError(msg)
    nodes = _section(data, "topology", partial(topology, source=f"recipe {path}"))
    parallel = _section(data, "parallelism", launch.parallelism)
    env = _section(data, "env", launch.env)
    with at_key("env"):
        if nodes is not None:
            check_placeholders(env)  # a node fills in its own @{address}, @{interface}, ...
        elif any("@{" in value for _key, value in env):
            msg = "@{...} node values exist only in a recipe with a `topology:` section"
            raise SchemaError(msg)
    if nodes is not None:
        _check_topology_fits(data, parallel, marker_gates.counts)
    return Recipe(
        name=name, path=path, description=str(data.get("description", "")).strip(),
        target=goal, series_dir=series_dir, model=model,
        host=host, port=port, parallelism=parallel,
        vllm_args=_section(data, "vllm-args", flatten_vllm_args),
        env=env, speculative_json=spec_json,
        sweep=swept, markers=marker_gates.markers, marker_counts=marker_gates.counts,
        marker_waivers=marker_gates.waivers,
        deadlines=_section(data, "deadlines", deadlines), results_dir=results, topology=nodes,
        eval=_section(data, "eval", partial(evals, base=path.parent)),
        vllm_args_raw=tuple(expect_mapping(data.get("vllm-args", {})).items()),
        inferencex=_section(data, "inferencex", partial(
            identity, platform=platform, model=model.source, target_image=goal.image,
            vllm_args=data.get("vllm-args"))),
    )


def _check_topology_fits(data: dict[str, Any], parallel: Parallelism,
                         counts: tuple[tuple[str, int], ...]) -> None:
    """With a topology, DP comes from its roles and counts from its per-worker role markers."""
    if parallel.dp > 1 or parallel.dp_attention:
        with at_key("parallelism"):
            msg = "with a topology, data parallelism comes from its roles (nodes x local-dp)"
            raise SchemaError(msg)
    with at_key("markers"):
        own = [m for m in expect_mapping(data.get("markers", {})).get("required", []) or []
               if isinstance(m, dict) and "count" in m]
        if own or counts:
            msg = ("with a topology, counts go on the roles' markers (per worker process); the "
                   "recipe's markers apply to every node without a count")
            raise SchemaError(msg)


__all__ = ["Deadlines", "ModelSpec", "Parallelism", "Recipe", "Sweep", "SweepRow", "Target",
           "doubling", "expand", "load_recipe"]
