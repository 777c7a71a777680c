"""InferenceX result rows read as aggregate rows, so `bench compare` takes one as either side.

InferenceX's aggregation step writes one row per job, `agg_<name>.json` (format and source:
docs/inferencex-fields.md); a collection of them is a JSON array of such rows. Only single-node
rows are read: a multi-node row's prefill/decode split has no m3patch shape to be compared with.
Rows are validated like any file the tool reads back; the first problem names the file and key.

An InferenceX row does not record its length distribution; InferenceX's benchmark_lib.sh runs
its client with `--random-range-ratio 0.8` ([int(0.8 L), L]), so a row reads as
`length_convention: inferencex, range_ratio: 0.8`: the same workload as an m3patch cell whose
recipe says `inferencex-range-ratio: 0.8` (the GPU default), and another shape beside any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m3patch.bench.cells import Parallelism
from m3patch.bench.results import invalid
from m3patch.recipe.lengths import INFERENCEX
from m3patch.schema import short_repr

INFERENCEX_RANGE_RATIO = 0.8  # benchmark_lib.sh run_benchmark_serving: --random-range-ratio 0.8
SOURCE_HINT = "an InferenceX agg_*.json row, or a JSON array of them"
# Keys that mark an object as an InferenceX row rather than an m3patch aggregate.
SIGNATURE = ("conc", "hw", "tput_per_gpu")
INTEGER_KEYS = ("conc", "isl", "osl", "tp", "ep")
OPTIONAL_SIZES = ("pp", "dcp_size", "pcp_size")


def is_inferencex(data: object) -> bool:
    """An InferenceX row or a non-empty array of objects (m3patch aggregates carry `schema`)."""
    if isinstance(data, list):
        return bool(data) and all(isinstance(item, dict) for item in data)
    return isinstance(data, dict) and "schema" not in data and all(k in data for k in SIGNATURE)


def inferencex_aggregate(data: dict[str, Any] | list[Any], file: Path) -> dict[str, Any]:
    """An aggregate (schema-less: meta + rows) from one InferenceX row or an array of them."""
    items = data if isinstance(data, list) else [data]
    rows = [row_of(item, f"[{index}]" if isinstance(data, list) else "", file)
            for index, item in enumerate(items)]
    first = items[0]
    title = " ".join(str(first.get(key)) for key in ("hw", "framework", "precision") if first.get(key))
    return {"recipe_name": f"InferenceX {title}".strip(), "series": None, "rows": rows}


def row_of(item: dict[str, Any], where: str, file: Path) -> dict[str, Any]:
    """One m3patch-shaped row: InferenceX's keys kept, m3patch's shape keys added (pure)."""
    at = f"{where}." if where else ""
    if item.get("is_multinode") is True or item.get("disagg") is True:
        raise invalid(file, f"{at}is_multinode", "a multi-node or disaggregated row has no "
                      "single-node shape to compare; give a single-node row")
    values = {key: _integer(item, key, f"{at}{key}", file) for key in INTEGER_KEYS}
    # Rows from before InferenceX recorded them ran PP1 without context parallelism.
    sizes = {key: _integer({key: 1, **item}, key, f"{at}{key}", file) for key in OPTIONAL_SIZES}
    par = Parallelism(tp=values["tp"], ep=values["ep"], pp=sizes["pp"],
                      dp_attention=_flag(item.get("dp_attention"), f"{at}dp_attention", file))
    # InferenceX's divisor: TP x PP x PCP (process_result.py, single node).
    gpus = par.tp * par.pp * sizes["pcp_size"]
    return {
        **item, "isl": values["isl"], "osl": values["osl"], "tp": par.tp, "ep": par.ep,
        "pp": par.pp, "dp": par.dp, "dp_attention": par.dp_attention,
        "range_ratio": INFERENCEX_RANGE_RATIO, "length_convention": INFERENCEX,
        "concurrency": values["conc"], "gpu_count": gpus, "parallelism": par.label,
        "isl_convention": isl_convention(item),
        "cell_id": f"inferencex-isl{values['isl']}-osl{values['osl']}-{par.slug}-c{values['conc']}",
    }  # fmt: skip


def isl_convention(item: dict[str, Any]) -> str:
    """InferenceX's speculative-decoding scripts must pass --use-chat-template (its AGENTS.md
    and PR review rules): their ISL counts the chat template; the others' does not."""
    spec = item.get("spec_decoding")
    return "chat-template" if isinstance(spec, str) and spec.lower() not in ("", "none") else "prompt"


def _integer(item: dict[str, Any], key: str, where: str, file: Path) -> int:
    """A positive integer; InferenceX writes isl/osl from the environment, so "1024" is accepted."""
    value = item.get(key)
    # ASCII digits only: "²".isdigit() is true and int("²") raises
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 12:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(file, where, f"expected a positive integer, got {short_repr(value)}")
    return value


def _flag(value: object, where: str, file: Path) -> bool:
    """InferenceX copies DP_ATTENTION from the environment: "true"/"false", or a JSON bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise invalid(file, where, f"expected true or false, got {value!r}")
