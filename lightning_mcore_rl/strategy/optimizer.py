"""A `torch.optim.Optimizer` facade over a megatron optimizer (`MegatronOptimizerAdapter`), and
the spec a module returns from `configure_optimizers`."""

# Lightning wraps optimizers in `LightningOptimizer` and torch's LR schedulers check
# `isinstance(optimizer, Optimizer)`; `MegatronOptimizer` is not a torch optimizer and takes no
# closure (its `step()` returns `(update_successful, grad_norm, num_zeros_in_grad)`).

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass(frozen=True)
class MegatronStepResult:
    """What `MegatronOptimizer.step()` returned for the last optimizer step."""

    update_successful: bool  # False: an overflow, or the non-finite guard, skipped the update
    grad_norm: float | None  # pre-clip global norm (reduced over all model-parallel ranks)
    num_zeros_in_grad: int | None  # with `OptimizerConfig.log_num_zeros_in_grad`


@dataclass
class _StepRecord:
    """Mutable holder shared (by reference) between the adapter and its `LightningOptimizer`."""

    # the wrapper copies the adapter's `__dict__`, so it cannot see later attribute writes

    last: MegatronStepResult | None = None
    guard: Any = None  # the strategy's NonFiniteGuard (reliability/nonfinite.py)
    params: list[torch.Tensor] = field(default_factory=list)  # the model's, for the guard
    device: torch.device | str = "cpu"  # where the guard's update checks reduce
    group: Any = None  # and over which group (None: the default group)


@dataclass
class MegatronOptimizerSpec:
    """What `configure_optimizers` returns to get a megatron optimizer (+ an LR scheduler)."""

    # megatron `OptimizerConfig`: `clip_grad` comes from `Trainer(gradient_clip_val=...)`,
    # `bf16`/`params_dtype` from `Trainer(precision=...)`, `use_distributed_optimizer` from the
    # strategy
    config: Any
    # `factory(optimizer) -> LRScheduler` or a Lightning scheduler dict, called with the optimizer
    lr_scheduler: SchedulerFactory | None = field(default=None)


class MegatronOptimizerAdapter(torch.optim.Optimizer):
    """`torch.optim.Optimizer` view of a `MegatronOptimizer`: `param_groups` and `state` are
    megatron's, `step(closure)` runs the closure then megatron's step, `zero_grad` is a no-op.

    Args:
        megatron_optimizer: the optimizer from `get_megatron_optimizer`.
        params: the model parameters it updates (for the non-finite guard's update checks)."""

    # `Optimizer.__init__` is not called: delegating `param_groups` makes LR schedulers and
    # `LearningRateMonitor` act on megatron's groups. The strategy zeroes the grad buffers before
    # the forward (`on_train_batch_start`). No state is kept on `self` after construction:
    # `LightningOptimizer` runs these methods on a copy of `__dict__`.

    def __init__(  # noqa: D107 - no super().__init__
        self, megatron_optimizer: Any, params: Sequence[torch.Tensor] = ()
    ) -> None:
        self.megatron_optimizer = megatron_optimizer
        self._record = _StepRecord(params=list(params))
        self.defaults: dict[str, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Megatron's parameter groups (with and without weight decay, per chain member)."""
        return self.megatron_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.megatron_optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """Megatron's per-parameter optimizer state."""
        return self.megatron_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.megatron_optimizer.state = value

    @property
    def last_step(self) -> MegatronStepResult | None:
        """The result of the latest `step` (`None` before the first)."""
        return self._record.last

    def use_guard(self, guard: Any, device: torch.device | str = "cpu", group: Any = None) -> None:
        """Consult `guard` (a `NonFiniteGuard`) around every megatron step; its update checks
        reduce on `device` over `group` (the strategy's world group)."""
        self._record.guard = guard
        self._record.device = device
        self._record.group = group

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run `closure` (forward+backward), then megatron's step (`megatron_step`) unless the
        non-finite guard skips it; returns the closure's result, as `torch.optim` optimizers do."""
        # a skipped step changes nothing, as megatron's own `update_successful=False` path; an
        # update the guard rejects after it ran is undone
        loss = closure() if closure is not None else None
        record = self._record
        if record.guard is None:
            record.last = megatron_step(self.megatron_optimizer)
            return loss
        run = functools.partial(megatron_step, self.megatron_optimizer, params=record.params)
        result = record.guard.check_update(run, device=record.device, group=record.group)
        record.last = result if result is not None else MegatronStepResult(False, None, None)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: Lightning calls this after the backward; the strategy zeroes before it."""

    def state_dict(self) -> dict[str, Any]:
        """Megatron's (non-sharded) optimizer state dict."""
        return self.megatron_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict produced by ``dist_checkpointing.load`` of a sharded one."""
        self.megatron_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"MegatronOptimizerAdapter({type(self.megatron_optimizer).__name__})"


def megatron_step(
    optimizer: Any, checks: Any = None, params: Sequence[torch.Tensor] = ()
) -> MegatronStepResult:
    """Megatron's `MegatronOptimizer.step()` by its public parts, consulting the non-finite
    guard's `checks` (`UpdateChecks`, `None`: none) between the gradient norm and the update;
    `update_successful=False` when megatron found inf/NaN or a check skipped or rejected it."""
    # The same operations in the same order as megatron's `step()` of `FP32Optimizer`,
    # `MixedPrecisionOptimizer` and `ChainedOptimizer`, so the update is bitwise megatron's. The
    # norm is computed once, reduced over megatron's grad-stats group (model-parallel, or the
    # world with the distributed optimizer; DP replicas hold all-reduced gradients), so every rank
    # takes the same decision without a collective of its own; unlike megatron's, also without
    # clipping. A previewable update is checked before it runs (not run when rejected), any other
    # around it (snapshot before, undone after).
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():
        return MegatronStepResult(False, None, None)
    grad_norm = float(optimizer.get_grad_norm())
    if checks is not None and checks.grad_norm_fails(grad_norm):
        return MegatronStepResult(False, grad_norm, None)
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(member, "is_stub_optimizer", False) or member.config.clip_grad <= 0.0:
            continue
        member_params = member.get_parameters()
        if member_params:
            clip_grad_by_total_norm_fp32(
                member_params,
                max_norm=member.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=member.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    config = optimizer.config
    num_zeros = int(optimizer.count_zeros()) if config.log_num_zeros_in_grad else None
    if checks is not None and checks.reject_before_update(optimizer):
        return MegatronStepResult(False, grad_norm, num_zeros)
    snapshot = checks.snapshot(optimizer, params) if checks is not None else None
    updated = bool(optimizer.step_with_ready_grads())
    if updated and checks is not None and checks.reject_update(snapshot):
        return MegatronStepResult(False, grad_norm, num_zeros)
    return MegatronStepResult(updated, grad_norm, num_zeros)


def resolve_optimizer_config(
    config: Any, *, clip_grad: float, bf16: bool, use_distributed_optimizer: bool
) -> Any:
    """`config` with the fields the Trainer and the strategy own filled in.

    Raises:
        ValueError: an owned field set to a conflicting value (`clip_grad` other than 1.0,
            `bf16`/`fp16`, `use_distributed_optimizer`), naming where to set it; a bad lr or
            weight decay (`check_optimizer_values`)."""
    from megatron.core.optimizer import OptimizerConfig

    if not isinstance(config, OptimizerConfig):
        raise TypeError(
            "`configure_optimizers` must return a megatron `OptimizerConfig` or a "
            f"`MegatronOptimizerSpec`, got {type(config).__name__}."
        )
    default_clip = OptimizerConfig.__dataclass_fields__["clip_grad"].default
    if config.clip_grad not in (default_clip, clip_grad):
        raise ValueError(
            f"`OptimizerConfig.clip_grad={config.clip_grad}` conflicts with "
            f"`Trainer(gradient_clip_val=...)` (-> clip_grad={clip_grad}); set the clip value "
            "on the Trainer only."
        )
    if config.fp16:
        raise ValueError(
            "`OptimizerConfig.fp16=True` is not supported; use precision='bf16-mixed'."
        )
    if config.bf16 and not bf16:
        raise ValueError(
            "`OptimizerConfig.bf16=True` conflicts with `Trainer(precision='32-true')`; "
            "set `Trainer(precision='bf16-mixed')` instead."
        )
    if config.use_distributed_optimizer and not use_distributed_optimizer:
        raise ValueError(
            "`OptimizerConfig.use_distributed_optimizer=True` conflicts with the strategy; set "
            "`MCoreRLStrategy(ddp=MegatronDDPConfig(use_distributed_optimizer=True))` instead."
        )
    check_optimizer_values(config)
    return dataclasses.replace(
        config,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    )


_OPTIMIZER_VALUES = ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay")
"""``OptimizerConfig`` fields that must be finite and >= 0 (``None``: megatron's "unset")."""


def check_optimizer_values(config: Any) -> None:
    """The learning rates and the weight decay of a megatron `OptimizerConfig`: each a finite
    number >= 0 (or `None`, except `lr`).

    Raises:
        ValueError: ``lr`` is ``None``; a field is negative, NaN or infinite.
        TypeError: a field is not a number."""
    # before megatron builds the optimizer: torch would reject a negative lr inside it, naming
    # none of these fields
    if config.lr is None:
        raise ValueError(
            "`OptimizerConfig.lr` is None: megatron needs a learning rate; return "
            "`OptimizerConfig(lr=...)` from `configure_optimizers`."
        )
    for name in _OPTIMIZER_VALUES:
        value = getattr(config, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"`OptimizerConfig.{name}` must be a number, got {type(value).__name__} "
                f"({value!r})."
            )
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"`OptimizerConfig.{name}={value}` must be a finite number >= 0; set it in the "
                "`OptimizerConfig` that `configure_optimizers` returns (the recipes: their "
                "`lr` argument)."
            )


def check_fit_limits(max_steps: int, max_epochs: int | None) -> None:
    """`Trainer.fit` limits that would train nothing, checked when `fit` launches.

    Raises:
        ValueError: ``max_steps=0`` or ``max_epochs=0``."""
    # before any process group exists; one Lightning batch is one optimizer step
    if max_steps == 0:
        raise ValueError(
            "`Trainer(max_steps=0)` trains no step (fit would set up and stop silently). Set "
            "`max_steps` to the number of optimizer steps to run (one Lightning batch is one "
            "optimizer step), or -1 to stop at `max_epochs`."
        )
    if max_epochs == 0:
        raise ValueError(
            "`Trainer(max_epochs=0)` trains no step (fit would set up and stop silently). Set "
            "`max_epochs` >= 1, or -1 to stop at `max_steps`."
        )


def check_trainer_flags(
    accumulate_grad_batches: int,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
) -> float:
    """Validate the Trainer flags megatron implements itself; return `OptimizerConfig.clip_grad`
    (`0.0`, no clipping, when `gradient_clip_val` is None: NOT megatron's default 1.0)."""
    if accumulate_grad_batches != 1:
        raise ValueError(
            f"`Trainer(accumulate_grad_batches={accumulate_grad_batches})` is not supported by "
            "MCoreRLStrategy: one Lightning batch is one optimizer step. Put the samples of the "
            "whole global batch into each batch (DataLoader batch_size = global batch / DP); the "
            "strategy splits it into microbatches of `micro_batch_size`."
        )
    # The Trainer stores a GradClipAlgorithmType (a str enum): compare and report its value.
    gradient_clip_algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
    if gradient_clip_algorithm not in (None, "norm"):
        raise ValueError(
            f"`Trainer(gradient_clip_algorithm={gradient_clip_algorithm!r})` is not supported: "
            "megatron clips by the global gradient norm; use gradient_clip_algorithm='norm'."
        )
    if gradient_clip_val is None:
        return 0.0
    if isinstance(gradient_clip_val, bool) or not isinstance(gradient_clip_val, (int, float)):
        raise TypeError(
            "`Trainer(gradient_clip_val=...)` must be a number or None, got "
            f"{type(gradient_clip_val).__name__}."
        )
    if not math.isfinite(gradient_clip_val) or gradient_clip_val < 0:
        raise ValueError(
            f"`Trainer(gradient_clip_val={gradient_clip_val})` must be a finite number >= 0 "
            "(0 or None: no clipping)."
        )
    return float(gradient_clip_val)


def build_optimizer(
    spec: object,
    chunks: Sequence[torch.nn.Module],
    *,
    clip_grad: float,
    bf16: bool,
    use_distributed_optimizer: bool,
) -> tuple[MegatronOptimizerAdapter, list[LRSchedulerConfig]]:
    """`configure_optimizers()`'s result (an `OptimizerConfig` or a `MegatronOptimizerSpec`) ->
    the megatron optimizer over the DDP `chunks` behind the facade, and the scheduler configs."""
    from megatron.core.optimizer import get_megatron_optimizer

    if not isinstance(spec, MegatronOptimizerSpec):
        spec = MegatronOptimizerSpec(config=spec)
    config = resolve_optimizer_config(
        spec.config,
        clip_grad=clip_grad,
        bf16=bf16,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    params = [p for chunk in chunks for p in chunk.parameters()]
    adapter = MegatronOptimizerAdapter(get_megatron_optimizer(config, list(chunks)), params)
    if spec.lr_scheduler is None:
        return adapter, []
    return adapter, [_scheduler_config(spec.lr_scheduler(adapter))]


def _scheduler_config(scheduler: Any) -> LRSchedulerConfig:
    """A scheduler or a Lightning scheduler dict -> ``LRSchedulerConfig``."""
    if isinstance(scheduler, Mapping):
        if "scheduler" not in scheduler:
            raise ValueError("A scheduler dict from the factory needs a 'scheduler' key.")
        return LRSchedulerConfig(**scheduler)
    return LRSchedulerConfig(scheduler=scheduler)
