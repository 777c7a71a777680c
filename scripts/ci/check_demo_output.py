"""Check what `bash scripts/demo.sh` printed, as CI's proof that the README's first command works.

    python3 scripts/ci/check_demo_output.py DEMO_LOG

Stdlib only (it runs beside a fresh tool venv, not inside it). Passes when the log holds the
per-GPU results table with one line per cell of the run's aggregate, every decode figure in it is
either a measurement at or above the burst floor or says "n/a (...)", the job reported success,
and the run folder it named holds the server log, per-cell files, aggregate JSON/CSV, both plots,
the ledger, ci.json and the accuracy gate's eval.json (with its score line in the log), and that
gate passed a score well above zero against a floor above zero (the trained tiny model), with
that score in aggregate.json's `evals` and in the table's Accuracy column on every line.
Exit 0 on pass, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TITLE = "cpu_tiny_moe: per-GPU results"
DONE = re.compile(r"ci: all steps passed; artifacts in (\S+)")
ARTIFACTS = ("server.log", "aggregate.json", "aggregate.csv", "throughput_per_gpu.png",
             "interactivity_vs_throughput.png", "ledger.json", "ci.json", "eval.json")
EVAL_LINE = re.compile(r"eval tiny_arith: exact_match,strict-match = [0-9.]+ over 32 samples \(ok")
BURST_FLOOR_MS = 0.1  # m3patch.bench.aggregate.BURST_FLOOR_MS: a lower TPOT is never printed
SPLIT = re.compile(r"[│┃|]|\s{2,}")


def cells_of(line: str) -> list[str]:
    return [c.strip() for c in SPLIT.split(line) if c.strip()]


def table_problems(lines: list[str], rows: list[dict[str, object]]) -> list[str]:
    if not any(TITLE in line for line in lines):
        return [f"no results table titled {TITLE!r} in the log"]
    header = next((cells_of(line) for line in lines if "TPOT p50 ms" in line), None)
    if header is None:
        return ["the results table has no header line with 'TPOT p50 ms'"]
    if "Accuracy" not in header:
        return ["the results table has no Accuracy column (the gate's score beside the rows)"]
    tpot_at, user_at = header.index("TPOT p50 ms"), header.index("tok/s/user")
    accuracy_at = header.index("Accuracy")
    problems = []
    for row in rows:
        label = f"{row['isl']}/{row['osl']}"
        printed = [c for c in (cells_of(line) for line in lines)
                   if len(c) == len(header) and c[1] == label and c[2] == str(row["concurrency"])]
        if not printed:
            problems.append(f"no table line for {label} at concurrency {row['concurrency']}")
            continue
        tpot, user = printed[-1][tpot_at], printed[-1][user_at]
        if not printed[-1][accuracy_at].startswith("tiny_arith "):
            problems.append(f"{label} c{row['concurrency']}: Accuracy {printed[-1][accuracy_at]!r}")
        if tpot.startswith("n/a (") != user.startswith("n/a ("):
            problems.append(f"{label} c{row['concurrency']}: TPOT {tpot!r} but tok/s/user {user!r}")
        elif not tpot.startswith("n/a (") and float(tpot) < BURST_FLOOR_MS:
            problems.append(f"{label} c{row['concurrency']}: TPOT {tpot} ms printed as a number")
    return problems


def gate_problems(path: Path, evals: object = None) -> list[str]:
    """The gate must mean something: a real floor, met by a real score; the aggregate's
    `evals` (when given) must carry that same score and floor."""
    try:
        (task,) = json.loads(path.read_text())["tasks"]
        score, floor = float(task["score"]), float(task["min"])
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{path}: no single task with a score and a floor"]
    if not 0.0 < floor <= score:
        return [f"{path}: the accuracy gate scored {score:.4f} against a floor of {floor:g} "
                "(a trained model scores well above a floor above zero)"]
    if evals is not None and not (isinstance(evals, list) and len(evals) == 1
                                  and isinstance(evals[0], dict)
                                  and (evals[0].get("score"), evals[0].get("min")) == (score, floor)
                                  and evals[0].get("passed") is True):
        return [f"aggregate.json evals {evals!r} do not carry the gate's {score} (min {floor:g})"]
    return []


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python3 scripts/ci/check_demo_output.py DEMO_LOG", file=sys.stderr)
        return 2
    log = Path(sys.argv[1])
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        print(f"check_demo_output: cannot read {log}: {exc.strerror}", file=sys.stderr)
        return 2
    done = [m.group(1) for m in map(DONE.search, lines) if m]
    if not done:
        print(f"check_demo_output: {log}: the job did not report 'ci: all steps passed'")
        return 1
    run_dir = Path(done[-1])
    if not run_dir.is_absolute():
        run_dir = Path(__file__).resolve().parents[2] / run_dir
    problems = [f"run folder {run_dir}: {name} missing" for name in ARTIFACTS
                if not any(p.is_file() for p in run_dir.rglob(name))]  # plots live in plots/
    if not any(EVAL_LINE.search(line) for line in lines):
        problems.append("the accuracy gate printed no 'eval tiny_arith: ... over 32 samples (ok' line")
    cells = sorted((run_dir / "cells").glob("*.json"))
    if not cells:
        problems.append(f"run folder {run_dir}: no cells/*.json")
    rows: list[dict[str, object]] = []
    evals: object = None
    if (run_dir / "aggregate.json").is_file():
        aggregate = json.loads((run_dir / "aggregate.json").read_text())
        rows, evals = aggregate["rows"], aggregate.get("evals")
        if "evals" not in aggregate:  # a run that stopped writing its scores must not pass
            problems.append("aggregate.json has no `evals` (the gate's scores beside the rows)")
    problems += gate_problems(run_dir / "eval" / "eval.json", evals)
    if rows:
        if len(rows) != len(cells):
            problems.append(f"aggregate.json has {len(rows)} rows for {len(cells)} cells")
        problems += [f"aggregate row c{r['concurrency']}: no decode_na field" for r in rows
                     if "decode_na" not in r]
        problems += table_problems(lines, rows)
    for problem in problems:
        print(f"check_demo_output: {problem}")
    if problems:
        return 1
    bursts = sum(1 for r in rows if r.get("decode_na") == "burst")
    print(f"check_demo_output: ok: {len(rows)} cells in the table and in {run_dir} "
          f"({bursts} with decode figures n/a (burst))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
