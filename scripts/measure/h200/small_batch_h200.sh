#!/usr/bin/env bash
# The device command for small-batch decode of the TP8 shape (one H200, torch+triton, no vLLM,
# no network), from the repo root on the device, OUT set:
#   bash scripts/measure/h200/small_batch_h200.sh [CARRY] [BATCHES] [END_S] [SPACE] [TABLES] [BENCH]
# CARRY (default .devcarry) holds vllm/model_executor/layers/fused_moe/fused_moe.py with
# patch 0007 (split-K) applied: its kernel with split_k 1 is vLLM 0.33.0's unpatched kernel.
#  1. tests/tune/test_tune_gpu.py with that kernel (the tuner's launch path unchanged at 1);
#  2. scripts/measure/h200/small_batch_h200.py: launch and read floors, the small-batch sweep (SPACE: small
#     or extra), the judge; TABLES (default: the judged tables) gives the shipped entries;
#  3. with BENCH=bench: scripts/measure/h200/bench_moe_tables.py on TABLES (EP8 under ep-rank routing).
# Results come back as results.tar + run.log (+ small-batch.txt, the table).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/small-batch-out}
CARRY=${1:-.devcarry}
BATCHES=${2:-1,2,4}
END=${3:-500}  # the sweep is stopped here so that what it saved still gets packed
SPACE=${4:-small}
TABLES=${5:-docs/results/tune-h200/judged-tables}
BENCH=${6:-}
RES=/tmp/res
source "$(dirname "$0")/device_preamble.sh"

log "stage 1: GPU tests"
M3PATCH_TUNE_VLLM_SOURCE=$CARRY python3 -m pytest -m gpu --noconftest -p no:cacheprovider -q \
  tests/tune/test_tune_gpu.py > "$RES/gpu-tests.log" 2>&1
log "gpu tests rc=$? $(tail -1 "$RES/gpu-tests.log")"; pack

log "stage 2: small-batch sweep M=$BATCHES space $SPACE"
timeout $((END - SECONDS)) python3 scripts/measure/h200/small_batch_h200.py --vllm-source "$CARRY" \
  --tables "$TABLES" --batches "$BATCHES" --space "$SPACE" --out "$RES/small-batch.json" \
  > "$RES/small-batch.txt" 2> "$RES/small-batch.log"
log "small-batch rc=$?"; cat "$RES/small-batch.txt"; tail -5 "$RES/small-batch.log"
cp "$RES/small-batch.txt" "$OUT/" 2>/dev/null
if [[ $BENCH == bench ]]; then
  log "stage 3: bench on $TABLES"
  python3 scripts/measure/h200/bench_moe_tables.py --tables "$TABLES" --vllm-source "$CARRY" --skip-bf16 \
    --routing ep-rank --ep-ranks 8 --out "$RES/bench.json" 2> "$RES/bench.log" \
    > "$RES/bench.txt"
  log "bench rc=$?"; cat "$RES/bench.txt"
fi
log "done"; pack
