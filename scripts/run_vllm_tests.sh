#!/usr/bin/env bash
# Set up ./.venv-vllm (scripts/bootstrap_vllm.sh) and run the vLLM-marked tests there. Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap_vllm.sh
exec .venv-vllm/bin/python -m pytest -m vllm "$@"
