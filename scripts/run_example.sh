#!/usr/bin/env bash
# Set up (scripts/bootstrap.sh) and run the main example on two CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_tiny_gpt.py "$@"
