"""What the module declares -> one trainer-free call of `train/step.py` (`StepRunner`)."""

# `StepRunner` asks the module's hooks before the pass (`loss_post_processor(None)`, or the LM
# path's `forward_step`) and runs `run_global_batch` / `run_forward_only` with the strategy's
# frozen `StepContext` and the non-finite policy's input agreement as the batch check; nothing
# in the pass calls back into the module.

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from lightning_mcore_rl.reliability.agreement import StepBoundary
    from lightning_mcore_rl.reliability.nonfinite import NonFiniteGuard
    from lightning_mcore_rl.train import LossPostProcessor, StepContext, StepOutput
    from lightning_mcore_rl.train.post_processors import PostProcessingFunction


class StepDeclaration(Protocol):
    """What a module declares for a step (`MCoreRLModule` satisfies it)."""

    # `None`: the LM path (`forward_step`)
    loss_fn: Any

    # called as `loss_post_processor(None)`, positionally: the pass binds its `M`
    def loss_post_processor(self, num_microbatches: int | None, /) -> LossPostProcessor: ...

    def forward_step(self, data_iterator: Any, model: torch.nn.Module) -> Any: ...


# built per call by the strategy: cheap and stateless
@dataclass(frozen=True)
class StepRunner:
    """One pass over `chunks` with the strategy's context.

    Attributes:
        chunks: the wrapped model chunks the pass runs (the policy's or the hosted teacher's).
        context: the strategy's frozen `StepContext`.
        guard: the non-finite policy (one input-agreement collective per pass).
        boundary: the strategy's step boundary, carried by the first pass of each training step.
    """

    chunks: Sequence[torch.nn.Module]
    context: StepContext
    guard: NonFiniteGuard
    # SIGTERM and the previous step's time
    boundary: StepBoundary | None = None

    def forward_backward(
        self, module: StepDeclaration, batch: Mapping[str, Any], *, forward_only: bool
    ) -> StepOutput:
        """One global batch: the `loss_fn` path through the module's post-processor, or the LM
        path through its `forward_step`."""
        from lightning_mcore_rl.train import run_global_batch
        from lightning_mcore_rl.train.validation import loss_input_keys

        kwargs: dict[str, Any] = {}
        # the post-processor is asked here, before the pass
        if module.loss_fn is not None:
            kwargs.update(
                loss=module.loss_post_processor(None),
                normalizations=module.loss_fn.metric_normalizations,
                required_keys=loss_input_keys(module.loss_fn),
                required_by=type(module.loss_fn).__name__,
            )
        else:
            kwargs["forward_step_func"] = module.forward_step
        out = run_global_batch(
            list(self.chunks), batch, self.context, forward_only=forward_only,
            input_check=functools.partial(self._check_inputs, training=not forward_only),
            **kwargs,
        )  # fmt: skip
        # the training loss is noted for the non-finite policy
        if not forward_only:
            self.guard.check_loss(out.loss)
        return out

    def forward_only(
        self, batch: Mapping[str, Any], post_processor: PostProcessingFunction
    ) -> dict[str, torch.Tensor]:
        """A forward-only post-processor pass: per-sample outputs in the batch's order, on every
        rank."""
        from lightning_mcore_rl.train import run_forward_only

        return run_forward_only(
            list(self.chunks), batch, self.context, post_processor,
            input_check=functools.partial(self._check_inputs, training=False),
        )  # fmt: skip

    def _check_inputs(
        self, finding: Any, error: BaseException | None, summary: Any, training: bool
    ) -> bool:
        # one collective: verdicts, row counts and batch fingerprints of every rank, with the
        # training step's StepBoundary (SIGTERM, the previous step's time) riding along
        return self.guard.check_batch(
            finding, error, summary, training=training, replica=self.context.groups.dp_rank,
            boundary=self.boundary, device=self.context.device, group=self.context.world_group,
        )  # fmt: skip


__all__ = ["StepDeclaration", "StepRunner"]
