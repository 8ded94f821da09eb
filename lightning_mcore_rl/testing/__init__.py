"""Test infrastructure: an N-rank gloo runner, megatron state helpers and the bare megatron
reference loop (`training`), with the fixed re-exports `cpu_emulation` and `tiny_gpt`."""

# nothing in the package imports this layer (tests/unit/test_import_graph.py)
from lightning_mcore_rl._compat import init_distributed_optimizer_state_for_load
from lightning_mcore_rl.cpu import cpu_emulation, patched_attributes
from lightning_mcore_rl.models import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.testing.megatron_state import destroy_megatron_state, init_megatron_state
from lightning_mcore_rl.testing.ranks import run_on_ranks

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
