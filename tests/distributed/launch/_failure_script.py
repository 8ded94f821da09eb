"""The tiny GPT of ``_train_script.py`` (TP=2, Lightning's own 2-process launcher) with one fault
injected on one rank (``test_launch_failures.py``).

Usage: ``python _failure_script.py OUT_DIR --fault F --rank R --step N [--steps S]
[--timeout T] [--resume]``

Faults, on rank ``R`` at global step ``N``:

* ``sigterm``: SIGTERM to itself 50 ms into the step (mid-step, usually inside a collective);
* ``kill-save``: SIGKILL to itself during the step-``N`` save, once megatron's shard writer
  process exists (a ``ModelCheckpoint`` saves every ``N`` steps);
* ``stop``: SIGSTOP to itself at the step's start (a stopped rank);
* ``sleep``: sleeps for an hour at the step's start (a stalled rank, alive);
* ``late``: sleep ``T + 5`` s before ``fit`` (a rank that arrives late at the rendezvous);
* ``none``: no fault.

Every rank writes ``OUT_DIR/pid{rank}`` (its pid, at setup), ``OUT_DIR/exit{rank}`` (the exit
code it leaves with), the faulty rank ``OUT_DIR/fault`` (when the fault is injected; for
``kill-save`` the shard writers' pids) and ``OUT_DIR/rank{rank}.json`` (per-step losses, the last global step,
the pid of each process it forked during a save) when ``fit`` returns; ``--resume`` runs
``fit(ckpt_path="last")``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _train_script import GLOBAL_BATCH, Recorder, TinyGPT, TokenRows
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.strategy.config import ReliabilityConfig
from lightning_mcore_rl.strategy.resumable import ResumableLoader


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (``/proc/<pid>/task/*/children``)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return found


class Fault(Callback):
    """Writes the pid file and injects ``fault`` on global rank ``rank`` at step ``step``."""

    def __init__(self, out: Path, fault: str, rank: int, step: int) -> None:
        self.out, self.fault, self.rank, self.step = out, fault, rank, step

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        (self.out / f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.fault in ("stop", "sleep", "sigterm"):
            (self.out / "fault").write_text("")
        if self.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.fault == "sleep":
            time.sleep(3600)
        elif self.fault == "sigterm":
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()

    def on_save_checkpoint(self, trainer: Trainer, *args: Any) -> None:
        if self.fault == "kill-save" and (trainer.global_rank, trainer.global_step) == (
            self.rank,
            self.step,
        ):
            threading.Thread(target=self._kill_once_writing, daemon=True).start()

    def _kill_once_writing(self) -> None:
        deadline = time.monotonic() + 20
        while not children(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.001)
        (self.out / "fault").write_text(" ".join(map(str, children(os.getpid()))))
        os.kill(os.getpid(), signal.SIGKILL)


def main(args: argparse.Namespace) -> None:
    print(f"started: {args}", flush=True)  # progress: the imports are done
    if args.fault == "late" and os.environ.get("LOCAL_RANK", "0") == str(args.rank):
        time.sleep(args.timeout + 5)
    recorder = Recorder()
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2,
        microbatching=MicrobatchConfig(micro_batch_size=2),
        reliability=ReliabilityConfig(timeout=timedelta(seconds=args.timeout)),
    )
    every = args.step if args.fault == "kill-save" else 10 * args.steps
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
        gradient_clip_val=1.0, logger=False,
        callbacks=[
            recorder, Fault(args.out, args.fault, args.rank, args.step),
            ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=every),
        ],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    loader = ResumableLoader(DataLoader(TokenRows(GLOBAL_BATCH * args.steps), GLOBAL_BATCH))  # DP=1
    trainer.fit(TinyGPT(), loader, ckpt_path="last" if args.resume else None)
    result = {"losses": recorder.losses, "global_step": trainer.global_step}
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fault", default="none")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--resume", action="store_true")
    arguments = parser.parse_args()
    rank = os.environ.get("LOCAL_RANK", "0")  # one node: the global rank
    code: Any = 1
    try:
        main(arguments)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
        raise
    finally:
        (arguments.out / f"exit{rank}").write_text(str(code))
        sys.stdout.flush()
