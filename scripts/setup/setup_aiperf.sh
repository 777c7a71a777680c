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
AIPERF_VERSION='0.13.0'   # m3patch.bench.agentic.aiperf.AIPERF_VERSION: the export it scores

source "$(dirname "${BASH_SOURCE[0]}")/pinned_venv.sh"
pinned_venv setup_aiperf "$VENV" aiperf "$AIPERF_VERSION" aiperf --version "about 2 minutes"
