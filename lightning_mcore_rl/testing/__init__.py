"""Testing support that ships with the package: CPU emulation of CUDA for megatron-core, a
layout-invariant tiny GPT and an N-rank gloo runner.

The strategy uses :func:`cpu_emulation` for ``accelerator="cpu"``, so this layer imports only torch
and megatron-core (never anything above it).
"""

from lightning_mcore_rl.testing.emulation import (
    cpu_emulation,
    init_distributed_optimizer_state_for_load,
    patched_attributes,
)
from lightning_mcore_rl.testing.megatron_state import destroy_megatron_state, init_megatron_state
from lightning_mcore_rl.testing.ranks import run_on_ranks
from lightning_mcore_rl.testing.tiny_gpt import tiny_gpt, tiny_gpt_config

__all__ = [
    "cpu_emulation",
    "destroy_megatron_state",
    "init_distributed_optimizer_state_for_load",
    "init_megatron_state",
    "patched_attributes",
    "run_on_ranks",
    "tiny_gpt",
    "tiny_gpt_config",
]
