#!/usr/bin/env bash
# Set up (scripts/bootstrap.sh) and run the CPU test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m pytest -m "not gpu" "$@"
