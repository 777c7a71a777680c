#!/usr/bin/env bash
# One CI job for one recipe: apply, verify, serve, sweep, results -> one exit code (errors.py).
# A thin wrapper over `m3patch ci`; the run folder keeps what a workflow uploads: server.log,
# serve.json, cells/*.json, aggregate.json/.csv, the PNG plots, ledger.json and ci.json.
#
# Usage: scripts/ci_job.sh RECIPE [RUN_DIR]
#   RUN_DIR defaults to $M3PATCH_RUN_DIR, else runs/ci-<recipe>-<UTC time> (git-ignored).
#   M3PATCH_PYTHON: the interpreter that has m3patch installed (default python3).
#   On GitHub Actions the run folder is also written to $GITHUB_OUTPUT as `run-dir`.
set -uo pipefail
cd "$(dirname "$0")/.."

RECIPE="${1:?usage: scripts/ci_job.sh RECIPE [RUN_DIR]}"
RUN_DIR="${2:-${M3PATCH_RUN_DIR:-runs/ci-$(basename "$RECIPE" .yaml)-$(date -u +%Y%m%d-%H%M%S)}}"
PY="${M3PATCH_PYTHON:-python3}"

if [[ -n "${GITHUB_OUTPUT:-}" ]]; then
    echo "run-dir=$RUN_DIR" >> "$GITHUB_OUTPUT"  # before the run: artifacts upload even on failure
fi
"$PY" -m m3patch ci "$RECIPE" --run-dir "$RUN_DIR"
code=$?
echo "ci_job: exit $code; run folder $RUN_DIR" >&2
exit "$code"
