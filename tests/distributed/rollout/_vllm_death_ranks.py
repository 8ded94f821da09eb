"""Rank function of ``test_vllm_engine_failures.py``: GRPO with ``RolloutSpec(backend="vllm")``
at TP=2 under a Trainer (one engine, owned by rank 0), its engine's process or worker SIGKILLed
in the middle of a refit (after the second tensor is sent); each rank returns the error
``trainer.fit`` raised."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import psutil
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.recipes import GRPOModule, HFModelSpec, PromptDataModule, RolloutSpec
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.strategy.config import ReliabilityConfig

KILL_STEP = 1
"""The step whose refit (the first after an optimizer step) loses its engine."""
TIMEOUT_S = 60.0
"""The strategy's collective timeout: a rank waiting on a dead engine's owner would fail by then
(as ``CollectiveFailure``), so the test fails in minutes rather than hanging."""


def _engine_process(title: str) -> int:
    """The pid of this rank's descendant titled ``title`` (vLLM's ``setproctitle``:
    ``VLLM::EngineCore``, ``VLLM::Worker``), found by the OS, not through the source."""
    found = [p.pid for p in psutil.Process().children(recursive=True) if p.name() == title]
    assert len(found) == 1, f"{title}: {found}"
    return found[0]


class _KillMidRefit(Callback):
    """On the engine's owner at step ``KILL_STEP``: the refit's weight stream SIGKILLs the
    process titled ``title`` once two tensors have gone (the refit connection then closes
    under the sender). Records the pid and when."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.killed: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
        source = module.rollout_source.source
        if trainer.global_step != KILL_STEP or not source.is_generator:
            return
        victim = _engine_process(self.title)
        update, killed = source.update_weights, self.killed

        def stream(weights: Iterable[Any]) -> Iterator[Any]:
            for i, pair in enumerate(weights):
                if i == 2:
                    os.kill(victim, signal.SIGKILL)
                    killed.update(pid=victim, at=time.monotonic())
                yield pair

        # a stand-in for a crash at an arbitrary moment of the refit: the stream is the
        # trainer's real export, the engine and the kill are real
        source.update_weights = lambda weights: update(stream(weights))


def engine_killed_run(rank: int, hf_dir: str, title: str) -> dict[str, Any]:
    """3 steps of GRPO at TP=2; the process titled ``title`` is SIGKILLed in step 1's refit.
    Returns the error ``fit`` raised (type, message, ``pid``/``exitcode`` attributes), the
    killed pid and the seconds from the kill to the error (rank 0)."""
    killer = _KillMidRefit(title)
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=2,
            microbatching=MicrobatchConfig(micro_batch_size=4),
            reliability=ReliabilityConfig(timeout=timedelta(seconds=TIMEOUT_S)),
        ),
        max_steps=3,
        gradient_clip_val=1.0,
        callbacks=[killer],
    )
    module = GRPOModule(
        model=HFModelSpec(path=hf_dir),
        rollout=RolloutSpec(group_size=2, max_new_tokens=4, temperature=0.8, backend="vllm"),
        lr=1e-2,
    )
    try:
        trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=4, num_steps=3))
    except Exception as error:  # the outcome under test, returned to the test process
        seconds = time.monotonic() - killer.killed["at"] if killer.killed else None
        return {
            "type": type(error).__name__,
            "message": str(error),
            "pid": getattr(error, "pid", None),
            "exitcode": getattr(error, "exitcode", None),
            "killed": killer.killed.get("pid"),
            "seconds": seconds,
            "step": trainer.global_step,
        }
    return {"type": None, "killed": killer.killed.get("pid"), "step": trainer.global_step}
