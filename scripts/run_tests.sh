#!/usr/bin/env bash
# Set up (scripts/bootstrap.sh) and run the CPU test suite in ./.venv (megatron-core 0.16.1), then
# the vLLM tests in ./.venv-vllm (scripts/run_vllm_tests.sh) and the megatron-core 0.19.2 subset in
# ./.venv-mcore019 (scripts/run_mcore019_tests.sh). Extra arguments go to the first pytest only,
# and with them (a chosen test) the other two are not run; LMRL_SKIP_VLLM=1 and
# LMRL_SKIP_MCORE019=1 skip them too.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/python -m pytest -m "not gpu" "$@"
if [ "$#" -eq 0 ] && [ "${LMRL_SKIP_VLLM:-0}" != "1" ]; then
  scripts/run_vllm_tests.sh
fi
if [ "$#" -eq 0 ] && [ "${LMRL_SKIP_MCORE019:-0}" != "1" ]; then
  scripts/run_mcore019_tests.sh
fi
