#!/usr/bin/env bash
# The device command for vLLM's own MoE layer on one H200 (torch+triton, no vLLM install, no
# network), from the repo root on the device, OUT set:
#   bash CARRY/moe_layer_h200.sh [CARRY] [BATCHES]
# CARRY (default .devcarry) holds, prepared by the maintainer:
#   tree.tar.xz   a vLLM 0.33.0 tree (.py/.json + dist-info) with the m3patch series applied
#                 (`m3patch apply --vllm-root`), unpacked to /tmp/vllm-tree
#   whl/          wheels of the packages vLLM's import chain needs that the device lacks
#                 (pydantic, msgspec, pyzmq, ...; list in docs/results/moe-layer-h200/README.md)
#   gpu_moe_layer_h200.py, gpu_vllm_standins.py   the run (scripts/measure/h200/ of this repo)
#   test_payload_moe_split_k.py + pristine/vllm/.../fused_moe.py   the split-K kernel test
#  1. scripts/measure/h200/gpu_moe_layer_h200.py: the layer, its markers, errors and times;
#  2. the split-K kernel's GPU numerics test against the patched tree.
# Results come back as results.tar + run.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/moe-layer-out}
CARRY=${1:-.devcarry}
BATCHES=${2:-1,2,4,8,16,32,64,128,256}
RES=/tmp/res
source scripts/measure/h200/device_preamble.sh

TREE=/tmp/vllm-tree
mkdir -p "$TREE" && tar -C "$TREE" -xJf "$CARRY/tree.tar.xz" || { log "tree unpack failed"; pack; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$CARRY"/whl/*.whl > "$RES/pip.log" 2>&1
log "wheels rc=$? ($(ls "$CARRY"/whl | wc -l) wheels)"

log "stage 1: vLLM's MoE layer, M=$BATCHES"
PYTHONPATH=$TREE:/tmp/site timeout 400 python3 "$CARRY/gpu_moe_layer_h200.py" \
  --out "$RES/layer" --batches "$BATCHES" > "$RES/layer-stdout.log" 2>&1
log "layer rc=$?"; tail -40 "$RES/layer-stdout.log"; pack

log "stage 2: split-K kernel numerics (patched tree vs float32 reference and pristine kernel)"
PYTHONPATH=$PWD:/tmp/site M3PATCH_TUNE_VLLM_SOURCE=$TREE M3PATCH_PRISTINE_SOURCE=$CARRY/pristine \
  timeout 150 python3 -m pytest -m gpu --noconftest -p no:cacheprovider -q \
  "$CARRY/test_payload_moe_split_k.py" > "$RES/splitk-gpu.log" 2>&1
log "split-k gpu tests rc=$? $(tail -1 "$RES/splitk-gpu.log")"
log "done"; pack
