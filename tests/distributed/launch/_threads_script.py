"""The tiny GPT at TP=2 under Lightning's own script launcher, its two ranks started with
DIFFERENT torch intra-op thread counts (``test_launch_threads.py``).

Usage: ``python _threads_script.py OUT_DIR --steps N [--kill-after K [--kill-phase start|end]]
[--resume] [--reference]``

Before each ``fit`` each process calls ``torch.set_num_threads(1 + LOCAL_RANK)`` (the launcher
sets ``LOCAL_RANK`` for the ranks it starts, not for itself): rank 0 starts with 1 thread, rank
1 with 2, as under the launcher before every rank ran it (``OMP_NUM_THREADS`` must be set, or
the launcher would reset both to ``cpus // 2``). A checkpoint is saved after every step
(``OUT_DIR/ckpt``, ``last.ckpt``), the data position with it (:class:`ResumableLoader`).

``--kill-after K``: rank 0 SIGKILLs its process group (both ranks at once, as a lost node) after
K steps: at the start of step K+1 (``start``: step K's checkpoint is saved) or at the end of
step K+1 before its checkpoint (``end``: one computed step is lost). ``--resume``: ``fit`` from
``ckpt_path="last"``. ``--reference``: then, in the same processes, an uninterrupted ``fit``
from scratch (checkpoints in ``OUT_DIR/reference_ckpt``), the threads set apart again.

Every rank that finishes writes ``OUT_DIR/rank{r}.pt``: per run (``"run"``, ``"reference"``) the
per-step ``(step, loss, grad_norm)``, the thread counts at start and in the first step, every
parameter of its chunk and the names of the TP-replicated ones; every rank prints each step's
``(step, loss, grad_norm)`` (float reprs: exact).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.strategy import MicrobatchConfig, ResumableLoader, resumable_dataloader

VOCAB = 64
SEQ = 12
ROWS_PER_STEP = 4


class TokenRows(Dataset):
    """Deterministic LM samples ``{"tokens": [S], "labels": [S]}``."""

    def __init__(self, num_rows: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, VOCAB, (num_rows, SEQ + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        return {"tokens": row[:-1], "labels": row[1:]}


class TinyGPT(MCoreRLModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(self.parallel_groups, num_layers=2)
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-2, adam_eps=1e-4, weight_decay=0.0)

    def train_dataloader(self) -> ResumableLoader:
        rows = TokenRows(ROWS_PER_STEP * self.steps)
        return resumable_dataloader(rows, self.trainer, ROWS_PER_STEP, shuffle=False)


class Recorder(Callback):
    """Per-step loss and grad norm, the thread count in the first step; the kill."""

    def __init__(self, kill_after: int | None, kill_phase: str) -> None:
        self.steps: list[tuple[int, float, float]] = []
        self.threads_in_step: int | None = None
        self.kill_after = kill_after
        self.kill_phase = kill_phase

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self.threads_in_step is None:
            self.threads_in_step = torch.get_num_threads()
        self._maybe_kill(trainer, "start")

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        step = cast("MCoreRLStrategy", trainer.strategy).last_optimizer_step
        assert step is not None and step.grad_norm is not None
        loss = float(trainer.callback_metrics["train_loss"])
        self.steps.append((trainer.global_step, loss, float(step.grad_norm)))
        # one write per line: both ranks share the launcher's stdout pipe
        sys.stdout.write(f"rank {trainer.global_rank}: step {self.steps[-1]!r}\n")
        sys.stdout.flush()
        self._maybe_kill(trainer, "end")  # before ModelCheckpoint's save (it runs last)

    def _maybe_kill(self, trainer: Trainer, phase: str) -> None:
        done = trainer.global_step - (phase == "end")  # steps saved before this one
        if trainer.global_rank == 0 and phase == self.kill_phase and done == self.kill_after:
            os.killpg(os.getpgid(0), signal.SIGKILL)


def fit(
    args: argparse.Namespace, ckpt: Path, kill_after: int | None, resume: bool
) -> dict[str, Any]:
    """One ``fit`` of ``args.steps`` steps, both ranks started with different thread counts;
    returns what the run left (written by the caller)."""
    torch.set_num_threads(1 + int(os.environ.get("LOCAL_RANK", "0")))
    threads_at_start = torch.get_num_threads()
    recorder = Recorder(kill_after, args.kill_phase)
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=2)
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        logger=False,
        callbacks=[recorder, ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1, save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(TinyGPT(args.steps), ckpt_path="last" if resume else None)
    (chunk,) = strategy.model_chunks
    named = list(chunk.named_parameters())
    return {
        "steps": recorder.steps,
        "threads_at_start": threads_at_start,
        "threads_in_step": recorder.threads_in_step,
        "tp_rank": strategy.groups.tp_rank,
        "params": {name: p.detach().clone() for name, p in named},
        "replicated": [n for n, p in named if not getattr(p, "tensor_model_parallel", False)],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--kill-phase", choices=("start", "end"), default="start")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    print(f"started: {args}", flush=True)  # progress: the imports are done
    runs = {"run": fit(args, args.out / "ckpt", args.kill_after, args.resume)}
    if args.reference:
        runs["reference"] = fit(args, args.out / "reference_ckpt", None, False)
    rank = torch.distributed.get_rank()
    torch.save(runs, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
