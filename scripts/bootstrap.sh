#!/usr/bin/env bash
# Create ./.venv (if needed) and install the project into it. Idempotent and fast when up to date.
# torch is installed FIRST and pinned (TORCH_SPEC, default the 2.13.0 CPU wheel) so that no other
# dependency can pull a multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
stamp=".venv/.lmrl-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1) ${TORCH_SPEC}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[dev,plot,hf]"
echo "$want" > "$stamp"
