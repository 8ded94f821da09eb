"""The checks before a rollout's first collective, under the GRPO recipe at TP=2 (one replica of
two gloo ranks, the embedded sampler): a NaN written into one weight shard on rank 1 between
steps raises ``NonFiniteWeightError`` on both ranks naming the parameter and its rank (rank 0's
shards are finite: it stops on the agreement), not ``torch.multinomial``'s "probability tensor
contains inf, nan"; and a datamodule yielding fewer prompts on rank 1 raises
``BatchMismatchError`` on both ranks, not a gloo abort in the sampler's first all-gather."""

from __future__ import annotations

from typing import Any

import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state, run_on_ranks

PROMPTS = 4  # per step on rank 0 (x group size 4: 16 rows)


class NaNWeight(Callback):
    """Before step 1, on rank 1 only, one entry of its ``linear_fc1`` weight shard becomes NaN
    (as a callback or a foreign checkpoint could); records the parameter's name."""

    def __init__(self) -> None:
        self.name = ""

    def on_train_batch_start(
        self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != 1:
            return
        for name, param in module.mcore_strategy.model_chunks[0].named_parameters():
            if name.endswith("linear_fc1.weight"):
                self.name = name.removeprefix("module.")
                if trainer.global_rank == 1:
                    with torch.no_grad():
                        param.view(-1)[3] = float("nan")
                return


def _fit(rank: int, callbacks: list[Callback], prompts: int) -> str:
    """A 2-step GRPO fit at TP=2 with ``prompts`` prompts a step on this rank: ``"type:
    message"`` of what it raised (``""``: nothing)."""
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(tensor_model_parallel_size=2,
                                 microbatching=MicrobatchConfig(micro_batch_size=4)),
        max_steps=2, callbacks=callbacks, num_sanity_val_steps=0,
    )  # fmt: skip
    try:
        trainer.fit(GRPOModule(), datamodule=PromptDataModule(prompts_per_step=prompts,
                                                              num_steps=2))  # fmt: skip
        return ""
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    finally:
        destroy_megatron_state()


def _preflight(rank: int) -> dict[str, str]:
    nan = NaNWeight()
    out = {"nan_weight": _fit(rank, [nan], PROMPTS), "parameter": nan.name}
    out["fewer_prompts"] = _fit(rank, [], PROMPTS if rank == 0 else PROMPTS // 2)
    return out


def test_rollout_checks_raise_on_both_ranks_before_the_first_collective() -> None:
    results = run_on_ranks(_preflight, 2, timeout=480)
    for rank, out in enumerate(results):
        name = out["parameter"]
        assert name.startswith("decoder.") and name.endswith("linear_fc1.weight"), name
        assert out["nan_weight"].startswith(
            "NonFiniteWeightError: The model that samples the rollout holds non-finite weights: "
            f"`{name}`: 1 of "
        ), (rank, out["nan_weight"])
        assert "entries NaN/inf on rank 1. Sampling from them fails" in out["nan_weight"]
        assert "a callback writing into the weights" in out["nan_weight"]
        assert out["fewer_prompts"].startswith(
            "BatchMismatchError: Before the rollout: The ranks [0, 1] of model replica 0 "
            "(data-parallel rank 0: its tensor/context/pipeline-parallel ranks) hold batches "
            "of different numbers of rows (rank 0: 16, rank 1: 8); they must hold the same batch."
        ), (rank, out["fewer_prompts"])
    assert results[0] == results[1]  # the same decisions and messages on both ranks
