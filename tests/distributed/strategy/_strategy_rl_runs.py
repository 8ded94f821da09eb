"""Rank functions for the ``MCoreRLModule(loss_fn=...)`` path: a ClippedPG loss through
``lightning_mcore_rl.train`` under a Trainer, against the same train-layer calls in a bare loop."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from _strategy_runs import VOCAB, BareRun, make_trainer
from helpers.distributed import RunSpec
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_mcore_rl import MCoreRLModule
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state
from lightning_mcore_rl.testing.training import build_training, optimizer_step

S = 16
PG_CFG = {"reference_policy_kl_penalty": 0.01, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2}


class RolloutRows(Dataset):
    """Right-padded GRPO samples (``input_ids [S]``, masks, advantages, logprobs)."""

    def __init__(self, num_rows: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(6, S + 1, (num_rows,), generator=g)
        positions = torch.arange(S)[None, :]
        real = positions < self.lengths[:, None]
        self.ids = torch.randint(1, VOCAB, (num_rows, S), generator=g) * real
        self.token_mask = (real & (positions >= 3)).float()
        self.advantages = torch.randn(num_rows, S, generator=g)
        near = -torch.log(torch.tensor(float(VOCAB)))
        self.logprobs = [near + 0.15 * torch.randn(num_rows, S, generator=g) for _ in range(3)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "input_lengths": self.lengths[i],
            "token_mask": self.token_mask[i],
            "sample_mask": torch.tensor(1.0),
            "advantages": self.advantages[i],
            "prev_logprobs": self.logprobs[0][i],
            "generation_logprobs": self.logprobs[1][i],
            "reference_policy_logprobs": self.logprobs[2][i],
        }


class GRPOModule(MCoreRLModule):
    """ClippedPG on the tiny GPT of ``num_layers`` layers (split over the PP x VPP chunks)."""

    def __init__(self, num_layers: int = 2) -> None:
        super().__init__(loss_fn=ClippedPGLossFn(PG_CFG))
        self.num_layers = num_layers
        self.microbatch_losses: list[tuple[float, ...]] = []

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(
            self.parallel_groups, num_layers=self.num_layers, calculate_per_token_loss=True
        )
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, adam_eps=1e-4, weight_decay=0.0)

    def training_step(self, batch: Any, batch_idx: int = 0) -> dict[str, Any]:
        out = self.forward_backward(batch)
        self.microbatch_losses.append(out.microbatch_losses)
        self.log("train_loss", out.loss, batch_size=1)
        return out.as_step_result()


class _Logprobs(Callback):
    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        self.values.append(module.compute_logprobs(batch))


@dataclass(frozen=True)
class GRPOResult:
    """One rank of :func:`grpo_rank`: the bare train-layer loop and what the Trainer run did."""

    bare: BareRun
    microbatch_losses: list[tuple[float, ...]]
    metrics: dict[str, float]
    logprobs: list[torch.Tensor]
    global_step: int


def grpo_rank(rank: int, spec: RunSpec) -> GRPOResult:
    world_size = int(os.environ["WORLD_SIZE"])
    bare = _bare_grpo(spec)
    destroy_megatron_state()
    logprobs = _Logprobs()
    trainer = make_trainer(spec, world_size, callbacks=[logprobs])
    module = GRPOModule()
    trainer.fit(module, DataLoader(RolloutRows(spec.rows), batch_size=spec.local_batch(world_size)))
    return GRPOResult(
        bare=bare,
        microbatch_losses=module.microbatch_losses,
        metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
        logprobs=logprobs.values,
        global_step=trainer.global_step,
    )


def _bare_grpo(spec: RunSpec) -> BareRun:
    from megatron.core import parallel_state as ps

    from lightning_mcore_rl.train import (
        LogprobsPostProcessor,
        LossPostProcessor,
        megatron_forward_backward,
        process_global_batch,
    )

    init_megatron_state(tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp)
    setup = build_training(clip_grad=0.0, calculate_per_token_loss=True)
    dataset = RolloutRows(spec.rows)
    dp_group = ps.get_data_parallel_group()
    sampler = DistributedSampler(
        dataset,
        num_replicas=ps.get_data_parallel_world_size(),
        rank=ps.get_data_parallel_rank(),
        shuffle=True,
        seed=0,
    )
    indices = list(sampler)
    local = spec.global_batch // ps.get_data_parallel_world_size()
    out = BareRun()
    for step in range(spec.steps):
        rows = [dataset[i] for i in indices[step * local : (step + 1) * local]]
        data = BatchedDataDict({k: torch.stack([r[k] for r in rows]) for k in rows[0]})
        batch = process_global_batch(data, dp_group, spec.mbs)
        run = megatron_forward_backward(
            setup.chunks[0], batch.iterator(), batch.num_microbatches, batch.seq_length,
            batch.micro_batch_size, LogprobsPostProcessor(None), forward_only=True,
            groups=megatron_groups(),
        )  # fmt: skip
        out.logprobs.append(torch.cat([r["logprobs"] for r in run]) if run else None)
        for chunk in setup.chunks:
            chunk.zero_grad_buffer()
        setup.optimizer.zero_grad()
        post = LossPostProcessor(ClippedPGLossFn(PG_CFG), None, batch.num_microbatches)
        metrics = megatron_forward_backward(
            setup.chunks[0], batch.iterator(), batch.num_microbatches, batch.seq_length,
            batch.micro_batch_size, post, global_valid_seqs=batch.global_valid_seqs,
            global_valid_toks=batch.global_valid_toks, groups=megatron_groups(),
        )  # fmt: skip
        out.losses.append(tuple(float(m["loss"]) for m in metrics))
        out.grad_norms.append(optimizer_step(setup))
    return out
