"""Rollout generation: the `RolloutSource` protocol (``docs/rollout.md``), its megatron, HF and
vLLM backends, the source choice and trainer-side refit (`PolicyRollout`), and toy tasks."""

from lightning_mcore_rl.rollout.hf_source import HFRolloutSource
from lightning_mcore_rl.rollout.pending import (
    BackgroundRolloutSource,
    OneRankRolloutSource,
    PendingRollout,
    ReadyRollout,
)
from lightning_mcore_rl.rollout.policy import (
    ROLLOUT_BACKENDS,
    PolicyRollout,
    RolloutBackend,
    RolloutChoice,
    RolloutSetup,
    RolloutSourceFactory,
    SubmittedRollout,
    hf_rollout_source,
    megatron_rollout_source,
    mismatch_extrema,
    rollout_source_factory,
    vllm_rollout_source,
)
from lightning_mcore_rl.rollout.preflight import NonFiniteWeightError, check_before_rollout
from lightning_mcore_rl.rollout.sampler import GenerationOutput, generate
from lightning_mcore_rl.rollout.source import (
    MegatronRolloutSource,
    Rollout,
    RolloutSource,
    SamplingConfig,
)
from lightning_mcore_rl.rollout.tasks import ModularCountingTask
from lightning_mcore_rl.rollout.vllm_refit import EngineDiedError
from lightning_mcore_rl.rollout.vllm_source import VLLMRolloutSource

__all__ = [
    "ROLLOUT_BACKENDS",
    "BackgroundRolloutSource",
    "EngineDiedError",
    "GenerationOutput",
    "HFRolloutSource",
    "MegatronRolloutSource",
    "ModularCountingTask",
    "NonFiniteWeightError",
    "OneRankRolloutSource",
    "PendingRollout",
    "PolicyRollout",
    "ReadyRollout",
    "Rollout",
    "RolloutBackend",
    "RolloutChoice",
    "RolloutSetup",
    "RolloutSource",
    "RolloutSourceFactory",
    "SamplingConfig",
    "SubmittedRollout",
    "VLLMRolloutSource",
    "check_before_rollout",
    "generate",
    "hf_rollout_source",
    "megatron_rollout_source",
    "mismatch_extrema",
    "rollout_source_factory",
    "vllm_rollout_source",
]
