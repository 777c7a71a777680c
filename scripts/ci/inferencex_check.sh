#!/usr/bin/env bash
# Run InferenceX's own utils/process_result.py (on each cell's vLLM result, with the row's
# identity as its environment) and compare_results.build_config_params (on each aggregate row)
# against a real m3patch run folder, and print where the two disagree. InferenceX is not part of
# m3patch: check out SemiAnalysisAI/InferenceX yourself and give its utils/ folder. PYTHON must
# have psycopg2 and tabulate (compare_results imports them); no database is contacted.
# Usage: PYTHON=python3 scripts/ci/inferencex_check.sh INFERENCEX/utils RUN_DIR
set -euo pipefail
UTILS=$1; RUN=$2; WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python3}
for cell in "$RUN"/cells/*.json; do
  id=$(basename "$cell" .json)
  # the vLLM result as vLLM wrote it (the per-cell file minus m3patch's block)
  $PY -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('m3patch'); json.dump(d, open(sys.argv[2],'w'))" "$cell" "$WORK/$id.json"
  eval "$($PY - "$RUN/aggregate.json" "$id" <<'PYEOF'
import json, sys
row = next(r for r in json.load(open(sys.argv[1]))["rows"] if r["cell_id"] == sys.argv[2])
env = dict(RUNNER_TYPE=row["hw"], FRAMEWORK=row["framework"], PRECISION=row["precision"],
           SPEC_DECODING=row["spec_decoding"], ISL=row["isl"], OSL=row["osl"],
           DISAGG=str(row["disagg"]).lower(), MODEL_PREFIX=row["infmax_model_prefix"],
           IMAGE=row["image"], TP=row["tp"], EP_SIZE=row["ep"], DP_ATTENTION=row["dp_attention"],
           PP_SIZE=row["pp"], DCP_SIZE=row["dcp_size"], PCP_SIZE=row["pcp_size"],
           RECIPE_FINGERPRINT=row["recipe_fingerprint"])
print(" ".join(f"export {k}='{v}';" for k, v in env.items()))
PYEOF
)"
  (cd "$WORK" && RESULT_FILENAME=$id $PY "$UTILS/process_result.py" > "$id.stdout" 2> "$id.stderr") \
    || { echo "process_result.py failed on $id"; cat "$WORK/$id.stderr"; exit 1; }
done
$PY - "$UTILS" "$RUN/aggregate.json" "$WORK" <<'PYEOF'
import json, math, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import compare_results  # InferenceX main's own module (psycopg2, tabulate installed)
rows = json.load(open(sys.argv[2]))["rows"]
for row in rows:
    ifx = json.loads((Path(sys.argv[3]) / f"agg_{row['cell_id']}.json").read_text())
    missing = sorted(set(ifx) - set(row))
    differ = []
    for key, value in ifx.items():
        mine = row.get(key)
        if mine is None and row.get(f"inferencex_{key}") is not None:
            mine = row[f"inferencex_{key}"]  # m3patch's null, InferenceX's figure beside it
        same = (math.isclose(mine, value, rel_tol=1e-12) if isinstance(value, float)
                and isinstance(mine, (int, float)) else mine == value and type(mine) is type(value))
        if not same:
            differ.append(f"{key}: InferenceX {value!r} m3patch {row.get(key)!r}")
    params = compare_results.build_config_params(row)
    print(f"{row['cell_id']}: process_result.py fields {len(ifx)}, missing in m3patch row "
          f"{missing or 'none'}, differing {differ or 'none'}")
    print(f"  build_config_params -> {json.dumps(params)}")
PYEOF
echo "InferenceX stderr (power step, no GPU metrics):"; sort -u "$WORK"/*.stderr
