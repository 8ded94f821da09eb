"""Rollout generation: the :class:`RolloutSource` protocol (``docs/rollout.md``) with the
embedded megatron sampler and a Hugging Face ``transformers`` backend, the recipes' refit glue
(:class:`PolicyRollout`), and toy tasks with verifiable rewards."""

from lightning_mcore_rl.rollout.hf_source import HFRolloutSource
from lightning_mcore_rl.rollout.policy import PolicyRollout, RolloutBackend, mismatch_extrema
from lightning_mcore_rl.rollout.sampler import GenerationOutput, generate
from lightning_mcore_rl.rollout.source import (
    MegatronRolloutSource,
    Rollout,
    RolloutSource,
    SamplingConfig,
)
from lightning_mcore_rl.rollout.tasks import ModularCountingTask

__all__ = [
    "GenerationOutput",
    "HFRolloutSource",
    "MegatronRolloutSource",
    "ModularCountingTask",
    "PolicyRollout",
    "Rollout",
    "RolloutBackend",
    "RolloutSource",
    "SamplingConfig",
    "generate",
    "mismatch_extrema",
]
