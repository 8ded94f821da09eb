"""Hugging Face import/export for megatron-core GPT models (Llama, Qwen2, Qwen3, Mistral, and the
routed-expert Qwen3-MoE and Mixtral)."""

from lightning_mcore_rl.models.hf.bridge import HFBridge
from lightning_mcore_rl.models.hf.config import SUPPORTED_MODEL_TYPES

__all__ = ["SUPPORTED_MODEL_TYPES", "HFBridge"]
