"""Models: the layout-invariant tiny GPT (tests, examples) and the Hugging Face bridge."""

from lightning_mcore_rl.models.hf import HFBridge
from lightning_mcore_rl.models.tiny_gpt import load_deterministic_weights, tiny_gpt, tiny_gpt_config

__all__ = ["HFBridge", "load_deterministic_weights", "tiny_gpt", "tiny_gpt_config"]
