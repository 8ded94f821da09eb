"""Initialise and destroy megatron-core's process-global state (groups, RNG tracker, buffers)."""

from __future__ import annotations

import torch


def init_megatron_state(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    seed: int = 1234,
) -> None:
    """Build megatron's parallel groups over the already-initialised default process group and seed
    its RNG tracker, as Megatron-LM's `initialize` does (`expert_tensor_parallel_size=None`: the TP
    size)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # a previous test's groups and RNG tracker would otherwise leak into this one's
    destroy_megatron_state()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    torch.manual_seed(seed)
    # the RNG tracker reads CUDA RNG state: on CPU this runs inside `cpu_emulation`
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_megatron_state() -> None:
    """Reset every piece of megatron-core global state a test may have created (parallel groups and
    their buffers, the RNG tracker, the microbatch calculator); the default process group stays."""
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    # safe when nothing was initialised
    parallel_state.destroy_model_parallel()
    mcore_random.initialize_rng_tracker(force_reset=True)
    mcore_random.get_cuda_rng_tracker().reset()
    num_microbatches_calculator.unset_num_microbatches_calculator()
