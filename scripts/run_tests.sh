#!/usr/bin/env bash
# Set up (scripts/bootstrap.sh) and run the CPU test suite in ./.venv (megatron-core 0.16.1), then
# the vLLM tests in ./.venv-vllm (scripts/run_vllm_tests.sh) and the megatron-core 0.19.2 subset in
# ./.venv-mcore019 (scripts/run_mcore019_tests.sh). Extra arguments go to the first pytest only,
# and with them (a chosen test) the other two are not run; LMRL_SKIP_VLLM=1 and
# LMRL_SKIP_MCORE019=1 skip them too.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# The two other environments install (mostly downloads: ~14 min the first time) while the main
# suite runs, instead of after it; their logs go to .lmrl-bootstrap-*.log.
pids=()
names=()
if [ "$#" -eq 0 ] && [ "${LMRL_SKIP_VLLM:-0}" != "1" ]; then
  scripts/bootstrap_vllm.sh > .lmrl-bootstrap-vllm.log 2>&1 &
  pids+=($!)
  names+=(vllm)
fi
if [ "$#" -eq 0 ] && [ "${LMRL_SKIP_MCORE019:-0}" != "1" ]; then
  scripts/bootstrap_mcore019.sh > .lmrl-bootstrap-mcore019.log 2>&1 &
  pids+=($!)
  names+=(mcore019)
fi
status=0
.venv/bin/python -m pytest -m "not gpu" "$@" || status=$?
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "scripts/bootstrap_${names[$i]}.sh failed:" >&2
    cat ".lmrl-bootstrap-${names[$i]}.log" >&2
    exit 1
  fi
done
[ "$status" -eq 0 ] || exit "$status"
for name in "${names[@]}"; do
  "scripts/run_${name}_tests.sh"
done
