"""Cost of Lightning around megatron-core: ms per optimizer step, Trainer vs the bare loop.

Run: ``.venv/bin/python benchmarks/strategy_overhead.py``. For each layout on two CPU gloo ranks,
the same tiny GPT (4 layers, hidden 256), global batch 16 x 64 tokens in micro-batches of 4 and
Adam, trained once by the bare megatron loop of ``lightning_mcore_rl.testing.training`` and once by
``Trainer(strategy=MCoreRLStrategy(...))`` (progress bar and CSV logging on, every step logged).
Time per step is the median over steps 5..N of the wall time between consecutive step starts, so
the Trainer's figure includes data loading, hooks, logging and the optimizer wrapper.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state, run_on_ranks
from lightning_mcore_rl.testing.training import build_training, train_step

STEPS, GLOBAL_BATCH, MBS, SEQ, VOCAB = 30, 16, 4, 64, 128
MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8}


class _Rows(Dataset):
    def __init__(self) -> None:
        self.rows = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.rows[i, :-1], "labels": self.rows[i, 1:]}


class _Module(MCoreRLModule):
    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        return tiny_gpt(tiny_gpt_config(**MODEL), vocab_size=VOCAB, vp_stage=vp_stage)

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0)


class _StepClock(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def _median_step(starts: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(starts[4:], starts[5:], strict=False))


def _bare(tp: int, pp: int) -> float:
    init_megatron_state(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    setup = build_training(clip_grad=1.0, **MODEL)
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    data = _Rows().rows
    starts = []
    for step in range(STEPS):
        starts.append(time.perf_counter())
        rows = data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH].chunk(dp)[
            ps.get_data_parallel_rank()
        ]
        batches = [
            {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous()}
            for mb in rows.split(MBS)
        ]
        train_step(setup, batches)
    starts.append(time.perf_counter())
    destroy_megatron_state()
    return _median_step(starts)


def _lightning(tp: int, pp: int, log_dir: str) -> float:
    clock = _StepClock()
    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=MBS
        ),
        max_steps=STEPS,
        gradient_clip_val=1.0,
        logger=CSVLogger(log_dir),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    dp = world // (tp * pp)
    trainer.fit(_Module(), DataLoader(_Rows(), batch_size=GLOBAL_BATCH // dp))
    clock.starts.append(time.perf_counter())
    return _median_step(clock.starts)


def _rank(rank: int, tp: int, pp: int, log_dir: str) -> tuple[float, float]:
    torch.manual_seed(0)
    return _bare(tp, pp), _lightning(tp, pp, log_dir)


def main() -> None:
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {STEPS} steps per run")
    print("| layout | bare ms/step | Trainer ms/step | ratio |\n|---|---|---|---|")
    for name, tp, pp in (("TP=2", 2, 1), ("PP=2", 1, 2), ("DP=2", 1, 1)):
        with tempfile.TemporaryDirectory() as log_dir:
            results = run_on_ranks(_rank, 2, tp, pp, log_dir, timeout=600)
        bare = max(r[0] for r in results) * 1e3
        lightning = max(r[1] for r in results) * 1e3
        print(f"| {name} | {bare:.1f} | {lightning:.1f} | {lightning / bare:.2f} |")


if __name__ == "__main__":
    main()
