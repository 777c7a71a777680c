#!/usr/bin/env bash
# The device command that measures a finished pair of H200 tables twice (one H200,
# torch+triton, no vLLM, no network), from the repo root on the device, OUT set:
#   bash scripts/measure/h200/bench_judged_h200.sh TABLES [CARRY]
# TABLES holds the EP8 (E=16,N=3072) and TP8 (E=128,N=384) tables; CARRY (default .devcarry)
# holds vLLM 0.33.0's fused_moe.py. Runs `m3patch tune --check` on both (EP8 with the routing
# an EP rank sees, TP8 with the benchmark convention: no EP), then bench_moe_tables.py twice
# (two independent processes) with EP8 under ep-rank routing. Results come back as
# results.tar + run.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/bench-judged-out}
TABLES=$1
CARRY=${2:-.devcarry}
RES=/tmp/res
source "$(dirname "$0")/device_preamble.sh"
EP8="$TABLES/E=16,N=3072,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
TP8="$TABLES/E=128,N=384,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
check() {  # name table extra-args...
  local name=$1 table=$2; shift 2
  python3 -m m3patch tune --check "$table" --vllm-source "$CARRY" --workers 14 \
    --check-json "$RES/check-$name.json" "$@" > "$RES/check-$name.txt" 2> "$RES/check-$name.log"
  log "check $name rc=$?"; cat "$RES/check-$name.txt"; pack
}
check ep8-eprank "$EP8" --routing ep-rank --ep-ranks 8
check tp8-bench "$TP8"
for run in 1 2; do
  python3 scripts/measure/h200/bench_moe_tables.py --tables "$TABLES" --vllm-source "$CARRY" --skip-bf16 \
    --routing ep-rank --ep-ranks 8 --out "$RES/bench-eprank-run$run.json" \
    2> "$RES/bench-eprank-run$run.log" > "$RES/bench-eprank-run$run.txt"
  log "bench ep-rank run $run rc=$?"; cat "$RES/bench-eprank-run$run.txt"; pack
done
log "done"; pack
