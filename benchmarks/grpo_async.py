"""Wall time per GRPO step, synchronous (``max_staleness=0``) against asynchronous
(``max_staleness=1``: the next batch is sampled while the current one trains), per rollout
backend, in one run.

Run: ``.venv-vllm/bin/python benchmarks/grpo_async.py`` (with vLLM: the ``"vllm"`` rows; the
main ``.venv`` runs the ``"hf"`` and ``"megatron"`` rows only) ``[--backends vllm,hf,megatron]
[--devices 1] [--steps 12]``. Writes a random fp32 Llama (4 layers, hidden 256, 8 heads of 32,
vocabulary 1024) to a temporary directory; GRPO on the counting task, ``--prompts`` prompts x
``--group`` completions of ``--new-tokens`` tokens per step, on ``--devices`` ranks (TP=1,
DP=devices: one generator per rank). ``--split`` (vLLM): the engine is bound to the last CPU
core (``VLLM_CPU_OMP_THREADS_BIND``) and the training ranks to the others, one intra-op thread
each, so sampling and training use different cores (the CPU analogue of an engine on its own
GPU); without it both share every core. A step's time is the wall time between two
``on_train_batch_end`` calls on rank 0; the median over the steps after the first two (the
first holds the engine start, the second the first asynchronous hand-over). Ratio: async /
sync of the same backend.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from typing import Any

MODEL: dict[str, Any] = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
}


def _write_llama(directory: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(directory)


def _grpo_rank(rank: int, directory: str, backend: str, staleness: int, args: Any) -> list[float]:
    """The wall time of every step on this rank."""
    if args.split:
        import os

        import torch

        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[-1])
        os.sched_setaffinity(0, cores[:-1])
        torch.set_num_threads(1)
    from lightning.pytorch import Callback, Trainer

    from lightning_mcore_rl import MCoreRLStrategy
    from lightning_mcore_rl.losses import ClippedPGLossConfig
    from lightning_mcore_rl.recipes import GRPOModule, HFModelSpec, PromptDataModule, RolloutSpec
    from lightning_mcore_rl.strategy import MicrobatchConfig

    class Clock(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *unused: Any) -> None:
            self.ends.append(time.perf_counter())

    clock = Clock()
    per_rank = args.prompts * args.group // args.devices
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=per_rank)),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    loss = ClippedPGLossConfig(
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
    )
    rollout = RolloutSpec(
        group_size=args.group,
        max_new_tokens=args.new_tokens,
        backend=backend,
        max_staleness=staleness,
    )
    module = GRPOModule(model=HFModelSpec(path=directory), rollout=rollout, loss=loss, lr=1e-3)
    trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=args.prompts))
    return [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]


def main() -> None:
    from lightning_mcore_rl.testing import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="vllm,hf,megatron")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--split", action="store_true", help="engine and trainer on own cores")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if "vllm" in backends and importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed here: skipping the vllm rows (.venv-vllm/bin/python)")
        backends.remove("vllm")
    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as directory:
        _write_llama(directory)
        for backend in backends:
            medians = []
            for staleness in (0, 1):
                times = run_on_ranks(
                    _grpo_rank, args.devices, directory, backend, staleness, args, timeout=1800
                )[0]
                medians.append(statistics.median(times[1:]))  # after steps 0 and 1
                print(f"{backend} max_staleness={staleness}: step times {times}", flush=True)
            rows.append((backend, medians[0], medians[1]))
    print(
        f"\n{args.devices} rank(s), {args.prompts} prompts x {args.group} x {args.new_tokens}"
        f" tokens, split={args.split}"
    )
    print("| backend | sync s/step | async s/step | async / sync |\n|---|---|---|---|")
    for backend, sync, stale in rows:
        print(f"| {backend} | {sync:.3f} | {stale:.3f} | {stale / sync:.2f} |")


if __name__ == "__main__":
    main()
