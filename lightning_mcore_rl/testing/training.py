"""A minimal megatron-core training loop for tests: tiny GPT chunks wrapped in megatron's DDP, the
megatron optimizer, the real forward-backward schedule, and `dist_checkpointing` save/load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lightning_mcore_rl._compat import init_distributed_optimizer_state_for_load
from lightning_mcore_rl.models.tiny_gpt import canonical_name, tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.parallel import unwrap_model as _unwrap

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

Microbatch = dict[str, torch.Tensor]


@dataclass
class TrainingSetup:
    """Model chunks (one per virtual pipeline stage), their optimizer and config."""

    chunks: list[DistributedDataParallel]
    optimizer: Any
    config: Any


def build_training(
    *,
    seed: int = 0,
    bf16: bool = False,
    use_distributed_optimizer: bool = False,
    clip_grad: float = 1.0,
    lr: float = 1e-3,
    vocab_size: int = 128,
    max_sequence_length: int = 64,
    **config_kwargs: Any,
) -> TrainingSetup:
    """Tiny GPT (all VPP chunks of this rank) + megatron DDP + megatron Adam optimizer.

    Args:
        seed: weight seed (layout-invariant, see `tiny_gpt`).
        bf16: bf16 params in `Float16Module` with fp32 main params in the optimizer.
        clip_grad: global gradient-norm clip (megatron `clip_grad`); 0 disables.
        **config_kwargs: forwarded to `tiny_gpt_config`.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from lightning_mcore_rl.parallel import megatron_groups

    groups = megatron_groups()
    config = tiny_gpt_config(groups, bf16=bf16, **config_kwargs)
    stages = list(range(groups.vpp_size)) if groups.vpp_size else [None]
    chunks: list[DistributedDataParallel] = []
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
    )
    for vp_stage in stages:
        chunk: torch.nn.Module = tiny_gpt(
            config, groups=groups, vocab_size=vocab_size, seed=seed, vp_stage=vp_stage,
            max_sequence_length=max_sequence_length,
        )  # fmt: skip
        if bf16:
            chunk = Float16Module(config, chunk)
        chunks.append(DistributedDataParallel(config, ddp_config, chunk))
    # what Megatron-LM's training.py wires and a bare megatron-core user must not forget: without it
    # there is NO data-parallel gradient all-reduce
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            # Adam's update g/(|g|+eps) turns reduction-order noise d in a near-zero gradient into
            # a weight change of up to lr*d/eps; eps=1e-4 keeps layout comparisons at ~1e-7.
            adam_eps=1e-4,
            weight_decay=0.0,
            clip_grad=clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        chunks,
    )
    return TrainingSetup(chunks=chunks, optimizer=optimizer, config=config)


def make_microbatches(
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    *,
    vocab_size: int = 128,
    seed: int = 0,
) -> list[Microbatch]:
    """Deterministic random LM microbatches `{"tokens": [b, S], "labels": [b, S]}`."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(
        0, vocab_size, (num_microbatches, micro_batch_size, seq_length + 1), generator=generator
    )
    return [{"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()} for t in tokens]


def _forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    per_token_loss = model(tokens, position_ids, None, labels=batch["labels"])  # [b, S]

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        # clone: the schedule divides the returned loss in place by num_microbatches.
        return loss, {"loss": loss.detach().clone()}

    return per_token_loss, loss_func


def forward_backward(
    setup: TrainingSetup, microbatches: Sequence[Microbatch], *, forward_only: bool = False
) -> list[float]:
    """Run megatron's forward-backward schedule over `microbatches`; per-microbatch losses on the
    last pipeline stage, `[]` elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        for chunk in setup.chunks:
            chunk.zero_grad_buffer()
        setup.optimizer.zero_grad()
    first = microbatches[0]["tokens"]
    iterators: Any = [iter(microbatches) for _ in setup.chunks]
    # gradients land in the DDP `main_grad` buffers already finalised: DP-reduced, embedding and SP
    # grads synced
    outputs = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=setup.chunks if len(setup.chunks) > 1 else setup.chunks[0],
        num_microbatches=len(microbatches),
        seq_length=first.shape[1],
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
    )
    return [float(out["loss"]) for out in outputs]


def optimizer_step(setup: TrainingSetup) -> float:
    """Megatron optimizer step (clipping included); returns the pre-clip global grad norm."""
    _, grad_norm, _ = setup.optimizer.step()
    return float(grad_norm)


def train_step(
    setup: TrainingSetup, microbatches: Sequence[Microbatch]
) -> tuple[list[float], float]:
    """`forward_backward` then `optimizer_step`: `(losses, grad norm)`."""
    losses = forward_backward(setup, microbatches)
    return losses, optimizer_step(setup)


def gather_full_tensors(setup: TrainingSetup, *, grads: bool) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters (or their `main_grad`) as full fp32 CPU tensors keyed by
    canonical (single-rank) name."""
    import torch.distributed as dist

    from lightning_mcore_rl.models.tiny_gpt import is_expert_parameter
    from lightning_mcore_rl.parallel import megatron_groups

    groups = megatron_groups()
    result: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for chunk in setup.chunks:
        gpt = _unwrap(chunk)
        for name, param in gpt.named_parameters():
            # main_grad: megatron DDP's gradient buffer view, set on the parameter
            value = (cast(Any, param).main_grad if grads else param).detach().float().clone()
            expert = is_expert_parameter(name)
            group, size = (
                (groups.etp_group, groups.etp_size) if expert else (groups.tp_group, groups.tp_size)
            )
            # expert weights are gathered over the expert TP group, the rest over TP
            if getattr(param, "tensor_model_parallel", False) and size > 1:
                parts = [torch.empty_like(value) for _ in range(size)]
                dist.all_gather(parts, value, group=group)
                value = torch.cat(parts, dim=cast(Any, param).partition_dim)
            canonical = canonical_name(gpt, name, groups.ep_rank, groups.ep_size)
            (experts if expert else result)[canonical] = value
    # each EP rank holds its own experts: every rank gets all of them
    if groups.ep_size > 1:
        every_rank: list[Any] = [None] * groups.ep_size
        dist.all_gather_object(every_rank, experts, group=groups.ep_group)
        experts = {key: value for part in every_rank for key, value in part.items()}
    return {**result, **experts}


def model_sharded_state_dict(setup: TrainingSetup) -> dict[str, Any]:
    """`{"model": ...}` (or `model0`, `model1`, ... with VPP) as Megatron-LM names them."""
    # From inside the DDP wrapper (whose own state dict would prefix every key with "module.").
    if len(setup.chunks) == 1:
        return {"model": setup.chunks[0].module.sharded_state_dict()}
    return {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(setup.chunks)}


def _optimizer_metadata() -> dict[str, str]:
    # fully_sharded_model_space (the default) needs ShardedTensor.flattened_range, which
    # megatron-core 0.16 no longer supports without TE; Megatron-LM uses dp_reshardable too.
    return {"distrib_optim_sharding_type": "dp_reshardable"}


def save_checkpoint(setup: TrainingSetup, directory: str | Path) -> None:
    """Collective: save model and optimizer with megatron `dist_checkpointing` (sync)."""
    from megatron.core import dist_checkpointing

    model_sd = model_sharded_state_dict(setup)
    state = dict(model_sd)
    state["optimizer"] = setup.optimizer.sharded_state_dict(
        model_sd, metadata=_optimizer_metadata()
    )
    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(directory))


def load_checkpoint(setup: TrainingSetup, directory: str | Path, *, optimizer: bool = True) -> None:
    """Collective: load a checkpoint written by `save_checkpoint`, under any TP/PP layout."""
    from megatron.core import dist_checkpointing

    model_sd = model_sharded_state_dict(setup)
    state = dict(model_sd)
    if optimizer:
        if _is_distributed_optimizer(setup.optimizer):
            init_distributed_optimizer_state_for_load(setup.optimizer)
        state["optimizer"] = setup.optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=_optimizer_metadata()
        )
    loaded = dist_checkpointing.load(state, str(directory))
    for key, chunk in zip(model_sd, setup.chunks, strict=True):
        chunk.module.load_state_dict(loaded[key])
    if optimizer:
        setup.optimizer.load_state_dict(loaded["optimizer"])


def _is_distributed_optimizer(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    # a `ChainedOptimizer` (e.g. dense and expert parameters) holds several
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)
