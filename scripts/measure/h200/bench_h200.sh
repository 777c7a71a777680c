#!/usr/bin/env bash
# Re-measure without re-tuning: rewrite the tables from a carried, finished tune cache (no
# timing), run the GPU tests, then the measurement. From the repo root on the device:
#   bash scripts/measure/h200/bench_h200.sh [CARRY]      (CARRY default .devcarry, as in tune_h200.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/bench-out}
CARRY=${1:-.devcarry}
mkdir -p "$OUT"
cp "$CARRY/tune-cache.jsonl" /tmp/tune-cache.jsonl
python3 -m m3patch tune --shape 16,3072,6144,4,ep --shape 128,384,6144,4 --batch-sizes default \
  --vllm-source "$CARRY" --out-dir /tmp/tables --cache /tmp/tune-cache.jsonl --workers 0 \
  > "$OUT/tables.log" 2>&1
tar -C /tmp -cf "$OUT/tables.tar" tables
python3 -m pytest -m gpu --noconftest -p no:cacheprovider -q tests/tune/test_tune_gpu.py \
  > "$OUT/gpu-tests.log" 2>&1; tail -3 "$OUT/gpu-tests.log"
python3 scripts/measure/h200/bench_moe_tables.py --tables /tmp/tables --vllm-source "$CARRY" \
  --out "$OUT/bench.json" 2> "$OUT/bench.log" | tee "$OUT/bench.txt"
