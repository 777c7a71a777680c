"""Ship-table step for tables tuned before the judge: per batch size keep the judge's decision
recorded in bench.json (scripts/measure/h200/bench_moe_tables.py: the tuned config only where it wins beyond
the noise), or, in a bench.json from before the judge, whichever of tuned and vLLM's default
measured faster; then write the table and its provenance (with the routing convention the
timings assume, added when the tuner that made them did not record it). Tables tuned with the
judge need no merge: the tuner's final choice per batch is already the judge's.

    python3 scripts/maintain/merge_moe_tables.py TUNED_DIR BENCH_JSON OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from m3patch.tune.tile import TileConfig
from m3patch.tune.writer import (
    PROVENANCE_SUFFIX,
    ROUTING_DENSE,
    ROUTING_EP,
    read_table,
    table_dict,
)


def main(tuned_dir: Path, bench: Path, out_dir: Path) -> None:
    rows = json.loads(bench.read_text())["rows"]
    out_dir.mkdir(parents=True, exist_ok=True)
    for table_path in sorted(tuned_dir.glob("E=*.json")):
        if table_path.name.endswith(PROVENANCE_SUFFIX):
            continue
        prov = json.loads((tuned_dir / (table_path.name + PROVENANCE_SUFFIX)).read_text())
        tuned = read_table(table_path)
        picked, choice = {}, {}
        for row in (r for r in rows if r["shape"] == prov["shape"]):
            use_default = (row["decision"] == "default" if "decision" in row
                           else row["default_us"] < row["tuned_us"])
            key = row["default_config"] if use_default else row["tuned_config"]
            picked[row["batch"]] = TileConfig.from_key(key)
            choice[str(row["batch"])] = {"kept": "vllm-default" if use_default else "tuned",
                                         "tuned_us": round(row["tuned_us"], 1),
                                         "default_us": round(row["default_us"], 1)}
        assert set(picked) == set(tuned), "bench must cover every tuned batch size"
        (out_dir / table_path.name).write_text(
            json.dumps(table_dict(picked, prov["triton"]), indent=4) + "\n")
        prov.setdefault("routing", ROUTING_EP if prov["shape"].endswith(",ep") else ROUTING_DENSE)
        rule = ("the judge's decision per batch size" if all("decision" in r for r in rows)
                else "faster of tuned and vLLM default per batch size")
        prov["selection"] = {"rule": f"{rule}, from scripts/measure/h200/bench_moe_tables.py (bench.json)",
                             "per_batch": choice}
        (out_dir / (table_path.name + PROVENANCE_SUFFIX)).write_text(json.dumps(prov, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
