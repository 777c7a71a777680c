#!/usr/bin/env bash
# Build (or reuse) the venv that runs lm-evaluation-harness for the accuracy gate (m3patch eval).
#
# lm-eval is a client here: it sends text to the served OpenAI-compatible endpoint and scores the
# answers, so it needs neither torch nor vLLM. It lives in its own venv so its pins (datasets,
# numpy, scikit-learn) never touch the venv that serves. `lm-eval[api]` is the minimal set for
# the local-completions / local-chat-completions model types: no torch, no transformers
# (requests are sent as text; the server tokenizes). Measured on the 2-core machine: about
# 2 minutes from PyPI, about 760 MB on disk.
#
# Idempotent: a venv that already has the pinned lm-eval is left as it is (a second).
# Usage: scripts/setup/setup_lm_eval.sh [VENV]   (default: $M3PATCH_LM_EVAL_VENV or
#        ~/.cache/m3patch/lm-eval-venv; recipes find its python through eval.python, whose default
#        is $M3PATCH_LM_EVAL_PYTHON or this venv's bin/python)
set -euo pipefail

VENV="${1:-${M3PATCH_LM_EVAL_VENV:-$HOME/.cache/m3patch/lm-eval-venv}}"
PYTHON="${PYTHON:-python3}"
LM_EVAL_VERSION='0.4.13'

log() { printf 'setup_lm_eval: %s\n' "$*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv at $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi

installed="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("lm-eval"))' 2>/dev/null || true)"
if [[ "$installed" == "$LM_EVAL_VERSION" ]]; then
    log "lm-eval $installed already in $VENV"
    exit 0
fi
log "installing lm-eval[api]==$LM_EVAL_VERSION into $VENV (about 2 minutes)"
if ! "$VENV/bin/pip" install -q "lm-eval[api]==$LM_EVAL_VERSION" >"$VENV/pip-install.log" 2>&1; then
    cat "$VENV/pip-install.log" >&2
    log "installing lm-eval failed"
    exit 1
fi
"$VENV/bin/python" -c 'import lm_eval.models.openai_completions' || { log "lm-eval does not import"; exit 1; }
log "lm-eval $LM_EVAL_VERSION ready: $VENV/bin/python"
