#!/usr/bin/env bash
# The one prepared script for a session that is lent the H200 device (see the device tool's README).
# Never called from CI. The device image has python3 3.12 with torch + lightning but no
# megatron-core and no network, so the wheels travel with the working tree. Here, once per
# session (3.5 MB; .whl/peer, 47 MB, for the peer benchmark: transformers and its dependencies,
# of which pip installs only what the image lacks; the carry limit is 64 MiB):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl \
#     megatron-core==0.16.1 jsonargparse==4.53.0 docstring-parser typeshed-client
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
#     -d .whl/peer transformers==5.25.0 psutil
# Then: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Sections (GPU_CHECK_SECTIONS, default "tests"): `tests` runs the GPU-marked tests; `bench` runs
# the two issue-26 benchmarks on CUDA (benchmarks/fused_logprobs_memory.py at 8192 tokens,
# V=128k; benchmarks/peer_update_step.py on one GPU, fp32 and bf16 rows), each under its own
# timeout. Both sections together may pass one run's 600 s limit, so run the bench on its own:
#   run(command="GPU_CHECK_SECTIONS=bench bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Results land in $OUT/gpu_check.log; copy the numbers into BENCHMARKS.md and the closing note.
set -uo pipefail
OUT="${OUT:-/tmp/gpu_check_out}"
SECTIONS="${GPU_CHECK_SECTIONS:-tests}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site"
  python3 -c "import torch, megatron.core, lightning; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  if [[ " $SECTIONS " == *" tests "* ]]; then
    timeout 420 python3 -m pytest -m gpu -s -q -p no:cacheprovider tests/gpu \
      tests/distributed/data/test_cp_attention_gpu.py
    echo "gpu tests rc=$?"
  fi
  if [[ " $SECTIONS " == *" bench "* ]]; then
    # megatron CE vs the logits path (deferred bf16 and fp32 logits) vs fused (recomputing
    # backward, and its gradient in the forward), peak CUDA memory and time
    timeout 150 python3 benchmarks/fused_logprobs_memory.py --device cuda --tokens 8192 \
      --variants megatron_ce plain_chunked plain_chunked_fp32 fused fused_in_forward
    echo "fused_logprobs_memory rc=$?"
    # the peer benchmark's interpreter: the image's packages plus the carried transformers
    PEER_PY=python3
    if ! python3 -c "import transformers, psutil" 2>/dev/null && [ -d .whl/peer ]; then
      python3 -m venv --system-site-packages /tmp/peer
      /tmp/peer/bin/pip install -q --no-index --find-links .whl/peer transformers==5.25.0 psutil
      PEER_PY=/tmp/peer/bin/python
    fi
    if "$PEER_PY" -c "import transformers, psutil" 2>/dev/null; then
      timeout 330 "$PEER_PY" benchmarks/peer_update_step.py --device cuda --ranks 1 \
        --stacks hf_ddp trainer_fused trainer_fused_fwd_grad hf_ddp_bf16 trainer_fused_bf16 \
        trainer_fused_fwd_grad_bf16 --steps 3
      echo "peer_update_step rc=$?"
    else
      echo "peer_update_step skipped: transformers/psutil not importable (carry .whl/peer)"
    fi
  fi
} 2>&1 | tee "$OUT/gpu_check.log"
