"""Imported once by the forkserver of `run_on_ranks` so forked ranks start warm."""

import megatron.core.dist_checkpointing  # noqa: F401
import megatron.core.distributed  # noqa: F401
import megatron.core.models.gpt  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import megatron.core.pipeline_parallel  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
