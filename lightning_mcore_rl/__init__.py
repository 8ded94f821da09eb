"""lightning-mcore-rl: Megatron-core RL and distillation training under PyTorch Lightning.

Shape notation used in every docstring of this package:

* ``B``  sequences in a (micro)batch, ``G`` group size (samples per prompt)
* ``S``  padded sequence width of an unpacked batch, ``T`` packed length (sum of padded lengths)
* ``V``  vocabulary size, ``V/TP`` the vocab shard held by one tensor-parallel rank
* ``H``  hidden size, ``K`` top-k width
* ``CP`` context-parallel size; ``S/CP`` and ``T/CP`` are the sequence shards a CP rank holds
  (zigzag load-balanced layout, see :mod:`lightning_mcore_rl.ops.context_parallel`)

Next-token convention: logits at position ``t`` score token ``t+1``; loss inputs have length ``S-1``.
"""

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
