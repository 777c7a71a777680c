#!/usr/bin/env bash
# Build (or reuse) the venv holding vLLM's own P/D router, `vllm-router` from PyPI (the version
# InferenceX pins for its disaggregated runs): a Rust binary behind a small Python launcher, with
# neither torch nor vLLM. The P/D recipes' proxy role runs its bin/vllm-router (role key
# `router:`, default ${M3PATCH_ROUTER_VENV:-~/.cache/m3patch/vllm-router-venv}/bin/vllm-router).
# Measured on the 2-core machine: 47 s from PyPI, 130 MB on disk.
#
# Idempotent: a venv that already has the pinned version is left as it is.
# Usage: scripts/setup/setup_router.sh [VENV]   (default: $M3PATCH_ROUTER_VENV or
#        ~/.cache/m3patch/vllm-router-venv)
set -euo pipefail

VENV="${1:-${M3PATCH_ROUTER_VENV:-$HOME/.cache/m3patch/vllm-router-venv}}"
PYTHON="${PYTHON:-python3}"
ROUTER_VERSION='0.1.17'

log() { printf 'setup_router: %s\n' "$*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv at $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
installed="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-router"))' 2>/dev/null || true)"
if [[ "$installed" == "$ROUTER_VERSION" && -x "$VENV/bin/vllm-router" ]]; then
    log "vllm-router $installed already in $VENV"
    exit 0
fi
log "installing vllm-router==$ROUTER_VERSION into $VENV (under a minute)"
if ! "$VENV/bin/pip" install -q "vllm-router==$ROUTER_VERSION" >"$VENV/pip-install.log" 2>&1; then
    cat "$VENV/pip-install.log" >&2
    log "installing vllm-router failed"
    exit 1
fi
"$VENV/bin/vllm-router" --help > /dev/null || { log "vllm-router does not run"; exit 1; }
log "vllm-router $ROUTER_VERSION ready: $VENV/bin/vllm-router"
