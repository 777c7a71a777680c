"""A perf-changelog.yaml entry from a comparison (pure): `bench compare BASE NEW --changelog-entry`.

The entry names the NEW run's recipe as its config key, states what was compared, and gives the
headline deltas per sequence and parallelism in InferenceX's vocabulary (the labels of its
compare_results.py: TPUT/GPU, Intvty Median, TTFT P99, E2EL Median; ISL/OSL as 1k1k), each as
the range of changes over the concurrencies both sides measured with the same shape. The
pr-link is InferenceX's placeholder XXX, which `changelog check` accepts until the PR exists.
"""

from __future__ import annotations

import json
from typing import Any

from m3patch.bench.compare import Comparison, compare_rows

# (metric, InferenceX's label): the headline metrics of its comparison table.
HEADLINES = (("tput_per_gpu", "TPUT/GPU"), ("median_intvty", "Intvty Median"),
             ("p99_ttft", "TTFT P99 (lower is better)"),
             ("median_e2el", "E2EL Median (lower is better)"))
HEADLINE_METRICS = tuple(metric for metric, _ in HEADLINES)
PLACEHOLDER = "XXX"


def changelog_entry(base: dict[str, Any], new: dict[str, Any], recipe_key: str) -> str:
    """The entry's YAML text (one list item, starting at column 0 with `- `)."""
    results = [(label, compare_rows(base["rows"], new["rows"], metric))
               for metric, label in HEADLINES]
    lines = [f"{_who(base)} -> {_who(new)}"]
    lines += _deltas(results) or ["no cell of the same shape on both sides: no delta to state"]
    description = "\n".join(f"    - {json.dumps(line, ensure_ascii=False)}" for line in lines)
    return (f"- config-keys:\n    - {recipe_key}\n  description:\n{description}\n"
            f"  pr-link: {PLACEHOLDER}\n")


def _who(agg: dict[str, Any]) -> str:
    rows = agg["rows"]
    first = rows[0] if rows else {}
    ident = " ".join(str(first[k]) for k in ("hw", "framework", "precision") if first.get(k))
    series = agg.get("series") or (first.get("series") if first else None)
    name = agg.get("recipe_name") or "?"
    return f"{name} ({ident or 'no identity'}; series {series or 'none'})"


def _deltas(results: list[tuple[str, Comparison]]) -> list[str]:
    """One line per sequence + parallelism: each headline's change range, where measured."""
    groups: dict[tuple[str, str], list[str]] = {}
    concs: dict[tuple[str, str], list[int]] = {}
    for label, result in results:
        by_group: dict[tuple[str, str], list[float]] = {}
        for cell in result.compared:
            key = (_seq(cell.seq), cell.parallelism)
            concs.setdefault(key, [])
            if cell.concurrency not in concs[key]:
                concs[key].append(cell.concurrency)
            if cell.change_pct is not None:
                by_group.setdefault(key, []).append(cell.change_pct)
        for key, changes in by_group.items():
            groups.setdefault(key, []).append(f"{label} {_range(changes)}")
    out = []
    for key, parts in groups.items():
        seq, par = key
        conc = sorted(concs[key])
        span = f"conc {conc[0]}" if len(conc) == 1 else f"conc {conc[0]}-{conc[-1]}"
        out.append(f"{seq} {par} ({span}): {', '.join(parts)}")
    return out


def _seq(label: str) -> str:
    """compare's `1K/1K` as InferenceX writes it (1k1k); other lengths as isl/osl."""
    if "K/" in label and label.endswith("K"):
        return label.replace("K/", "k").replace("K", "k")
    return label


def _range(changes: list[float]) -> str:
    low, high = min(changes), max(changes)
    return f"{low:+.1f}%" if abs(high - low) < 0.05 else f"{low:+.1f}% to {high:+.1f}%"
