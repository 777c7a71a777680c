#!/usr/bin/env bash
# The device command for the judged H200 tables (one H200, torch+triton, no vLLM, no network),
# from the repo root on the device, OUT set:
#   bash scripts/measure/h200/tune_check_h200.sh [CARRY] [TUNE_BUDGET_S] [END_S]
# CARRY (default .devcarry) holds vllm/model_executor/layers/fused_moe/fused_moe.py (vLLM
# 0.33.0's, the kernel) and tune-cache.jsonl (the earlier runs' results, resumed).
#  1. tests/tune/test_tune_gpu.py;
#  2. `m3patch tune --check` on both shipped tables (patch 0005's new-file payload), EP8 with
#     both routings (vLLM's benchmark convention and ep-rank), TP8 with the convention (no EP:
#     every rank sees every expert);
#  3. re-tune both shapes with the judge deciding each final entry (resumed cache);
#  4. bench_moe_tables.py on the re-tuned tables, twice (two independent processes), and
#     --check of the re-tuned EP8 table with ep-rank routing;
#  5. with the seconds left before END_S: tune EP8 with ep-rank routing (the whole space: no
#     cached results under that routing) and --check that table with both routings.
# Every stage logs to run.log and re-packs results.tar (the call returns <= 8 files), so a
# stage cut off by the time limit still leaves the earlier ones.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/tune-check-out}
CARRY=${1:-.devcarry}
BUDGET=${2:-200}
END=${3:-540}
RES=/tmp/res
mkdir -p /tmp/shipped
source "$(dirname "$0")/device_preamble.sh"

log "stage 1: GPU tests"
M3PATCH_TUNE_VLLM_SOURCE=$CARRY python3 -m pytest -m gpu --noconftest -p no:cacheprovider -q \
  tests/tune/test_tune_gpu.py > "$RES/gpu-tests.log" 2>&1
log "gpu tests rc=$? $(tail -1 "$RES/gpu-tests.log")"; pack

log "stage 2: tune --check on the shipped tables"
python3 - <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "scripts/measure/h200")
from patch_payload import new_file_from_patch
patch = Path("patches/vllm-0.33.0/0005-tuned-tables-h200.patch").read_text()
prefix = "vllm/model_executor/layers/fused_moe/configs/m3patch/"
for line in patch.splitlines():
    if line.startswith("+++ b/" + prefix):
        path = line[len("+++ b/"):]
        Path("/tmp/shipped", Path(path).name).write_text(new_file_from_patch(patch, path))
        print("extracted", Path(path).name)
EOF
EP8="/tmp/shipped/E=16,N=3072,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
TP8="/tmp/shipped/E=128,N=384,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
check() {  # name table extra-args...
  local name=$1 table=$2; shift 2
  python3 -m m3patch tune --check "$table" --vllm-source "$CARRY" --workers 14 \
    --check-json "$RES/check-$name.json" "$@" > "$RES/check-$name.txt" 2> "$RES/check-$name.log"
  log "check $name rc=$?"; cat "$RES/check-$name.txt"; pack
}
RAW="docs/results/tune-h200/tuned-raw/$(basename "$EP8")"
check ep8-tunedraw-bench "$RAW"
check ep8-bench "$EP8"
check ep8-eprank "$EP8" --routing ep-rank --ep-ranks 8
check tp8-bench "$TP8"

log "stage 3: re-tune with the judge (budget ${BUDGET} s)"
cp "$CARRY/tune-cache.jsonl" /tmp/tune-cache.jsonl
python3 -m m3patch tune --shape 16,3072,6144,4,ep --shape 128,384,6144,4 --batch-sizes default \
  --vllm-source "$CARRY" --out-dir "$RES/tables" --cache /tmp/tune-cache.jsonl --workers 14 \
  --time-budget "$BUDGET" > "$RES/tune.log" 2>&1
log "tune rc=$?"; tail -3 "$RES/tune.log"; pack

for run in 1 2; do
  log "stage 4: bench run $run on the re-tuned tables"
  python3 scripts/measure/h200/bench_moe_tables.py --tables "$RES/tables" --vllm-source "$CARRY" \
    --skip-bf16 --out "$RES/bench-run$run.json" 2> "$RES/bench-run$run.log" \
    > "$RES/bench-run$run.txt"
  log "bench run $run rc=$?"; cat "$RES/bench-run$run.txt"; pack
done
TUNED="$RES/tables/$(basename "$EP8")"
check retuned-ep8-eprank "$TUNED" --routing ep-rank --ep-ranks 8

LEFT=$((END - SECONDS - 60))
if (( LEFT > 60 )); then
  log "stage 5: tune EP8 with ep-rank routing (budget ${LEFT} s)"
  python3 -m m3patch tune --shape 16,3072,6144,4,ep --routing ep-rank --ep-ranks 8 \
    --batch-sizes default --vllm-source "$CARRY" --out-dir "$RES/tables-eprank" \
    --cache "$RES/tune-cache-eprank.jsonl" --workers 14 --time-budget "$LEFT" \
    > "$RES/tune-eprank.log" 2>&1
  log "tune ep-rank rc=$?"; tail -3 "$RES/tune-eprank.log"; pack
  if [[ -f $RES/tables-eprank/$(basename "$EP8") ]]; then
    check eprank-ep8-eprank "$RES/tables-eprank/$(basename "$EP8")" --routing ep-rank --ep-ranks 8
    check eprank-ep8-bench "$RES/tables-eprank/$(basename "$EP8")"
  fi
fi
log "done"; pack
