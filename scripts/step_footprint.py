"""Package files and functions one default GRPO step enters (issue 38's measure).

Runs ``Trainer.fit(GRPOModule(), datamodule=PromptDataModule(...))`` on one CPU rank (the tiny GPT,
the counting task, the embedded megatron sampler, padded batches, TP=PP=DP=1) and records, with
``sys.setprofile`` and ``threading.setprofile`` (every thread), each Python function entered
under ``lightning_mcore_rl/`` during the third batch: Lightning's whole ``advance`` of the
training epoch loop (fetch, rollout, logprob pass, training pass, optimizer step, statistics).

Usage: ``.venv/bin/python scripts/step_footprint.py [--functions]``; prints the file count, the
function count and the files (with ``--functions``: each file's functions).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_mcore_rl"
PROFILED_BATCH = 2  # the third batch: past the first step's lazy set-up and caches


def measure() -> dict[str, set[str]]:
    """``{package-relative file: {qualified function names}}`` entered during one whole step."""
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_mcore_rl import MCoreRLStrategy
    from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule

    entered: dict[str, set[str]] = defaultdict(set)
    root = str(PACKAGE) + os.sep

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(root):
            # `co_qualname` is Python 3.11+; 3.10 names the bare function
            code = frame.f_code
            entered[path[len(root) :]].add(getattr(code, "co_qualname", code.co_name))

    class ProfileOneStep(Callback):
        """Wraps the epoch loop's ``advance`` (one whole batch) so the chosen call is profiled."""

        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            loop: _TrainingEpochLoop = trainer.fit_loop.epoch_loop
            advance: Callable[[Any], None] = loop.advance
            calls = [0]

            def profiled(data_fetcher: Any) -> None:
                calls[0] += 1
                if calls[0] != PROFILED_BATCH + 1:
                    return advance(data_fetcher)
                threading.setprofile(profile)
                sys.setprofile(profile)
                try:
                    return advance(data_fetcher)
                finally:
                    sys.setprofile(None)
                    threading.setprofile(None)

            loop.advance = profiled  # type: ignore[method-assign]

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            strategy=MCoreRLStrategy(),
            max_steps=PROFILED_BATCH + 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ProfileOneStep()],
            default_root_dir=out,
        )
        trainer.fit(GRPOModule(), datamodule=PromptDataModule(num_steps=PROFILED_BATCH + 1))
    return entered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", action="store_true", help="list each file's functions")
    args = parser.parse_args()
    entered = measure()
    print(f"files: {len(entered)}  functions: {sum(len(f) for f in entered.values())}")
    for path in sorted(entered):
        print(f"  {path} ({len(entered[path])})")
        if args.functions:
            for name in sorted(entered[path]):
                print(f"      {name}")


if __name__ == "__main__":
    main()
