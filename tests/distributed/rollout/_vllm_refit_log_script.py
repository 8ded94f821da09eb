"""Start a ``VLLMRolloutSource`` in a one-rank gloo world, refit it ``REFITS`` times from the
Hugging Face model's own weights, sample once and shut the engine down; prints ``refits N``
and ``sampled``. The engine's log (its process and worker write to this process's stderr) is
what ``test_vllm_engine_failures.py`` reads. Usage: ``python _vllm_refit_log_script.py HF_DIR
PORT``."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from lightning_mcore_rl.rollout import SamplingConfig, VLLMRolloutSource

REFITS = 3


def main() -> None:
    from transformers import AutoModelForCausalLM

    hf_dir, port = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    source = VLLMRolloutSource(hf_dir, dist.group.WORLD)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for _ in range(REFITS):
        source.update_weights(iter(model.state_dict().items()))
    print(f"refits {REFITS}", flush=True)
    source.generate(torch.tensor([[3, 14, 15]]), SamplingConfig(max_new_tokens=4, seed=1))
    print("sampled", flush=True)
    source.close()
    dist.destroy_process_group()


if __name__ == "__main__":  # the engine's process is spawned: it re-imports this file
    main()
