"""Summarize the recorded judge runs on the H200 (docs/results/tune-h200/judge/) as Markdown.

Every number in the output is read from the recorded JSON of the device calls (call1 ran the
judge without a warm-up round, call2 and call3 with one); none is typed in.

    python3 scripts/measure/h200/summarize_judge_runs.py docs/results/tune-h200 > docs/results/tune-h200/judge/SUMMARY.md
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

EP8 = "E=16,N=3072,K=6144,topk=4,dtype=fp8_w8a8,block=128x128,ep"


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _rows(path: Path) -> list[dict[str, Any]]:
    data = _load(path)
    rows: list[dict[str, Any]] = data.get("per_batch") or data["rows"]
    return rows


def _env(call: Path) -> str:
    lines = (call / "env.txt").read_text(encoding="utf-8").splitlines()
    gpu = lines[1].split(",")[0] if len(lines) > 1 else "?"
    return f"{gpu}; {'; '.join(line for line in lines[2:] if line)}"


def _verdicts(rows: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    return ", ".join(f"{counts[v]} {v}" for v in ("wins", "tie", "same", "loses") if v in counts)


def _losing(rows: list[dict[str, Any]]) -> str:
    lost = [f"M={r['batch']} {r['ratio']:.3f}" for r in rows if r["verdict"] == "loses"]
    return "; ".join(lost) or "none"


def checks_table(root: Path) -> list[str]:
    out = ["| call | check | routing | verdicts | losing entries (t/d) |",
           "|---|---|---|---|---|"]
    for call in sorted((root / "judge").glob("call*")):
        for path in sorted(call.glob("check-*.json")):
            data = _load(path)
            routing = "ep-rank" if data["routing"].startswith("the routing one") else "benchmark"
            out.append(f"| {call.name} | {path.stem[6:]} | {routing} | "
                       f"{_verdicts(data['per_batch'])} | {_losing(data['per_batch'])} |")
    return out


def warmup_evidence(root: Path) -> list[str]:
    """How slow the first timing of a batch was against the median of the rounds."""
    out = ["| call | file | first timing / median of the rounds: median over batches (min..max) |",
           "|---|---|---|"]
    for call in sorted((root / "judge").glob("call*")):
        for path in sorted(call.glob("check-*.json")):
            ratios = []
            for row in _rows(path):
                if row.get("warmup_us"):
                    first = row["warmup_us"][0]
                else:  # no warm-up round: the first round's first slot (the tuned config)
                    first = row["tuned_rounds_us"][0]
                    rest = row["tuned_rounds_us"][1:]
                    ratios.append(first / statistics.median(rest))
                    continue
                ratios.append(first / row["tuned_us"])
            out.append(f"| {call.name} | {path.stem} | {statistics.median(ratios):.3f} "
                       f"({min(ratios):.3f}..{max(ratios):.3f}) |")
    return out


def old_vs_judge(root: Path) -> list[str]:
    """The EP8 tuned configs the first tables held: the old bench's t/d vs the judge's."""
    old = {r["batch"]: r for r in _rows(root / "bench.json") if r["shape"] == EP8}
    new = {r["batch"]: r for r in _rows(root / "judge/call2/check-ep8-tunedraw-bench.json")}
    out = ["| M | config | old bench t/d (bench.json) | judge t/d | judge noise | verdict |",
           "|---|---|---|---|---|---|"]
    for batch in sorted(new):
        row = new[batch]
        assert old[batch]["tuned_config"] == row["tuned_config"], batch
        out.append(f"| {batch} | {row['tuned_config']} | "
                   f"{old[batch]['tuned_over_default']:.3f} | {row['ratio']:.3f} | "
                   f"{100 * row['noise']:.1f}% | {row['verdict']} |")
    return out


def bench_runs(root: Path) -> list[str]:
    out = ["| call | bench run | shape | verdicts | losing entries | max t/d of non-default "
           "entries | max t/d where the entry is the default |", "|---|---|---|---|---|---|---|"]
    for call in sorted((root / "judge").glob("call*")):
        for path in sorted(call.glob("bench-*run*.json")):
            rows = _rows(path)
            for shape in sorted({r["shape"] for r in rows}):
                mine = [r for r in rows if r["shape"] == shape]
                tuned = [r["ratio"] for r in mine if r["verdict"] != "same"]
                same = [r["ratio"] for r in mine if r["verdict"] == "same"]
                out.append(f"| {call.name} | {path.stem} | {shape.split(',K=')[0]} | "
                           f"{_verdicts(mine)} | {_losing(mine)} | "
                           f"{max(tuned):.3f} | {max(same) if same else float('nan'):.3f} |")
    return out


def main(root: Path) -> None:
    lines = ["# Judge runs on the H200: summary generated from the recorded JSON",
             "", "Generated by `python3 scripts/measure/h200/summarize_judge_runs.py docs/results/tune-h200`.",
             "", "## Devices", ""]
    for call in sorted((root / "judge").glob("call*")):
        lines.append(f"- {call.name}: {_env(call)}")
    lines += ["", "## `tune --check` verdicts per table", "", *checks_table(root),
              "", "## The first timing of each batch (why the judge has a warm-up round)", "",
              *warmup_evidence(root),
              "", "## EP8 tuned configs of the first tables: the old bench vs the judge", "",
              *old_vs_judge(root),
              "", "## Bench runs of the judged tables (t/d = median of per-round ratios)", "",
              *bench_runs(root), ""]
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
