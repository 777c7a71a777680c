#!/usr/bin/env bash
# Build (or reuse) the venv that runs AIPerf, the agentic-coding client (sweep.scenario:
# agentic-coding). AIPerf is a client here: it replays sessions against the served
# OpenAI-compatible endpoint and scrapes its /metrics; it needs neither torch nor vLLM. Its
# dependency tree (transformers, pandas, datasets, scipy, ...) lives in its own venv so it never
# pins the venv that serves. Measured on the 2-core machine: about 2 minutes from PyPI, about
# 1.2 GB on disk.
#
# Idempotent: a venv that already has the pinned AIPerf is left as it is (a second).
# Usage: scripts/setup/setup_aiperf.sh [VENV]   (default: $M3PATCH_AIPERF_VENV or
#        ~/.cache/m3patch/aiperf-venv; recipes find its python through sweep.client.python, whose
#        default is $M3PATCH_AIPERF_PYTHON or this venv's bin/python)
set -euo pipefail

VENV="${1:-${M3PATCH_AIPERF_VENV:-$HOME/.cache/m3patch/aiperf-venv}}"
PYTHON="${PYTHON:-python3}"
AIPERF_VERSION='0.13.0'   # m3patch.bench.agentic.aiperf.AIPERF_VERSION: the export it scores

log() { printf 'setup_aiperf: %s\n' "$*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv at $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi

installed="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("aiperf"))' 2>/dev/null || true)"
if [[ "$installed" == "$AIPERF_VERSION" && -x "$VENV/bin/aiperf" ]]; then
    log "aiperf $installed already in $VENV"
    exit 0
fi
log "installing aiperf==$AIPERF_VERSION into $VENV (about 2 minutes)"
if ! "$VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION" >"$VENV/pip-install.log" 2>&1; then
    cat "$VENV/pip-install.log" >&2
    log "installing aiperf failed"
    exit 1
fi
"$VENV/bin/aiperf" --version >/dev/null || { log "aiperf does not run"; exit 1; }
log "aiperf $AIPERF_VERSION ready: $VENV/bin/python"
