"""``init_megatron_state`` / ``destroy_megatron_state`` leave nothing behind between uses."""

from __future__ import annotations

import torch
from megatron.core import num_microbatches_calculator, parallel_state
from megatron.core.tensor_parallel import random as mcore_random

from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state, tiny_gpt


def _init_destroy_reinit(rank: int) -> dict[str, object]:
    init_megatron_state(tensor_model_parallel_size=2, seed=5)
    num_microbatches_calculator.init_num_microbatches_calculator(rank, None, 4, 1, 2)
    parallel_state.get_global_memory_buffer()
    first = tiny_gpt(groups=megatron_groups()).output_layer.weight.detach().clone()
    destroy_megatron_state()
    cleaned = {
        "initialized": parallel_state.model_parallel_is_initialized(),
        "rng_states": dict(mcore_random.get_cuda_rng_tracker().get_states()),
        "calculator": num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR,
        "buffer": parallel_state._GLOBAL_MEMORY_BUFFER,
    }
    init_megatron_state(
        tensor_model_parallel_size=1, seed=5
    )  # a different layout in the same process
    second = tiny_gpt(groups=megatron_groups()).output_layer.weight.detach()
    return {
        **cleaned,
        "tp_after": parallel_state.get_tensor_model_parallel_world_size(),
        "same_weights": torch.equal(second.chunk(2)[rank], first),
    }


def test_destroy_resets_groups_rng_tracker_buffers_and_calculator():
    from lightning_mcore_rl.testing import run_on_ranks

    for result in run_on_ranks(_init_destroy_reinit, 2):
        assert result["initialized"] is False
        assert result["rng_states"] == {}
        assert result["calculator"] is None
        assert result["buffer"] is None
        assert result["tp_after"] == 1
        assert result["same_weights"], "tiny_gpt weights depend on the layout"
