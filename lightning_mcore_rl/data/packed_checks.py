"""The helpers of packed attention that need no megatron-core at import time: the shared causal
mask and the check that a model's core attention takes packed THD input."""

from __future__ import annotations

# kept apart from `models.layers.packed_attention` (whose attention subclasses megatron's) so that
# importing the package, and `lmrl --help`, does not import megatron-core (seconds)
import functools

import torch


@functools.lru_cache(maxsize=8)
def shared_causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """megatron's causal mask `[1, 1, s, s]`, True above the diagonal (masked out): ONE tensor per
    `(s, device)`, shared: never modify it in place."""
    # one shared tensor: the attention recognises the causal mask by identity, without reading it
    return torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device).triu(1)


def check_packed_core_attention(model: torch.nn.Module) -> None:
    """Raise `ValueError` unless every core attention of `model` (a chunk, possibly wrapped) takes
    packed THD input."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    # megatron's local `DotProductAttention` (its default non-TE spec) asserts `packed_seq_params is
    # None` mid-forward; this names the fix up front
    for name, module in model.named_modules():
        if isinstance(getattr(module, "core_attention", None), DotProductAttention):
            raise ValueError(
                f"sequence packing needs a core attention that takes packed THD input, but "
                f"`{name}.core_attention` is megatron's local DotProductAttention; build the "
                "model with `transformer_layer_spec="
                "lightning_mcore_rl.models.layers.get_packed_local_layer_spec()` "
                "(local spec, CPU) or Transformer Engine's GPT layer spec."
            )
