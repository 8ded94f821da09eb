"""Mixture-of-experts: router losses and statistics and router replay as one `StepExtension`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_mcore_rl.extensions.moe.router_replay import (
    after_replay_forward,
    arm_replay_forward,
    check_routed_experts,
    replay_enabled,
    router_replay_pass,
)
from lightning_mcore_rl.extensions.moe.router_statistics import (
    RouterCall,
    RouterStatistic,
    RouterStatistics,
    moe_config,
    moe_pass,
)
from lightning_mcore_rl.extensions.noop import NoExtension

if TYPE_CHECKING:
    from lightning_mcore_rl.parallel import ParallelGroups
    from lightning_mcore_rl.train.context import StepContext
    from lightning_mcore_rl.train.model_inputs import GlobalBatch, ProcessedMicrobatch
    from lightning_mcore_rl.train.post_processors import PostProcessingFunction
    from lightning_mcore_rl.train.statistics import StepOutput


class MoEExtension(NoExtension):
    """Router losses and statistics of every pass, router replay of every pass whose batch
    carries `routed_experts`."""

    # every hook does nothing for dense chunks
    def check_batch(self, batch: Mapping[str, Any], chunks: Sequence[torch.nn.Module]) -> None:
        """`routed_experts [B, S, L, K]` against the model (required when the routers replay).

        Raises:
            ValueError, TypeError: see `check_routed_experts`.
        """
        config = moe_config(chunks)
        if config is not None:
            check_routed_experts(batch, config)

    def split_options(self, training: bool) -> dict[str, bool]:
        """The routers' padding mask and replay ids are built per microbatch."""
        return {"routing": True}

    @contextlib.contextmanager
    def statistics_scope(
        self,
        chunks: Sequence[torch.nn.Module],
        global_batch: GlobalBatch,
        post: PostProcessingFunction,
        context: StepContext,
        training: bool,
    ) -> Iterator[RouterStatistics | None]:
        """`moe_pass`: the router statistics collected (and the router losses scaled)."""
        with moe_pass(
            chunks,
            global_batch.microbatches,
            context.groups,
            training=training,
            device=context.device,
        ) as router:
            yield router

    @contextlib.contextmanager
    def pass_scope(self, chunks: Sequence[torch.nn.Module], training: bool) -> Iterator[None]:
        """No stale replay state on either side of a pass of replaying routers."""
        with router_replay_pass(chunks, replay_enabled(chunks)):
            yield

    @contextlib.contextmanager
    def forward_scope(
        self,
        model: torch.nn.Module,
        microbatch: ProcessedMicrobatch,
        groups: ParallelGroups,
        training: bool,
    ) -> Iterator[None]:
        """Replaying routers route with the microbatch's recorded experts (REPLAY_FORWARD).

        Raises:
            ValueError: replaying routers and a microbatch without `routed_experts`.
        """
        if not replay_enabled([model]):
            yield
            return
        if microbatch.routed_experts_cp_sharded is None:
            raise ValueError(
                "the model's routers replay but the microbatch has no `routed_experts` "
                "[B, S, L, K]; the rollout source records it"
            )
        arm_replay_forward(model, microbatch.routed_experts_cp_sharded, groups.tp_rank,
                           groups.tp_size)  # fmt: skip
        yield
        # a training pass arms REPLAY_BACKWARD for activation recompute, a forward-only pass
        # clears the action
        after_replay_forward(model, train=training)

    def finish(self, out: StepOutput, state: Any, context: StepContext) -> StepOutput:
        """The router statistics reduced (one all-reduce over every rank) into the metrics."""
        if state is None:
            return out
        routed = state.reduce(context.groups, context.world_group)
        return dataclasses.replace(out, metrics={**out.metrics, **routed})


__all__ = ["MoEExtension", "RouterCall", "RouterStatistic", "RouterStatistics"]
