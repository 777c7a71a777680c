#!/usr/bin/env bash
# The device command for the H200 tables (one H200, torch+triton, no vLLM, no network): tune
# both M3 shapes, then measure tuned vs vLLM default vs BF16 (scripts/measure/h200/bench_moe_tables.py) in
# the same call. From the repo root on the device, OUT set:
#   bash scripts/measure/h200/tune_h200.sh [TUNE_BUDGET_S] [CARRY]
# CARRY (default .devcarry) holds vllm/model_executor/layers/fused_moe/fused_moe.py and, to
# resume an earlier run, its tune-cache.jsonl. RUN_GPU_TESTS=1 adds tests/tune/test_tune_gpu.py at
# the end. Everything comes back as <= 8 plain-named files (the tables are packed in
# tables.tar: their names hold '=' and '[').
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/tune-out}
BUDGET=${1:-470}
CARRY=${2:-.devcarry}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%dT%H:%M:%SZ; } > "$OUT/env.txt" 2>&1
if [[ -f $CARRY/tune-cache.jsonl ]]; then cp "$CARRY/tune-cache.jsonl" "$OUT/tune-cache.jsonl"; fi
SECONDS=0
python3 -m m3patch tune --shape 16,3072,6144,4,ep --shape 128,384,6144,4 \
  --batch-sizes default --vllm-source "$CARRY" --out-dir /tmp/tables \
  --cache "$OUT/tune-cache.jsonl" --workers 14 --time-budget "$BUDGET" > "$OUT/tune.log" 2>&1 \
  || { tail -20 "$OUT/tune.log"; exit 1; }
echo "tune: ${SECONDS} s" | tee -a "$OUT/tune.log"
tar -C /tmp -cf "$OUT/tables.tar" tables
SECONDS=0
mkdir -p /tmp/bench  # its per-config BF16 cache stays there: the call returns 8 files at most
python3 scripts/measure/h200/bench_moe_tables.py --tables /tmp/tables --vllm-source "$CARRY" \
  --out /tmp/bench/bench.json 2> "$OUT/bench.log" | tee "$OUT/bench.txt"
cp /tmp/bench/bench.json "$OUT/bench.json"
echo "bench: ${SECONDS} s" | tee -a "$OUT/bench.log"
if [[ ${RUN_GPU_TESTS:-0} == 1 ]]; then
  M3PATCH_TUNE_VLLM_SOURCE=$CARRY python3 -m pytest -m gpu --noconftest -p no:cacheprovider -q tests/tune/test_tune_gpu.py \
    > "$OUT/gpu-tests.log" 2>&1; tail -3 "$OUT/gpu-tests.log"
fi
