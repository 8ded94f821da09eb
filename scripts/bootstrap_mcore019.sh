#!/usr/bin/env bash
# Create ./.venv-mcore019 (if needed): this project on megatron-core 0.19.2, the newest release,
# beside the default ./.venv (megatron-core 0.16.1). Idempotent and fast when up to date.
# megatron-core 0.19.2 ships a cp311 wheel but its metadata says Requires-Python >= 3.12, so it
# alone is installed with --ignore-requires-python --no-deps on the machine's Python 3.11 (with
# the flag for everything, pip would pick numpy releases that need 3.12); its pipeline schedules
# import `triton` unconditionally (moe/ops/paged_stash.py), a CPU-installable wheel.
# torch is installed FIRST (TORCH_SPEC, the CPU wheel) so that nothing can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
MCORE_SPEC="${MCORE_SPEC:-megatron-core==0.19.2}"
env=".venv-mcore019"
stamp="$env/.lmrl-installed"
want="$(cat pyproject.toml scripts/bootstrap_mcore019.sh | sha256sum | cut -d' ' -f1) ${TORCH_SPEC} ${MCORE_SPEC}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$env/bin/python" ] || "$PYTHON" -m venv "$env"
"$env/bin/python" -m pip install -q --upgrade pip
"$env/bin/python" -m pip install -q "$TORCH_SPEC"
"$env/bin/python" -m pip install -q --ignore-requires-python --no-deps "$MCORE_SPEC"
"$env/bin/python" -m pip install -q "numpy" "packaging>=24.2" triton
"$env/bin/python" -m pip install -q -e ".[dev,plot,hf]"
"$env/bin/python" -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
echo "$want" > "$stamp"
