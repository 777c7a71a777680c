"""What makes two result rows the same cell: the workload's shape (and its concurrency).

Shared by the aggregate's check (one row per cell) and compare (which cells meet), so the two
can never disagree on what a cell is.
"""

from __future__ import annotations

from typing import Any

from m3patch.recipe.lengths import VLLM

# range_ratio too: another length distribution is another workload, not a speedup.
# isl_convention too: an ISL that counts the chat template is another input than one that does not.
SHAPE_FIELDS = ("isl", "osl", "range_ratio", "length_convention", "isl_convention", "tp", "pp",
                "ep", "dp", "dp_attention", "gpu_count")
# An agentic row's shape adds the scenario, its KV-offload tier and the trace it replayed; a
# fixed-length row has none of them (null), so the two never match each other.
AGENTIC_SHAPE_FIELDS = ("scenario_type", "kv_offload_label", "trace")


def shape(row: dict[str, Any]) -> tuple[Any, ...]:
    # Rows written before the convention was recorded used vLLM's.
    filled = {**row, "length_convention": row.get("length_convention") or VLLM,
              "isl_convention": row.get("isl_convention") or "prompt"}
    return (*(filled.get(field) for field in SHAPE_FIELDS),
            *(row.get(field) for field in AGENTIC_SHAPE_FIELDS))
