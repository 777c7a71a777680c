"""Server variants per region of a sweep (pure): which server arguments each cell needs.

A recipe may give `sweep.regions`, each a `when` (bounds on isl, osl and concurrency) with
`vllm-args` / `env` overrides for the cells inside it (InferenceX's MI355X script switches
`--linear-backend emulation` on at ISL >= 8192 and concurrency >= 64), and
`sweep.max-model-len: per-cell` sizes each cell's server as InferenceX does: isl + osl + 256.
Cells whose resulting server is the same form one group (recipe.server_groups); the run starts,
gates and stops one server per group (run.pipeline), and `m3patch matrix --per group` emits one
job per group.

Regions apply in order; a later region's key wins over an earlier one's. m3patch runs its own
loop rather than `vllm bench sweep serve`: every server it starts must come from the verified
tree and pass the marker gate before a cell is measured, which that loop cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from m3patch.recipe.launch import env as parse_env
from m3patch.recipe.launch import flatten_vllm_args
from m3patch.schema import SchemaError, at_key, check_keys, expect_int, expect_list, expect_mapping

BOUNDS = ("isl-min", "isl-max", "osl-min", "osl-max", "conc-min", "conc-max")
PER_CELL = "per-cell"
MAX_MODEL_LEN_MARGIN = 256  # InferenceX: room for chat framing beyond isl + osl


@dataclass(frozen=True)
class Region:
    bounds: tuple[tuple[str, int], ...]
    vllm_args: tuple[tuple[str, Any], ...]  # raw overrides, merged before flattening
    env: tuple[tuple[str, str], ...]

    def matches(self, isl: int, osl: int, conc: int) -> bool:
        values = {"isl": isl, "osl": osl, "conc": conc}
        for key, bound in self.bounds:
            name, side = key.rsplit("-", 1)
            value = values[name]
            if (side == "min" and value < bound) or (side == "max" and value > bound):
                return False
        return True


def regions(raw: object) -> tuple[Region, ...]:
    out = []
    for index, item in enumerate(expect_list(raw)):
        with at_key(index):
            data = expect_mapping(item)
            check_keys(data, required=("when",), optional=("vllm-args", "env"))
            with at_key("when"):
                when = expect_mapping(data["when"])
                check_keys(when, optional=BOUNDS)
                if not when:
                    msg = f"give at least one bound ({', '.join(BOUNDS)})"
                    raise SchemaError(msg)
                bounds = []
                for key in BOUNDS:
                    if key in when:
                        with at_key(key):
                            bounds.append((key, expect_int(when[key], minimum=1)))
                _check_ordered(dict(bounds))
            with at_key("vllm-args"):
                overrides = expect_mapping(data.get("vllm-args", {}))
                flatten_vllm_args(overrides)  # the same rules as the recipe's own vllm-args
            with at_key("env"):
                env = parse_env(expect_mapping(data.get("env", {})))
            if not overrides and not env:
                msg = "a region must override vllm-args or env"
                raise SchemaError(msg)
            out.append(Region(tuple(bounds), tuple(overrides.items()), env))
    return tuple(out)


def _check_ordered(bounds: dict[str, int]) -> None:
    """A min above its max would make a region that matches no cell: refused, not ignored."""
    for dim in ("isl", "osl", "conc"):
        low, high = bounds.get(f"{dim}-min"), bounds.get(f"{dim}-max")
        if low is not None and high is not None and low > high:
            msg = f"{dim}-min {low} is above {dim}-max {high}: the region would match no cell"
            raise SchemaError(msg)
