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
ROUTER_VERSION='0.1.17'

source "$(dirname "${BASH_SOURCE[0]}")/pinned_venv.sh"
pinned_venv setup_router "$VENV" vllm-router "$ROUTER_VERSION" vllm-router --help "under a minute"
