"""Embedded rollout generation for small on-CPU RL runs and tests: a sampler that runs the
training model itself (no inference engine) and toy tasks with verifiable rewards."""

from lightning_mcore_rl.rollout.sampler import GenerationOutput, generate
from lightning_mcore_rl.rollout.tasks import ModularCountingTask

__all__ = ["GenerationOutput", "ModularCountingTask", "generate"]
