"""`NoExtension`: every hook of `lightning_mcore_rl.train.extension.StepExtension` a no-op."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_mcore_rl.losses import MetricNormalizer
    from lightning_mcore_rl.parallel import ParallelGroups
    from lightning_mcore_rl.train.context import StepContext
    from lightning_mcore_rl.train.extension import LossFunc
    from lightning_mcore_rl.train.model_inputs import GlobalBatch, ProcessedMicrobatch
    from lightning_mcore_rl.train.post_processors import PostProcessingFunction
    from lightning_mcore_rl.train.statistics import StepOutput


class NoExtension:
    """The base an extension overrides the hooks it needs of."""

    def check_batch(self, batch: Mapping[str, Any], chunks: Sequence[torch.nn.Module]) -> None:
        return None

    def split_options(self, training: bool) -> dict[str, bool]:
        return {}

    def normalizations(
        self, chunks: Sequence[torch.nn.Module], training: bool
    ) -> Mapping[str, MetricNormalizer]:
        return {}

    def statistics_scope(
        self,
        chunks: Sequence[torch.nn.Module],
        global_batch: GlobalBatch,
        post: PostProcessingFunction,
        context: StepContext,
        training: bool,
    ) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def pass_scope(
        self, chunks: Sequence[torch.nn.Module], training: bool
    ) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def forward_scope(
        self,
        model: torch.nn.Module,
        microbatch: ProcessedMicrobatch,
        groups: ParallelGroups,
        training: bool,
    ) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def forward_kwargs(
        self, microbatch: ProcessedMicrobatch, global_valid_toks: Tensor | None
    ) -> dict[str, Any]:
        return {}

    def wrap_loss(
        self,
        fn: LossFunc,
        model: torch.nn.Module,
        microbatch: ProcessedMicrobatch,
        groups: ParallelGroups,
        trains: bool,
    ) -> LossFunc:
        return fn

    def microbatch_data(
        self, model: torch.nn.Module, microbatch: ProcessedMicrobatch, state: Any
    ) -> Mapping[str, Tensor]:
        return {}

    def finish(self, out: StepOutput, state: Any, context: StepContext) -> StepOutput:
        return out


__all__ = ["NoExtension"]
