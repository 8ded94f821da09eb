"""Train a tiny megatron-core GPT with tensor parallelism TP=2 on two CPU ranks.

Launch: ``scripts/run_example.sh`` (= ``torchrun --standalone --nproc-per-node 2
examples/train_tiny_gpt.py``). megatron-core's real 1F1B/no-pipelining schedule, DDP, Adam and
gradient clipping run on CPU with gloo under :func:`lightning_mcore_rl.testing.cpu_emulation`.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from lightning_mcore_rl.testing import cpu_emulation, destroy_megatron_state, init_megatron_state
from lightning_mcore_rl.testing.training import build_training, make_microbatches, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    with cpu_emulation():
        init_megatron_state(tensor_model_parallel_size=args.tp)
        setup = build_training(lr=args.lr)
        batches = make_microbatches(num_microbatches=2, micro_batch_size=4, seq_length=32)
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            losses, grad_norm = train_step(setup, batches)
            if dist.get_rank() == 0:
                loss = sum(losses) / len(losses)
                print(f"step {step:3d}  loss {loss:.4f}  grad_norm {grad_norm:.3f}", flush=True)
        if dist.get_rank() == 0:
            elapsed = time.perf_counter() - start
            print(f"{args.steps} steps in {elapsed:.1f} s on {dist.get_world_size()} CPU ranks")
        destroy_megatron_state()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
