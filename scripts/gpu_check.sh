#!/usr/bin/env bash
# The one prepared script for a session that is lent the H200 device (see the device tool's README).
# The device image has python3 3.12 with torch + lightning but no megatron-core and no network, so
# the wheels travel with the working tree. Here, once per session (3.5 MB):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl \
#     megatron-core==0.16.1 jsonargparse==4.53.0 docstring-parser typeshed-client
# Then: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Results land in $OUT/gpu_check.log; copy the numbers into BENCHMARKS.md and the closing note.
set -uo pipefail
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site"
  python3 -c "import torch, megatron.core, lightning; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  timeout 420 python3 -m pytest -m gpu -s -q -p no:cacheprovider tests/gpu \
    tests/distributed/data/test_cp_attention_gpu.py
  echo "gpu tests rc=$?"
} 2>&1 | tee "$OUT/gpu_check.log"
