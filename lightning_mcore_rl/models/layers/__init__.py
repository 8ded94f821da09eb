"""The local layer spec's modules without Transformer Engine: packed (THD) core attention,
the memory-lean SwiGLU MLP and the RMSNorm (`get_packed_local_layer_spec` puts them together)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mcore_rl.models.layers.gated_mlp import GatedMLP, SwiGLU
    from lightning_mcore_rl.models.layers.packed_attention import (
        PackedDotProductAttention,
        get_packed_local_layer_spec,
    )
    from lightning_mcore_rl.models.layers.rms_norm import LocalNorm, RMSNorm


# these modules subclass megatron-core's: imported on first use, so that importing the package
# (and `lmrl --help`) does not import megatron-core, seconds of start-up
def __getattr__(name: str) -> Any:
    """The layer names of `__all__`, imported from their module on first access."""
    if name in ("PackedDotProductAttention", "get_packed_local_layer_spec"):
        from lightning_mcore_rl.models.layers import packed_attention

        return getattr(packed_attention, name)
    if name in ("GatedMLP", "SwiGLU"):
        from lightning_mcore_rl.models.layers import gated_mlp

        return getattr(gated_mlp, name)
    if name in ("LocalNorm", "RMSNorm"):
        from lightning_mcore_rl.models.layers import rms_norm

        return getattr(rms_norm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GatedMLP",
    "LocalNorm",
    "PackedDotProductAttention",
    "RMSNorm",
    "SwiGLU",
    "get_packed_local_layer_spec",
]
