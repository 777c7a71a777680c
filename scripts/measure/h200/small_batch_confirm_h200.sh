#!/usr/bin/env bash
# The device command that checks split-K candidate tables and measures the small-batch bounds
# (one H200, torch+triton, no vLLM, no network), from the repo root on the device, OUT set:
#   bash scripts/measure/h200/small_batch_confirm_h200.sh TABLES [CARRY] [PRISTINE]
# TABLES holds the candidate TP8 table (scripts/maintain/ship_small_batch.py); CARRY (default .devcarry)
# the tree with patch 0007 applied to fused_moe.py, PRISTINE (default .devcarry/pristine) vLLM
# 0.33.0's unpatched fused_moe.py tree.
#  1. the split-K numerics test (tests/payloads/test_payload_moe_split_k.py, -m gpu);
#  2. `m3patch tune --check` of the candidate TP8 table, twice (two independent processes);
#  3. scripts/measure/h200/small_batch_h200.py --bounds: launch and read floors, GEMM1/GEMM2 apart.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/small-batch-confirm-out}
TABLES=$1
CARRY=${2:-.devcarry}
PRISTINE=${3:-.devcarry/pristine}
RES=/tmp/res
source "$(dirname "$0")/device_preamble.sh"
TP8="$TABLES/E=128,N=384,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"

log "stage 1: split-K numerics"
M3PATCH_TUNE_VLLM_SOURCE=$CARRY M3PATCH_PRISTINE_SOURCE=$PRISTINE python3 -m pytest -m gpu \
  --noconftest -p no:cacheprovider -q tests/payloads/test_payload_moe_split_k.py \
  > "$RES/splitk-tests.log" 2>&1
log "split-K tests rc=$? $(tail -1 "$RES/splitk-tests.log")"; pack

for run in 1 2; do
  python3 -m m3patch tune --check "$TP8" --vllm-source "$CARRY" --workers 14 \
    --check-json "$RES/check-tp8-run$run.json" > "$RES/check-tp8-run$run.txt" \
    2> "$RES/check-tp8-run$run.log"
  log "check tp8 run $run rc=$?"; cat "$RES/check-tp8-run$run.txt"; pack
done

log "stage 3: bounds"
python3 scripts/measure/h200/small_batch_h200.py --bounds --vllm-source "$CARRY" --tables "$TABLES" \
  --batches 1,2,4 --out "$RES/bounds.json" > "$RES/bounds.txt" 2> "$RES/bounds.log"
log "bounds rc=$?"; cat "$RES/bounds.txt"; tail -3 "$RES/bounds.log"
log "done"; pack
