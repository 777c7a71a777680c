#!/usr/bin/env bash
# Device call 2 for issue 7: rewrite the tables from the carried cache (no re-timing), GPU
# tests, then the measurement. Outputs under $OUT with plain names (the tool drops names with
# '=' or '['), tables packed as tables.tar.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/bench-out}
cp .devcarry/tune-cache.jsonl /tmp/tune-cache.jsonl
python3 -m m3patch tune --shape 16,3072,6144,4,ep --shape 128,384,6144,4 --batch-sizes default \
  --vllm-source .devcarry --out-dir /tmp/tables --cache /tmp/tune-cache.jsonl --workers 0 \
  > "$OUT/tables.log" 2>&1
tar -C /tmp -cf "$OUT/tables.tar" tables
python3 -m pytest -m gpu --noconftest -p no:cacheprovider -q tests/test_tune_gpu.py \
  > "$OUT/gpu-tests.log" 2>&1; tail -3 "$OUT/gpu-tests.log"
python3 scripts/bench_moe_tables.py --tables /tmp/tables --vllm-source .devcarry \
  --out "$OUT/bench.json" 2> "$OUT/bench.log" | tee "$OUT/bench.txt"
