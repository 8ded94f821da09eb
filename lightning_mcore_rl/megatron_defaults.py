"""Megatron `ModelParallelConfig` settings this project applies to every model it trains."""

# a bottom-layer module (torch only): the strategy and `testing` both use it
from __future__ import annotations


def pipeline_p2p_settings(virtual_pipeline_model_parallel_size: int | None) -> dict[str, bool]:
    """`TransformerConfig` point-to-point settings for megatron's pipeline schedules
    (`virtual_pipeline_model_parallel_size` `None` or 1: no VPP)."""
    if (
        virtual_pipeline_model_parallel_size is not None
        and virtual_pipeline_model_parallel_size > 1
    ):
        # the interleaved schedule with megatron's default `batch_p2p_comm=True` swaps forward
        # activations and backward gradients at PP=2: the previous and the next stage are the same
        # peer and the tensors have the same shape, so nothing errors and training silently diverges
        # (Megatron-LM issues #750 / #1450; docs/cpu-emulation.md §4). Megatron-LM's own training
        # uses these settings for interleaving
        return {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    # non-interleaved 1F1B is not affected and keeps megatron's defaults
    return {"overlap_p2p_comm": False, "batch_p2p_comm": True}


def local_spec_settings() -> dict[str, bool]:
    """`TransformerConfig` settings of a model on megatron's local layer spec (no Apex or
    Transformer Engine, e.g. on CPU): weights created on CPU, every fusion that needs Apex/TE off.
    """
    return {
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
    }
