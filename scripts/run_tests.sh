#!/usr/bin/env bash
# Set up (scripts/bootstrap.sh) and run the CPU test suite in ./.venv, then the vLLM tests in
# ./.venv-vllm (scripts/run_vllm_tests.sh). Extra arguments go to the first pytest only, and
# with them (a chosen test) the vLLM tests are not run; LMRL_SKIP_VLLM=1 skips them too.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/python -m pytest -m "not gpu" "$@"
if [ "$#" -eq 0 ] && [ "${LMRL_SKIP_VLLM:-0}" != "1" ]; then
  scripts/run_vllm_tests.sh
fi
