"""The module's hooks -> one trainer-free call of :mod:`lightning_mcore_rl.train.step`.

:class:`StepRunner` is what :meth:`MCoreRLStrategy.forward_backward` and
:meth:`~MCoreRLStrategy.forward_only` delegate to: it reads the module's post-processing hooks
once per pass (``loss_post_processor``, ``sampling_params``, or ``forward_step`` on the LM path)
and runs :func:`~lightning_mcore_rl.train.run_global_batch` /
:func:`~lightning_mcore_rl.train.run_forward_only` on the strategy's chunks, groups and
micro-batching, with the non-finite policy's input agreement as the batch check.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_mcore_rl.module import MCoreRLModule
    from lightning_mcore_rl.strategy.nonfinite import NonFiniteGuard
    from lightning_mcore_rl.train import Microbatching, ParallelGroups, StepOutput
    from lightning_mcore_rl.train.post_processors import PostProcessingFunction


@dataclass(frozen=True)
class StepRunner:
    """One pass over ``chunks`` with the strategy's layout (built per call: cheap, stateless).

    Attributes:
        chunks: the wrapped model chunks the pass runs (the policy's or the hosted teacher's).
        groups: the strategy's :class:`~lightning_mcore_rl.train.ParallelGroups`.
        microbatching: the strategy's :class:`~lightning_mcore_rl.train.Microbatching`.
        guard: the non-finite policy (one input-agreement all-reduce per pass).
        device: where the step's collectives run.
        use_fused_linear_logprobs: logprobs from hidden x output weight on the last stage.
    """

    chunks: Sequence[torch.nn.Module]
    groups: ParallelGroups
    microbatching: Microbatching
    guard: NonFiniteGuard
    device: torch.device
    use_fused_linear_logprobs: bool

    def forward_backward(
        self, module: MCoreRLModule, batch: Mapping[str, Any], *, forward_only: bool
    ) -> StepOutput:
        """One global batch: the ``loss_fn`` path through the module's ``loss_post_processor``
        hook, or the LM path through its ``forward_step``; the training loss is noted for the
        non-finite policy."""
        from lightning_mcore_rl.train import run_global_batch
        from lightning_mcore_rl.train.validation import loss_input_keys

        kwargs: dict[str, Any] = {}
        if module.loss_fn is not None:
            kwargs.update(
                post_processor_factory=module.loss_post_processor,
                normalizations=module.loss_fn.metric_normalizations,
                sampling_params=module.sampling_params(),
                required_keys=loss_input_keys(module.loss_fn),
            )
        else:
            kwargs["forward_step_func"] = module.forward_step
        out = run_global_batch(
            list(self.chunks), batch, self.groups, self.microbatching,
            forward_only=forward_only, device=self.device,
            input_check=functools.partial(self._check_inputs, training=not forward_only),
            use_fused_linear_logprobs=self.use_fused_linear_logprobs, **kwargs,
        )  # fmt: skip
        if not forward_only:
            self.guard.note_loss(out.loss)
        return out

    def forward_only(
        self,
        module: MCoreRLModule,
        batch: Mapping[str, Any],
        post_processor: PostProcessingFunction,
    ) -> dict[str, torch.Tensor]:
        """A forward-only post-processor pass: per-sample outputs in the batch's order, on every
        rank."""
        from lightning_mcore_rl.train import run_forward_only

        return run_forward_only(
            list(self.chunks), batch, self.groups, self.microbatching, post_processor,
            sampling_params=module.sampling_params(),
            use_fused_linear_logprobs=self.use_fused_linear_logprobs,
            input_check=functools.partial(self._check_inputs, training=False),
        )  # fmt: skip

    def _check_inputs(self, finding: Any, error: BaseException | None, training: bool) -> bool:
        self.guard.device = self.device
        return self.guard.check_inputs(finding, error, training=training)


__all__ = ["StepRunner"]
