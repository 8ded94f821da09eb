"""lightning-mcore-rl: Megatron-core RL and distillation training under PyTorch Lightning."""

# Shape notation of every docstring: `B` sequences in a (micro)batch, `G` group size (samples per
# prompt), `S` padded width of an unpacked batch, `T` packed length (sum of padded lengths), `V`
# vocabulary size (`V/TP`: one TP rank's shard), `H` hidden size, `K` top-k width, `CP` context-
# parallel size (`S/CP`, `T/CP`: a CP rank's zigzag shard, ops/context_parallel.py). Logits at
# position `t` score token `t+1`; loss inputs have length `S-1`.

__version__ = "0.1.0"

# megatron-core warns at import that Transformer Engine / Apex are missing (expected without a
# GPU stack): filter exactly those before anything imports it.
from lightning_mcore_rl._compat import filter_expected_warnings  # noqa: E402

filter_expected_warnings()

# Importing the package registers the strategy name "mcore_rl" with Lightning. This imports
# Lightning (not megatron-core: the strategy imports megatron lazily inside its hooks).
from lightning_mcore_rl.module import MCoreRLModule  # noqa: E402
from lightning_mcore_rl.strategy import MCoreRLStrategy, register_strategy  # noqa: E402

register_strategy()

__all__ = ["MCoreRLModule", "MCoreRLStrategy", "__version__"]
