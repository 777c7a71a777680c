"""Ship-table step for the small-batch split-K entries: the TP8 table of TABLES with, at each
batch size where the small-batch run's judge chose its fastest split-K config over vLLM's
default (and its relative error on both seeds is within the tuner's tolerance), that config;
with --check files, only where every one of those `tune --check` runs of the candidate table
also judged it a win (m3patch.tune.small_batch.confirmed). The sidecar's judge record for those
batch sizes becomes the small-batch run's, so tests/tune/test_tune_cpu.py re-derives every
entry from its record. Other tables are copied unchanged.

    python3 scripts/maintain/ship_small_batch.py --tables DIR --run small-batch.json \
        [--check check1.json --check check2.json] --out DIR
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from m3patch.errors import M3PatchError, ResultsInvalid
from m3patch.fsio import json_bytes, read_json, write_bytes_atomic
from m3patch.tune import naming
from m3patch.tune.kernel_timer import TOLERANCE
from m3patch.tune.shapes import MoEShape
from m3patch.tune.small_batch import confirmed, split_k_picks
from m3patch.tune.tile import TileConfig
from m3patch.tune.writer import PROVENANCE_SUFFIX, read_table, table_dict

TP8 = MoEShape(128, 384, 6144, 4, "fp8_w8a8", (128, 128), False)
DEVICE = "NVIDIA H200"
NEEDS = ("SPLIT_K > 1 runs split only with patch 0007 (moe-split-k) applied; without it vLLM "
         "launches the same tile config unsplit")


def _read(path: Path) -> Any:
    return read_json(path, error=ResultsInvalid, expect=dict,
                     hint="pass the JSON file the small-batch script or `tune --check --json` wrote")


def main() -> int:
    try:
        return ship()
    except M3PatchError as exc:
        print(f"ship_small_batch: {exc}", file=sys.stderr)
        return exc.exit_code


def ship() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=Path, required=True)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--check", type=Path, action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run = _read(args.run)
    picks = split_k_picks(run, TOLERANCE, str(args.run))
    if args.check:
        picks = dict(confirmed(picks, [_read(p) for p in args.check]))
    args.out.mkdir(parents=True, exist_ok=True)
    name = naming.table_file_name(TP8, DEVICE)
    for path in sorted(args.tables.iterdir()):
        if path.name not in (name, name + PROVENANCE_SUFFIX):
            shutil.copyfile(path, args.out / path.name)
    table = read_table(args.tables / name)
    prov_path = args.tables / (name + PROVENANCE_SUFFIX)
    prov = _read(prov_path)
    judge = prov.get("judge")
    if not (isinstance(prov.get("triton"), str) and isinstance(judge, dict)
            and isinstance(judge.get("per_batch"), dict)):
        msg = f"{prov_path}: not a tuner provenance sidecar ('triton', 'judge.per_batch')"
        raise ResultsInvalid(msg, hint="pass the tables folder `m3patch tune` wrote")
    for batch, record in picks.items():
        table[batch] = TileConfig.from_key(str(record["tuned_config"]))
        prov["judge"]["per_batch"][str(batch)] = dict(record)
    prov["split_k"] = {
        "batches": sorted(picks), "needs": NEEDS,
        "source": f"{args.run} ({run['command']}, {run['device']})",
        "confirmed_by": [str(p) for p in args.check],
        "rule": "the small-batch run's fastest split-K config where its judge chose it over "
                "vLLM's default, rel. error on two seeds within the tuner's tolerance"
                + (", and every --check run judged it a win" if args.check else "")}
    write_bytes_atomic(args.out / name, json_bytes(table_dict(table, prov["triton"]), indent=4))
    write_bytes_atomic(args.out / (name + PROVENANCE_SUFFIX), json_bytes(prov, indent=4))
    print(f"{name}: split-K at M={sorted(picks)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
