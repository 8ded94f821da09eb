"""Models: the layout-invariant tiny GPT (tests, examples) and, later, Hugging Face bridges."""

from lightning_mcore_rl.models.tiny_gpt import load_deterministic_weights, tiny_gpt, tiny_gpt_config

__all__ = ["load_deterministic_weights", "tiny_gpt", "tiny_gpt_config"]
