"""Generate docs/results/tune-h200/small-batch/SUMMARY.md from the recorded JSON of the
small-batch device calls (so the page states no number that is not in a recorded file).

    python3 scripts/measure/h200/summarize_small_batch.py docs/results/tune-h200/small-batch
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from m3patch.tune.small_batch import FLOOR_TARGET, time_at_target


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _err(value: object) -> str:
    return f"{value:.2e}" if isinstance(value, float) else "FAILED"


def sweep_section(name: str, run: dict[str, Any]) -> list[str]:
    lines = [f"### {name}: `{run['command']}`", "",
             f"{run['configs']} configs per batch size; kernel `{run['kernel_origin']}` "
             f"(sha256 {run['kernel_sha256'][:12]}...); floor = weight + scale bytes of the "
             f"experts hit / {run['floor_bandwidth_Bps'] / 1e12:.1f} TB/s.", "",
             "| M | pick | config | us | % of floor | GEMM1 us | GEMM2 us | GEMM1 programs | "
             "t/d vs default | noise | verdict | rel err | rel err, fresh seed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for batch, entry in run["batches"].items():
        for d in entry["details"]:
            j = d["judge"]
            lines.append(
                f"| {batch} | {d['label']} | {d['config']} | {d['us']:.2f} | "
                f"{100 * d['floor_fraction']:.1f} | {d['gemm1_us']:.2f} | {d['gemm2_us']:.2f} | "
                f"{d['gemm1_programs']} | {j['ratio']:.3f} | {100 * j['noise']:.1f}% | "
                f"{j['verdict']} | {_err(d['rel_err'])} | {_err(d['rel_err_fresh_seed'])} |")
    lines.append("")
    lines.append("| M | floor us | 70 % of floor needs us | pure read, 2 launches, us (TB/s) | "
                 "configs failed |")
    lines.append("|---|---|---|---|---|")
    for batch, entry in run["batches"].items():
        read = entry["read"]
        lines.append(f"| {batch} | {entry['floor_us']:.2f} | "
                     f"{time_at_target(entry['floor_us'], FLOOR_TARGET):.2f} | "
                     f"{read['read_us']:.2f} ({read['read_bandwidth_Bps'] / 1e12:.2f}) | "
                     f"{len(entry['failed'])} |")
    floor = run["launch_floor"]
    lines += ["", "Launch floor (empty kernels, same graph-replay timing, us per pass): "
              + ", ".join(f"{k} {v:.2f}" for k, v in floor.items()), ""]
    return lines


def bounds_section(run: dict[str, Any]) -> list[str]:
    lines = [f"### Bounds: `{run['command']}`", "",
             "| M | floor us | best pure read us (TB/s, launches, block words x iters) |",
             "|---|---|---|"]
    for batch, entry in run["batches"].items():
        best = min(entry["reads"], key=lambda r: r["read_us"])
        lines.append(f"| {batch} | {entry['floor_us']:.2f} | {best['read_us']:.2f} "
                     f"({best['read_bandwidth_Bps'] / 1e12:.2f}, {best['launches']}, "
                     f"{best['block_words']} x {best['iters']}) |")
    lines += ["", "| M | config | GEMM1 us | GEMM2 us | pass us | rel err |",
              "|---|---|---|---|---|---|"]
    for batch, entry in run["batches"].items():
        for g in entry["gemms"]:
            if "error" in g:
                lines.append(f"| {batch} | {g['config']} | FAILED | | | |")
                continue
            lines.append(f"| {batch} | {g['config']} | {g['gemm1_us']:.2f} | "
                         f"{g['gemm2_us']:.2f} | {g['pass_us']:.2f} | {g['rel_err']:.2e} |")
    floor = run["launch_floor"]
    lines += ["", "Launch floor: " + ", ".join(f"{k} {v:.2f}" for k, v in floor.items()), ""]
    return lines


def checks_section(folder: Path) -> list[str]:
    lines = ["### `tune --check` of the split-K table (call2, two processes)", "",
             "| run | M | entry | t/d | noise | verdict |", "|---|---|---|---|---|---|"]
    for path in sorted(folder.glob("call2/check-tp8-run*.json")):
        for row in _load(path)["per_batch"]:
            if row["batch"] <= 8:
                lines.append(f"| {path.stem} | {row['batch']} | {row['tuned_config']} | "
                             f"{row['ratio']:.3f} | {100 * row['noise']:.1f}% | "
                             f"{row['verdict']} |")
    return [*lines, ""]


def bench_section(path: Path) -> list[str]:
    bench = _load(path)
    lines = [f"### Bench of the shipped tables: `{bench['command']}`", "",
             "| M | t/d | noise | verdict | tuned us | floor us | % of floor |",
             "|---|---|---|---|---|---|---|"]
    for row in bench["rows"]:
        if row["shape"].startswith("E=128,") and row["batch"] <= 8:
            lines.append(f"| {row['batch']} | {row['tuned_over_default']:.3f} | "
                         f"{100 * row['noise']:.1f}% | {row['verdict']} | {row['tuned_us']:.2f} | "
                         f"{row['fp8_floor_us']:.2f} | {100 * row['floor_fraction']:.1f} |")
    return [*lines, ""]


def main(folder: Path) -> None:
    lines = ["# Small-batch decode, TP8 (E=128, N=384): summary generated from the recorded JSON",
             "", f"Generated by `python3 scripts/measure/h200/summarize_small_batch.py {folder}`.", ""]
    for call in ("call1", "call2", "call3"):
        env = (folder / call / "env.txt").read_text().splitlines()
        lines.append(f"- {call}: {'; '.join(line for line in env[1:] if line)}")
    lines.append("")
    lines += sweep_section("call1 (first grid)", _load(folder / "call1/small-batch.json"))
    lines += checks_section(folder)
    lines += bounds_section(_load(folder / "call2/bounds.json"))
    lines += sweep_section("call3 (second grid, shipped tables)",
                           _load(folder / "call3/small-batch.json"))
    lines += bench_section(folder / "call3/bench.json")
    (folder / "SUMMARY.md").write_text("\n".join(lines).rstrip() + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
