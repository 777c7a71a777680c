#!/usr/bin/env bash
# The exact device command for issue 7's tables (one H200, torch+triton, no vLLM, no network).
# Usage on the device, from the repo root, with the vLLM 0.33.0 fused_moe.py carried in
# .devcarry/vllm/... and OUT set:  bash scripts/tune_h200.sh [TIME_BUDGET_S]
# A previous run's cache in .devcarry/tune-cache.jsonl is resumed from.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/tune-out}
BUDGET=${1:-470}
mkdir -p "$OUT/tables"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%dT%H:%M:%SZ; } > "$OUT/env.txt" 2>&1
if [[ -f .devcarry/tune-cache.jsonl ]]; then cp .devcarry/tune-cache.jsonl "$OUT/tune-cache.jsonl"; fi
# Smoke: a tiny shape end to end, so a broken path fails in seconds, not after the budget.
timeout 150 python3 -m m3patch tune --shape 8,256,512,2 --batch-sizes 4,64 --workers 4 \
  --vllm-source .devcarry --out-dir /tmp/tune-smoke --quick-reps 2 --refine-reps 3
python3 -m m3patch tune --shape 16,3072,6144,4,ep --shape 128,384,6144,4 \
  --batch-sizes default --vllm-source .devcarry --out-dir "$OUT/tables" \
  --cache "$OUT/tune-cache.jsonl" --workers 14 --time-budget "$BUDGET"
