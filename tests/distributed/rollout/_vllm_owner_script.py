"""Start a ``VLLMRolloutSource`` in a one-rank gloo world, print the pids of this process's
descendants (the engine and its worker) and exit with ``os._exit`` (no ``atexit``, no
shutdown), as a killed rank would. Usage: ``python _vllm_owner_script.py HF_DIR PORT``."""

from __future__ import annotations

import os
import sys

import psutil
import torch.distributed as dist

from lightning_mcore_rl.rollout import VLLMRolloutSource


def main() -> None:
    hf_dir, port = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    VLLMRolloutSource(hf_dir, dist.group.WORLD)
    pids = [child.pid for child in psutil.Process().children(recursive=True)]
    print(f"descendants {pids}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
