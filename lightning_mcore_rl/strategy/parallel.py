"""Trainer-free set-up of megatron's parallel state for a :class:`ParallelSizes` layout."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from lightning_mcore_rl.strategy.config import ParallelSizes

if TYPE_CHECKING:
    from lightning_mcore_rl.train import ParallelGroups

DEFAULT_SEED = 1234


def init_model_parallel(parallel: ParallelSizes) -> ParallelGroups:
    """``initialize_model_parallel`` once per process (a later call with the same layout reuses
    it), megatron's RNG tracker seeded with ``seed_everything``'s seed (``PL_GLOBAL_SEED``,
    default 1234); returns this rank's :class:`~lightning_mcore_rl.train.ParallelGroups`.

    Raises:
        RuntimeError: megatron's state already holds another layout.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from lightning_mcore_rl.train import ParallelGroups

    p = parallel
    if ps.model_parallel_is_initialized():
        groups = ParallelGroups.from_megatron()
        existing = (groups.tp_size, groups.pp_size, groups.vpp_size, groups.cp_size)
        if existing != (p.tp, p.pp, p.vpp, p.cp):
            raise RuntimeError(
                f"megatron's parallel state is already initialised with (tp, pp, vpp, cp) = "
                f"{existing}, but this strategy asks for {(p.tp, p.pp, p.vpp, p.cp)}; call "
                "`megatron.core.parallel_state.destroy_model_parallel()` first."
            )
        return groups
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp,
    )
    # Under CPU emulation the "CUDA" generator IS torch's CPU generator: keep its state.
    rng_state = torch.get_rng_state()
    model_parallel_cuda_manual_seed(int(os.environ.get("PL_GLOBAL_SEED", DEFAULT_SEED)))
    torch.set_rng_state(rng_state)
    return ParallelGroups.from_megatron()
