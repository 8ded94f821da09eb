#!/usr/bin/env bash
# Create ./.venv-trl (if needed): TRL's own environment for benchmarks/grpo_vs_trl.py, the peer
# side of the GRPO step comparison (TRL's GRPOTrainer with plain transformers.generate).
# Its own environment so TRL's dependency pins never touch ./.venv.
# torch is installed FIRST (TORCH_SPEC, the 2.13.0 CPU wheel) and pinned by a constraints file for
# every later install, so nothing below can pull a CUDA build. transformers is pinned to ./.venv's
# version when ./.venv has one (both sides then run the same model code), else left to TRL.
# Idempotent and fast when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TRL_SPEC="${TRL_SPEC:-trl==1.16.0}"
env=".venv-trl"
stamp="$env/.lmrl-installed"
tf_spec=""
if [ -x .venv/bin/python ]; then
  tf_version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || true)"
  [ -n "$tf_version" ] && tf_spec="transformers==$tf_version"
fi
want="$(sha256sum scripts/bootstrap_trl.sh | cut -d' ' -f1) ${TORCH_SPEC} ${TRL_SPEC} ${tf_spec}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$env/bin/python" ] || "$PYTHON" -m venv "$env"
"$env/bin/python" -m pip install -q --upgrade pip
"$env/bin/python" -m pip install -q "$TORCH_SPEC"
constraints="$env/constraints.txt"
# the torch just installed, exactly (its local version tag included): a CUDA build cannot satisfy it
"$env/bin/python" -c 'import torch; print(f"torch=={torch.__version__}")' > "$constraints"
[ -n "$tf_spec" ] && echo "$tf_spec" >> "$constraints"
"$env/bin/python" -m pip install -q -c "$constraints" "$TRL_SPEC" ${tf_spec:+"$tf_spec"}
"$env/bin/python" -c "
import torch, transformers, trl
assert torch.__version__.startswith('2.13'), torch.__version__
assert not torch.version.cuda, torch.version.cuda
print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)
"
echo "$want" > "$stamp"
