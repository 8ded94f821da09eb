"""Trainer-free set-up of megatron's parallel state for a `ParallelSizes` layout (read back once
through `megatron_groups`, from the strategy's `setup_environment`)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from lightning_mcore_rl.parallel import ParallelGroups, megatron_groups
from lightning_mcore_rl.strategy.config import (
    CheckpointConfig,
    LogprobKernelConfig,
    MegatronDDPConfig,
    MicrobatchConfig,
    ParallelSizes,
    ReliabilityConfig,
)

DEFAULT_SEED = 1234


def init_model_parallel(
    parallel: ParallelSizes, timeout: timedelta | None = None
) -> ParallelGroups:
    """`initialize_model_parallel` once per process (the same layout later reuses it), megatron's
    RNG tracker seeded with `seed_everything`'s seed (`PL_GLOBAL_SEED`, default 1234); returns
    this rank's `ParallelGroups`. `timeout` bounds every group's collectives (`None`: 30 min).

    Raises:
        RuntimeError: megatron's state already holds another layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    p = parallel
    if ps.model_parallel_is_initialized():
        groups = megatron_groups()
        existing = (
            groups.tp_size,
            groups.pp_size,
            groups.vpp_size,
            groups.cp_size,
            groups.ep_size,
            groups.etp_size,
        )
        wanted = (p.tp, p.pp, p.vpp, p.cp, p.ep, p.expert_tp)
        if existing != wanted:
            raise RuntimeError(
                f"megatron's parallel state is already initialised with (tp, pp, vpp, cp, ep, "
                f"etp) = {existing}, but this strategy asks for {wanted}; call "
                "`megatron.core.parallel_state.destroy_model_parallel()` first."
            )
        return groups
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.expert_tp,
        **({} if timeout is None else {"distributed_timeout_minutes": timeout_minutes(timeout)}),
    )
    # Under CPU emulation the "CUDA" generator IS torch's CPU generator: keep its state.
    rng_state = torch.get_rng_state()
    model_parallel_cuda_manual_seed(int(os.environ.get("PL_GLOBAL_SEED", DEFAULT_SEED)))
    torch.set_rng_state(rng_state)
    return megatron_groups()


def check_strategy_args(
    *, microbatching: Any, ddp: Any, checkpoint: Any, reliability: Any, logprobs: Any
) -> None:
    """Class checks of the strategy's setting groups (each validates its own fields).

    Raises:
        TypeError: a group that is not its config class or None."""
    for name, value, cls in (
        ("microbatching", microbatching, MicrobatchConfig),
        ("ddp", ddp, MegatronDDPConfig),
        ("checkpoint", checkpoint, CheckpointConfig),
        ("reliability", reliability, ReliabilityConfig),
        ("logprobs", logprobs, LogprobKernelConfig),
    ):
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                f"`{name}` must be a {cls.__name__} or None, got {type(value).__name__}."
            )


def timeout_minutes(timeout: timedelta) -> float:
    """`timeout` as megatron's `distributed_timeout_minutes`."""
    # a float: megatron builds `timedelta(minutes=...)`, so a fraction of a minute is exact
    return timeout.total_seconds() / 60.0
