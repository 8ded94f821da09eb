"""Rank functions of the MoE step tests: the tiny MoE GPT through ``train.run_global_batch``
(trainer-free) and through a Trainer, and an independent single-process reference of the router
losses (plain autograd, the aux loss computed here from the router weights)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from _strategy_rl_runs import PG_CFG, GRPOModule, RolloutRows, S
from _strategy_runs import VOCAB
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.strategy import MicrobatchConfig

E, TOPK, ROWS = 4, 2, 4
MOE = {
    "num_moe_experts": E,
    "moe_router_topk": TOPK,
    "add_bias_linear": False,
    "moe_token_dispatcher_type": "alltoall",  # the strategy refuses allgather under EP > 1
}


@dataclass(frozen=True)
class MoESpec:
    """One tiny-MoE step: layout and router-loss settings (module-level: pickled to ranks)."""

    ep: int = 1
    tp: int = 1
    aux: float = 0.0
    z: float | None = None
    capacity: float | None = None
    load_balancing: str = "aux_loss"
    experts: int = E
    sequence_parallel: bool | None = None  # None: TP > 1
    overrides: tuple[tuple[str, Any], ...] = ()  # other TransformerConfig fields

    def moe_fields(self, sequence_parallel: bool) -> dict[str, Any]:
        fields: dict[str, Any] = {
            **MOE,
            "num_moe_experts": self.experts,
            "moe_aux_loss_coeff": self.aux,
            "moe_z_loss_coeff": self.z,
            "moe_router_load_balancing_type": self.load_balancing,
            "sequence_parallel": sequence_parallel,
            "calculate_per_token_loss": True,
        }
        if self.capacity is not None:
            fields.update(moe_expert_capacity_factor=self.capacity, moe_token_drop_policy="probs")
        return {**fields, **dict(self.overrides)}


def rollout_batch(rows: int = ROWS, seed: int = 0) -> BatchedDataDict:
    data = RolloutRows(rows, seed=seed)
    items = [data[i] for i in range(rows)]
    return BatchedDataDict({k: torch.stack([r[k] for r in items]) for k in items[0]})


def step_rank(_rank: int, spec: MoESpec) -> dict[str, Any]:
    """ONE ClippedPG step of the tiny MoE GPT through ``run_global_batch`` (micro_batch_size 1,
    the global batch split over DP): loss, metrics, full grads by canonical name, grad norm."""
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state
    from lightning_mcore_rl.testing.training import build_training, gather_full_tensors
    from lightning_mcore_rl.train import LossPostProcessor, Microbatching, StepContext
    from lightning_mcore_rl.train.step import run_global_batch

    init_megatron_state(
        tensor_model_parallel_size=spec.tp,
        expert_model_parallel_size=spec.ep,
        expert_tensor_parallel_size=1,
    )
    sp = spec.tp > 1
    setup = build_training(clip_grad=0.0, **spec.moe_fields(sp))
    groups = megatron_groups()
    batch = rollout_batch()
    local = ROWS // groups.dp_size
    mine = BatchedDataDict({k: v[groups.dp_rank * local : (groups.dp_rank + 1) * local]
                            for k, v in batch.items()})  # fmt: skip
    for chunk in setup.chunks:
        chunk.zero_grad_buffer()
    loss_fn = ClippedPGLossFn(PG_CFG)
    context = StepContext(groups, Microbatching(micro_batch_size=1, sequence_parallel=sp))
    out = run_global_batch(
        setup.chunks, mine, context, loss=LossPostProcessor(loss_fn, None),
        normalizations=loss_fn.metric_normalizations,
    )  # fmt: skip
    grads = gather_full_tensors(setup, grads=True)
    _, grad_norm, _ = setup.optimizer.step()
    return {
        "loss": float(out.loss),
        "metrics": {k: float(v) for k, v in out.metrics.items()},
        "grads": grads,
        "grad_norm": float(grad_norm),
    }


def reference_rank(_rank: int, spec: MoESpec) -> dict[str, Any]:
    """One process, the whole global batch: the gradient of ``loss + aux * A + z * Z`` as
    (the package's step with the router losses OFF) + (plain autograd of ``aux * A + z * Z``),
    where per layer ``A = mean over microbatches of E * sum_e f_e * P_e`` (``f_e`` the fraction of
    the microbatch's top-k assignments that go to expert e, ``P_e`` its mean softmax probability)
    and ``Z = mean over tokens of logsumexp(logits)^2``, computed here from each router's input
    and weight; plus the router statistics counted here."""
    from lightning_mcore_rl.models.tiny_gpt import canonical_name
    from lightning_mcore_rl.testing import init_megatron_state
    from lightning_mcore_rl.train.model_inputs import process_microbatch

    off = step_rank(0, MoESpec(capacity=spec.capacity))
    init_megatron_state()
    config = tiny_gpt_config(None, **spec.moe_fields(False) | {"moe_aux_loss_coeff": 0.0,
                                                               "moe_z_loss_coeff": None})  # fmt: skip
    model = tiny_gpt(config, vocab_size=VOCAB, seed=0)
    model.train()
    from megatron.core.transformer.moe.router import Router

    inputs: dict[int, torch.Tensor] = {}

    def keep(router: torch.nn.Module, args: Any, _out: Any) -> None:
        inputs[router.layer_number - 1] = args[0]

    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(keep)
    routers = {m.layer_number - 1: m for m in model.modules() if isinstance(m, Router)}
    weights = {k: r.weight for k, r in routers.items()}
    batch = rollout_batch()
    micro = [process_microbatch(batch.slice(i, i + 1), routing=True) for i in range(ROWS)]
    valid = [
        torch.ones(S, dtype=torch.bool) if mb.padding_mask is None else ~mb.padding_mask[0]
        for mb in micro
    ]  # megatron's routing padding mask, where the step builds one (True = padding)
    total = float(sum(v.sum() for v in valid))  # N: routed tokens of the global batch
    term = torch.zeros(())
    counts = torch.zeros(len(routers), E)
    aux_sum = torch.zeros(len(routers))
    z_sum = torch.zeros(len(routers))
    dropped = 0.0
    for mb, real in zip(micro, valid, strict=True):
        model(mb.input_ids, mb.position_ids, mb.attention_mask, padding_mask=~real[None])
        n = float(real.sum())
        for layer, hidden in inputs.items():
            every = hidden.reshape(-1, hidden.shape[-1]) @ weights[layer].T  # [S, E]
            logits = every[real]  # [n, E]
            probs = torch.softmax(logits, dim=-1)
            top = probs.topk(TOPK, dim=-1).indices
            chosen = torch.zeros_like(probs).scatter(1, top, 1.0)  # [n, E]
            f = chosen.sum(0) / (TOPK * n)
            aux = E * (f * probs.mean(0)).sum()
            z = torch.logsumexp(logits, dim=-1).square().mean()
            term = term + n / total * (spec.aux * aux + (spec.z or 0.0) * z)
            aux_sum[layer] += n / total * float(aux)
            z_sum[layer] += n / total * float(z)
            kept = chosen
            if spec.capacity is not None:
                kept = _capacity_kept(every.detach(), spec.capacity)[real]
                dropped += float(TOPK * n - kept.sum())
            counts[layer] += kept.sum(0)
        inputs.clear()
    term.backward()
    grads = dict(off["grads"])
    for name, param in model.named_parameters():
        if param.grad is not None:
            key = canonical_name(model, name)
            grads[key] = grads[key] + param.grad
    metrics = {
        "moe/tokens_per_expert_max": float(counts.max()),
        "moe/tokens_per_expert_mean": float(counts.mean()),
        "moe/dropped_tokens": dropped,
    }
    if spec.aux:
        metrics["moe/load_balancing_loss"] = float(aux_sum.mean())
    if spec.z is not None:
        metrics["moe/z_loss"] = float(z_sum.mean())
    return {"grads": grads, "metrics": metrics, "off": off}


def _capacity_kept(logits: torch.Tensor, factor: float) -> torch.Tensor:
    """``[S, E]`` kept assignments under megatron's "probs" drop policy: each expert keeps the
    ``ceil(S * k / E * factor)`` positions (padding ones included: they are routed too) with the
    largest top-k weights (softmax over each token's top-k logits)."""
    values, top = logits.topk(TOPK, dim=-1)
    weights = torch.zeros_like(logits).scatter(1, top, torch.softmax(values, dim=-1))
    capacity = math.ceil(logits.shape[0] * TOPK / E * factor)
    keep = torch.zeros_like(logits).scatter(0, weights.topk(capacity, dim=0).indices, 1.0)
    return (weights > 0) & (keep > 0)


class MoEGRPOModule(GRPOModule):
    """:class:`~_strategy_rl_runs.GRPOModule` (ClippedPG) on the tiny MoE GPT of ``spec``."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        sp = self.mcore_strategy.parallel.sequence_parallel
        config = tiny_gpt_config(self.parallel_groups, **self.spec.moe_fields(sp))
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )


class StepRecorder(Callback):
    """Per step: the logged metrics (floats) and megatron's grad norm."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.grad_norms.append(float(trainer.strategy.optimizers[0].last_step.grad_norm))


def moe_trainer(spec: MoESpec, steps: int, **kwargs: Any) -> tuple[Trainer, StepRecorder]:
    world_size = int(os.environ["WORLD_SIZE"])
    recorder = StepRecorder()
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=spec.tp,
        sequence_parallel=spec.tp > 1 if spec.sequence_parallel is None else spec.sequence_parallel,
        expert_model_parallel_size=spec.ep, expert_tensor_parallel_size=1,
        microbatching=MicrobatchConfig(micro_batch_size=1),
    )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=world_size, max_steps=steps, strategy=strategy,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[recorder, *kwargs.pop("callbacks", [])],
        enable_checkpointing=kwargs.pop("enable_checkpointing", False), **kwargs,
    )  # fmt: skip
    return trainer, recorder


def moe_loader(spec: MoESpec) -> DataLoader:
    """ROWS samples per step, split over the DP ranks in a fixed order."""
    world_size = int(os.environ["WORLD_SIZE"])
    return DataLoader(RolloutRows(4 * ROWS), batch_size=ROWS * spec.tp // world_size)


def fit_moe_rank(_rank: int, spec: MoESpec, steps: int) -> dict[str, Any]:
    """``steps`` ClippedPG steps of the tiny MoE GPT under a Trainer: per-step metrics and grad
    norms."""
    trainer, recorder = moe_trainer(spec, steps)
    trainer.fit(MoEGRPOModule(spec), moe_loader(spec))
    return {"metrics": recorder.metrics, "grad_norms": recorder.grad_norms}


def fit_error_rank(_rank: int, spec: MoESpec) -> str:
    """``"Type: message"`` of the error ``Trainer.fit`` raises for ``spec`` (``""``: none)."""
    trainer, _ = moe_trainer(spec, 1)
    try:
        trainer.fit(MoEGRPOModule(spec), moe_loader(spec))
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return ""
