"""The EAGLE draft a module trains next to its policy (`MCoreRLModule.build_draft_model`): built,
wrapped, stepped and checkpointed by the strategy, trained inside the policy's step
(`lightning_mcore_rl.extensions.eagle_draft`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from lightning_mcore_rl.parallel import ParallelGroups


@dataclass
class DraftState:
    """The strategy's draft; `None` fields on ranks without one (other stages, or no draft).

    Attributes:
        train_draft: a draft is trained in this run (the same on every rank).
        model: the megatron-DDP-wrapped draft (last pipeline stage), else `None`.
        optimizer: its torch Adam, else `None`.
        clip_grad: the global-norm clip of its gradients (0: none).
        last_grad_norm: the pre-clip gradient norm of its latest step (`None` before one).
    """

    train_draft: bool = False
    model: Any = None
    optimizer: torch.optim.Optimizer | None = None
    clip_grad: float = 0.0
    last_grad_norm: float | None = None


def build_draft(
    module: Any,
    groups: ParallelGroups,
    ddp_config: Any,
    optimizer_config: Any,
    clip_grad: float,
    *,
    bf16: bool,
) -> DraftState:
    """Ask `module.build_draft_model()` and wrap the draft for training.

    Returns `DraftState(train_draft=False)` when the hook returns `None`.

    Raises:
        TypeError: the hook returned something that is not a megatron module.
        ValueError: a draft under bf16 precision or context parallelism (CP > 1).
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import MegatronModule

    from lightning_mcore_rl.models.draft_model import check_draft_context_parallel

    # asked on every rank; the draft is kept on the last pipeline stage only
    draft = module.build_draft_model()
    if draft is None:
        return DraftState()
    if not isinstance(draft, MegatronModule):
        raise TypeError(
            f"{type(module).__name__}.build_draft_model() must return a megatron module (e.g. "
            f"lightning_mcore_rl.models.draft_model.eagle_draft(...)) or None, got {type(draft).__name__}"
        )
    # the models' builders refuse CP themselves before building anything; this covers the rest
    check_draft_context_parallel(groups.cp_size)  # a draft of the module's own builder
    if bf16:
        raise ValueError(
            "draft-model training runs in fp32 only (its torch Adam has no fp32 master weights); "
            "use Trainer(precision='32-true') or return None from build_draft_model()"
        )
    if not groups.is_pipeline_last_stage:
        return DraftState(train_draft=True, clip_grad=clip_grad)
    wrapped = DistributedDataParallel(draft.config, ddp_config, draft)
    # The draft has its own DDP wrapper and its own Adam (the policy's `OptimizerConfig` lr,
    # betas, eps and weight decay; its own grad norm and clipping at `gradient_clip_val`): the
    # policy's optimizer, clipping and grad norm never see it.
    adam = torch.optim.Adam(
        wrapped.parameters(),
        lr=float(optimizer_config.lr),
        betas=(float(optimizer_config.adam_beta1), float(optimizer_config.adam_beta2)),
        eps=float(optimizer_config.adam_eps),
        weight_decay=float(optimizer_config.weight_decay),
    )
    return DraftState(train_draft=True, model=wrapped, optimizer=adam, clip_grad=clip_grad)


def draft_grad_norm(model: torch.nn.Module, groups: ParallelGroups) -> float:
    """The L2 norm of the draft's full gradient (collective over TP)."""
    # TP shards' squares are summed over TP; replicated parameters count once (their gradients
    # are the same on every TP rank)
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        square = cast(Any, param).main_grad.double().pow(2).sum()  # DDP's fp32 buffer view
        if getattr(param, "tensor_model_parallel", False):
            sharded += square
        else:
            replicated += square
    if groups.tp_size > 1:
        dist.all_reduce(sharded, group=groups.tp_group)
    return math.sqrt(float(sharded + replicated))


def step_draft(state: DraftState, groups: ParallelGroups) -> None:
    """The draft's grad norm, clipping and Adam step (ranks without a draft do nothing)."""
    # runs after the policy's optimizer step; gradients come from the DDP buffer (`main_grad`)
    if state.model is None or state.optimizer is None:
        return
    norm = draft_grad_norm(state.model, groups)
    state.last_grad_norm = norm
    scale = 1.0
    if state.clip_grad > 0 and norm > state.clip_grad:
        scale = state.clip_grad / (norm + 1e-6)  # megatron's clip_grad_by_total_norm_fp32
    for param in state.model.parameters():
        grad = cast(Any, param).main_grad  # DDP's fp32 buffer view
        param.grad = grad * scale if scale != 1.0 else grad
    state.optimizer.step()
    for param in state.model.parameters():
        param.grad = None  # the DDP buffer is zeroed by the next step's pass


DRAFT_PREFIX = "draft."
"""Head of the draft's entries in the checkpoint's model state (weights ``draft.<name>``, its Adam
moments ``draft.adam.<exp_avg|exp_avg_sq>.<name>``, its step count ``draft.adam.step``); the
ShardedTensor keys are the same, so they never collide with the policy's or a teacher's."""

_ADAM = f"{DRAFT_PREFIX}adam."
_MOMENTS = ("exp_avg", "exp_avg_sq")


def draft_checkpoint_state(state: DraftState) -> dict[str, Any]:
    """The draft's sharded checkpoint entries `{key: ShardedTensor}` (empty without a draft)."""
    # weights: megatron's `sharded_state_dict` (TP shards and replicas as megatron declares them);
    # the Adam state reuses the same sharding, zeros before the first step, which is also the
    # template a resume loads into
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    if state.model is None or state.optimizer is None:
        return {}
    inner = state.model.module
    weights = dict(inner.sharded_state_dict(prefix=DRAFT_PREFIX))
    entries: dict[str, Any] = dict(weights)
    step = torch.zeros(1, dtype=torch.float32)
    for name, param in inner.named_parameters():
        saved = state.optimizer.state.get(param, {})
        weight = weights[f"{DRAFT_PREFIX}{name}"]
        for moment in _MOMENTS:
            value = saved.get(moment, torch.zeros_like(param))
            key = f"{_ADAM}{moment}.{name}"
            entries[key] = dataclasses.replace(weight, key=key, data=value)
        if "step" in saved:
            step = torch.as_tensor(saved["step"], dtype=torch.float32).reshape(1).clone()
    entries[f"{_ADAM}step"] = make_sharded_tensor_for_checkpoint(step, f"{_ADAM}step")
    return entries


def load_draft_checkpoint_state(state: DraftState, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Load a checkpoint's draft entries (plain tensors) into the draft and its Adam; returns
    the entries that are not the draft's."""
    rest = {k: v for k, v in state_dict.items() if not k.startswith(DRAFT_PREFIX)}
    if state.model is None or state.optimizer is None or len(rest) == len(state_dict):
        return rest
    inner = state.model.module
    weights = {
        k[len(DRAFT_PREFIX) :]: v
        for k, v in state_dict.items()
        if k.startswith(DRAFT_PREFIX) and not k.startswith(_ADAM)
    }
    inner.load_state_dict(weights)
    step = torch.as_tensor(state_dict[f"{_ADAM}step"]).reshape(())
    for name, param in inner.named_parameters():
        state.optimizer.state[param] = {
            "step": step.clone(),
            **{m: state_dict[f"{_ADAM}{m}.{name}"].clone() for m in _MOMENTS},
        }
    return rest


__all__ = [
    "DRAFT_PREFIX",
    "DraftState",
    "build_draft",
    "draft_checkpoint_state",
    "draft_grad_norm",
    "load_draft_checkpoint_state",
    "step_draft",
]
