"""The step's extension interface: optional capabilities plug into the core at its hook points."""

# The core (`train/step.py`, `train/forward.py`) runs plan -> per microbatch forward ->
# post-process -> loss -> backward -> statistics; a `StepExtension` adds to it at the points
# below (`extensions.noop.NoExtension` implements each as a no-op). An extension lives in its own
# module under `lightning_mcore_rl/extensions/` and is imported only when its feature is on.

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_mcore_rl.losses import MetricNormalizer
    from lightning_mcore_rl.parallel import ParallelGroups
    from lightning_mcore_rl.train.context import StepContext
    from lightning_mcore_rl.train.model_inputs import GlobalBatch, ProcessedMicrobatch
    from lightning_mcore_rl.train.post_processors import PostProcessingFunction
    from lightning_mcore_rl.train.statistics import StepOutput

LossFunc = Callable[[Tensor], tuple[Tensor, dict[str, Any]]]
"""A microbatch's bound post-processor: `fn(output) -> (loss, metrics)`."""


class StepExtension(Protocol):
    """A capability hooked into the step at the core's points."""

    def check_batch(self, batch: Mapping[str, Any], chunks: Sequence[torch.nn.Module]) -> None:
        """Validate the batch's keys this extension reads (host only, before any collective).

        Raises:
            ValueError, TypeError: a malformed batch.
        """
        ...

    def split_options(self, training: bool) -> dict[str, bool]:
        """Keyword flags for `split_global_batch` (which extra per-microbatch tensors to build)."""
        ...

    def normalizations(
        self, chunks: Sequence[torch.nn.Module], training: bool
    ) -> Mapping[str, MetricNormalizer]:
        """The normalisations of the metrics this extension adds to the step."""
        ...

    def statistics_scope(
        self,
        chunks: Sequence[torch.nn.Module],
        global_batch: GlobalBatch,
        post: PostProcessingFunction,
        context: StepContext,
        training: bool,
    ) -> contextlib.AbstractContextManager[Any]:
        """The block around a `run_global_batch` schedule; what it yields goes to `finish`."""
        ...

    def pass_scope(
        self, chunks: Sequence[torch.nn.Module], training: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """The block around every schedule run (training, validation and forward-only passes)."""
        ...

    def forward_scope(
        self,
        model: torch.nn.Module,
        microbatch: ProcessedMicrobatch,
        groups: ParallelGroups,
        training: bool,
    ) -> contextlib.AbstractContextManager[Any]:
        """The block around one microbatch's model forward; what it yields goes to
        `microbatch_data`."""
        ...

    def microbatch_data(
        self, model: torch.nn.Module, microbatch: ProcessedMicrobatch, state: Any
    ) -> Mapping[str, Tensor]:
        """Fields added to the microbatch the post-processor reads, after the forward."""
        ...

    def forward_kwargs(
        self, microbatch: ProcessedMicrobatch, global_valid_toks: Tensor | None
    ) -> dict[str, Any]:
        """Extra keyword arguments of `model_forward` for one microbatch."""
        ...

    def wrap_loss(
        self,
        fn: LossFunc,
        model: torch.nn.Module,
        microbatch: ProcessedMicrobatch,
        groups: ParallelGroups,
        trains: bool,
    ) -> LossFunc:
        """The microbatch's bound `fn(output) -> (loss, metrics)`, wrapped (e.g. extra metrics);
        `trains`: the post-processor is a training loss."""
        ...

    def finish(self, out: StepOutput, state: Any, context: StepContext) -> StepOutput:
        """The step's output after the statistics' reduction; `state`: what `statistics_scope`
        yielded."""
        ...


def step_extensions(
    chunks: Sequence[torch.nn.Module], context: StepContext | None = None
) -> tuple[StepExtension, ...]:
    """The extensions the chunks' config and the context's draft turn on (an extension module is
    imported only then)."""
    from megatron.core.utils import get_model_config

    found: list[StepExtension] = []
    if context is not None and context.train_draft:
        from lightning_mcore_rl.extensions.eagle_draft import DraftExtension

        found.append(DraftExtension(context.draft_model))
    if any(getattr(get_model_config(c), "num_moe_experts", None) for c in chunks):
        from lightning_mcore_rl.extensions.moe import MoEExtension

        found.append(MoEExtension())
    if any(getattr(get_model_config(c), "mtp_num_layers", None) for c in chunks):
        from lightning_mcore_rl.extensions.multi_token_prediction import MTPExtension

        found.append(MTPExtension())
    return tuple(found)


def resolve_extensions(
    context: StepContext, chunks: Sequence[torch.nn.Module]
) -> tuple[StepExtension, ...]:
    """The context's extensions; a context built without a list (`None`) gets the chunks'
    `step_extensions`."""
    if context.extensions is not None:
        return tuple(context.extensions)
    return step_extensions(chunks, context)


class _SeedFlagExtension:
    """An extension whose forward hooks see the seed API's per-feature flag as `training` (NeMo
    RL's `enable_hidden_capture`, `router_replay_train`) instead of the pass's."""

    def __init__(self, inner: StepExtension, training: bool, require_routed_experts: bool) -> None:
        self.inner = inner
        self.training = training
        self.require_routed_experts = require_routed_experts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_scope(
        self,
        model: torch.nn.Module,
        microbatch: ProcessedMicrobatch,
        groups: ParallelGroups,
        training: bool,
    ) -> contextlib.AbstractContextManager[Any]:
        # use_router_replay=True promised recorded experts, whatever the model's config says
        if self.require_routed_experts and microbatch.routed_experts_cp_sharded is None:
            raise ValueError(
                "`use_router_replay=True` but the microbatch has no `routed_experts` [B, S, L, K]"
            )
        return self.inner.forward_scope(model, microbatch, groups, self.training)


def seed_flag_extensions(
    extensions: Sequence[StepExtension],
    draft_model: Any,
    enable_hidden_capture: bool | None,
    use_router_replay: bool,
    router_replay_train: bool,
) -> tuple[StepExtension, ...]:
    """`extensions` plus those the seed API's flags turn on (the EAGLE draft, router replay).

    Raises:
        ValueError: `router_replay_train` without `use_router_replay`.
    """
    # the draft: `enable_hidden_capture` with `draft_model`; router replay: `use_router_replay`,
    # its backward armed with `router_replay_train`; a kind already in `extensions` is not added
    if router_replay_train and not use_router_replay:
        raise ValueError("`router_replay_train=True` needs `use_router_replay=True`")
    found = list(extensions)
    kinds = {type(getattr(e, "inner", e)).__name__ for e in found}
    if enable_hidden_capture and "DraftExtension" not in kinds:
        from lightning_mcore_rl.extensions.eagle_draft import DraftExtension

        found.append(_SeedFlagExtension(DraftExtension(draft_model), True, False))
    if use_router_replay and "MoEExtension" not in kinds:
        from lightning_mcore_rl.extensions.moe import MoEExtension

        found.append(_SeedFlagExtension(MoEExtension(), router_replay_train, True))
    return tuple(found)


@contextlib.contextmanager
def entered(scopes: Sequence[contextlib.AbstractContextManager[Any]]) -> Iterator[list[Any]]:
    """Enter `scopes` in order (exit in reverse, also on error); yields what each yielded."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(scope) for scope in scopes]


__all__ = [
    "LossFunc",
    "StepExtension",
    "entered",
    "resolve_extensions",
    "seed_flag_extensions",
    "step_extensions",
]
