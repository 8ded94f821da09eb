"""Routed-expert (Qwen3-MoE, Mixtral) parts of `HFBridge`: the layer specs of a model whose layers
may mix dense and MoE MLPs, the layouts megatron's MoE layer accepts, and which expert-parallel
rank holds each exported expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_mcore_rl.models.hf.config import Architecture, MoEArchitecture

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


def moe_block_spec(
    config: TransformerConfig, *, pp_rank: int, vp_stage: int | None, transformer_engine: bool
) -> TransformerBlockSubmodules:
    """megatron's decoder block spec of stage `pp_rank` (`vp_stage`): dense or MoE per layer as
    `config.moe_layer_freq` says; Transformer Engine layers or megatron's local ones with
    `PackedDotProductAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from lightning_mcore_rl.models.layers.packed_attention import PackedDotProductAttention

    spec = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=transformer_engine,
        normalization="RMSNorm",
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    if not transformer_engine:
        for layer in spec.layer_specs:  # the dense and the MoE spec, each possibly repeated
            layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def expert_width_field(arch: Architecture) -> str:
    """The HF field of the experts' width (Qwen3-MoE `moe_intermediate_size`, Mixtral
    `intermediate_size`)."""
    return "moe_intermediate_size" if arch.model_type == "qwen3_moe" else "intermediate_size"


def check_moe_layout(arch: Architecture, config: TransformerConfig) -> None:
    """Refuse (`ValueError`) `E` not divisible by EP, the expert width not divisible by the expert
    TP size, or TP > 1 without `sequence_parallel`."""
    moe = arch.moe
    if moe is None:
        return
    # megatron would stop with a bare `AssertionError` (TP without sequence parallelism: a
    # `ValueError` only in the first training forward); only sizes are read, so this runs before any
    # collective
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size
    count_field = "num_experts" if arch.model_type == "qwen3_moe" else "num_local_experts"
    if moe.num_experts % ep != 0:
        raise ValueError(
            f"`{count_field}` ({moe.num_experts}) must be divisible by the expert-parallel size "
            f"({ep}): every EP rank holds the same number of experts. Use an EP size that "
            f"divides {moe.num_experts}."
        )
    if etp is not None and moe.ffn_hidden_size % etp != 0:
        raise ValueError(
            f"`{expert_width_field(arch)}` ({moe.ffn_hidden_size}) must be divisible by the "
            f"expert tensor-parallel size ({etp}): each expert-TP rank holds an equal slice of "
            f"every expert. Use an expert TP size that divides {moe.ffn_hidden_size}."
        )
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise ValueError(
            f"megatron's MoE layers under tensor parallelism (TP="
            f"{config.tensor_model_parallel_size}) need sequence parallelism: build the config "
            "with `sequence_parallel=True` (e.g. `bridge.transformer_config(groups, "
            "sequence_parallel=True)`), which also needs the sequence length divisible by TP."
        )


def expert_owners(
    moe: MoEArchitecture, layers: set[int], ep_size: int
) -> dict[str, tuple[int, int]]:
    """`first HF name -> (global expert, EP rank holding it)` of every expert weight (gate for fc1,
    down for fc2) of the MoE `layers` this pipeline stage holds."""
    # local expert k on EP rank r is global (HF) expert r * E/EP + k; its weights are split over the
    # expert TP group, the other weights over TP
    per_rank = moe.num_experts // ep_size
    owners: dict[str, tuple[int, int]] = {}
    for layer in layers:
        for expert in range(moe.num_experts):
            gate, _, down = moe.expert_names(layer, expert)
            owners[gate] = owners[down] = (expert, expert // per_rank)
    return owners
