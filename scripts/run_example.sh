#!/usr/bin/env bash
# Set up (scripts/bootstrap.sh) and run the main example: GRPO of a tiny GPT on two CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python examples/grpo_tiny.py "$@"
