"""A tiny megatron-core ``GPTModel`` whose weights are identical whatever the TP/PP/VPP layout.

Every parameter's FULL (unsharded, fp32) value is drawn from a generator seeded by ``(seed,
canonical name)``, where the canonical name is the parameter's name in a single-rank, single-chunk
model; each rank then keeps its tensor-parallel shard. So a TP=2 x PP=2 model and a TP=1 model built
with the same seed hold the same function, and their losses and gradients can be compared exactly.
"""

from __future__ import annotations

import re
import zlib
from typing import TYPE_CHECKING, Any, cast

import torch

from lightning_mcore_rl.megatron_defaults import local_spec_settings
from lightning_mcore_rl.models.layout import (
    check_config_layout,
    check_group_expert_collectives,
    layout_groups,
    parallel_config_fields,
)

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import ModuleSpec, TransformerConfig

    from lightning_mcore_rl.parallel import ParallelGroups

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def tiny_gpt_config(
    groups: ParallelGroups | None = None,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    bf16: bool = False,
    sequence_parallel: bool = False,
    **overrides: Any,
) -> TransformerConfig:
    """``TransformerConfig`` for the tiny GPT, with the parallel sizes of ``groups``.

    Dropout is off (exact comparisons), weights are created on CPU, and the pipeline p2p settings
    come from :func:`~lightning_mcore_rl.megatron_defaults.pipeline_p2p_settings`.

    Args:
        groups: this rank's layout (TP, PP, VPP, CP sizes); ``None``: one rank, no parallelism.
        num_layers: transformer layers of the FULL model (split over PP x VPP stages).
        hidden_size: ``H``.
        num_attention_heads: heads; must be divisible by TP.
        bf16: bf16 params and pipeline dtype (use with ``Float16Module``).
        sequence_parallel: megatron sequence parallelism (needs TP > 1; megatron requires it
            for MoE layers under TP > 1).
        **overrides: any other ``TransformerConfig`` field, e.g. ``num_moe_experts=4,
            moe_router_topk=2, add_bias_linear=False`` for MoE layers (experts split over
            ``groups``' EP ranks).

    Raises:
        ValueError: MoE layers with biases under an expert TP size > 1, or with EP > 1 and
            expert TP > 1 on gloo
            (:func:`~lightning_mcore_rl.models.layout.check_expert_collectives`).
    """
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    kwargs: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "ffn_hidden_size": 4 * hidden_size,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "sequence_parallel": sequence_parallel,
        "bf16": bf16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        **local_spec_settings(),
        **parallel_config_fields(layout_groups(groups)),
    }
    kwargs.update(overrides)
    if kwargs.get("num_moe_experts"):
        check_group_expert_collectives(layout_groups(groups), "tiny_gpt_config")
        _check_moe_bias(kwargs)
    return TransformerConfig(**kwargs)


def _check_moe_bias(kwargs: dict[str, Any]) -> None:
    """Refuse MoE layers with biases under expert TP > 1 before megatron's bare assertion
    ("Bias in Moe is only supported when ETP==1") in ``TransformerConfig``.

    Raises:
        ValueError: naming ``add_bias_linear``, the sizes and the fixes.
    """
    tp = kwargs["tensor_model_parallel_size"]
    etp = kwargs.get("expert_tensor_parallel_size") or tp  # None: megatron's default, TP
    if etp == 1 or not kwargs.get("add_bias_linear", True):  # megatron's default: biases
        return
    hint = ""
    if tp > 1 and not kwargs.get("sequence_parallel"):
        hint = " MoE layers under TP > 1 also need `sequence_parallel=True`."
    raise ValueError(
        f"tiny_gpt_config: MoE layers (`num_moe_experts={kwargs['num_moe_experts']}`) with "
        "biases (`add_bias_linear=True`, megatron's default) need an expert tensor-parallel "
        f"size of 1, got expert_tp={etp} (tp={tp}, "
        f"ep={kwargs.get('expert_model_parallel_size', 1)}; the expert TP size defaults to TP). "
        "Pass `add_bias_linear=False`, or set `expert_tensor_parallel_size=1` with "
        f"`expert_model_parallel_size` > 1.{hint}"
    )


def tiny_gpt(
    config: TransformerConfig | None = None,
    *,
    groups: ParallelGroups | None = None,
    vocab_size: int = 128,
    max_sequence_length: int = 64,
    seed: int = 0,
    vp_stage: int | None = None,
    transformer_layer_spec: ModuleSpec | None = None,
    share_embeddings_and_output_weights: bool = False,
    position_embedding_type: str = "learned_absolute",
) -> GPTModel:
    """Build this rank's chunk of the tiny GPT with layout-independent deterministic weights.

    Must run with megatron's parallel state initialised for ``groups``' layout (megatron's
    layers read it), on CPU inside ``cpu_emulation()``.

    Args:
        config: model config; default ``tiny_gpt_config(groups)``.
        groups: this rank's layout (stage flags from its PP rank and ``vp_stage``, TP shards from
            its TP rank); ``None``: one rank, no parallelism.
        vocab_size: ``V``; must be divisible by TP.
        max_sequence_length: longest sequence (learned position embeddings).
        seed: weight seed; the same seed gives the same full weights under any layout.
        vp_stage: virtual-pipeline chunk index (``None`` without VPP).
        transformer_layer_spec: layer spec; default megatron's local (non-TE) GPT spec with the
            packed- and CP-capable core attention
            (:func:`~lightning_mcore_rl.models.layers.get_packed_local_layer_spec`), with
            ``config.num_moe_experts`` experts per layer (``SequentialMLP``) when it is set.
        share_embeddings_and_output_weights: tie the output layer to the word embedding.
        position_embedding_type: ``"learned_absolute"`` or ``"rope"``.

    With ``config.mtp_num_layers`` set the chunk is a
    :class:`~lightning_mcore_rl.models.mtp.MTPGPTModel` with megatron's multi-token-prediction
    layers on the last stage (their weights deterministic like the rest).

    Returns:
        The ``GPTModel`` chunk (fp32 params, or bf16 if ``config.bf16``; not wrapped).

    Raises:
        ValueError: ``config``'s TP/PP/VPP/CP sizes are not ``groups``', ``vocab_size`` is
            not divisible by TP, or multi-token prediction under PP > 1 without rope.
    """
    from megatron.core.models.gpt import GPTModel

    from lightning_mcore_rl.models.layers import get_packed_local_layer_spec

    groups = layout_groups(groups)
    config = config if config is not None else tiny_gpt_config(groups)
    check_config_layout(config, groups)
    if vocab_size % groups.tp_size != 0:
        raise ValueError(f"`vocab_size` ({vocab_size}) must be divisible by TP ({groups.tp_size}).")
    if transformer_layer_spec is None:
        transformer_layer_spec = get_packed_local_layer_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False
        )
    model_class: type[GPTModel] = GPTModel
    extra: dict[str, Any] = {}
    if config.mtp_num_layers and groups.pp_size > 1 and position_embedding_type != "rope":
        raise ValueError(
            f"`mtp_num_layers={config.mtp_num_layers}` with pipeline parallelism "
            f"(PP={groups.pp_size}) needs `position_embedding_type='rope'`: the MTP layers on "
            "the last stage keep their own copy of the learned position embeddings, which "
            "megatron-core 0.16 does not keep in sync with the first stage's"
        )
    if config.mtp_num_layers:  # megatron's MTP layers (last stage), trained without labels
        from lightning_mcore_rl.models.mtp import MTPGPTModel, build_mtp_block_spec

        model_class = MTPGPTModel
        extra["mtp_block_spec"] = build_mtp_block_spec(config, transformer_layer_spec, vp_stage)
    model = model_class(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=groups.is_first_stage(vp_stage),
        post_process=groups.is_last_stage(vp_stage),
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        vp_stage=vp_stage,
        **extra,
    )
    load_deterministic_weights(model, seed, groups)
    return model


def canonical_name(model: torch.nn.Module, name: str, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Name of parameter ``name`` of ``model`` in the single-rank, single-chunk model (local
    decoder layer index -> global layer index; local expert ``k`` of EP rank ``ep_rank`` ->
    global expert ``ep_rank * E/EP + k``)."""
    if name == "output_layer.weight" and getattr(
        model, "share_embeddings_and_output_weights", False
    ):
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    match = _LAYER_NAME.match(name)
    if match is None:
        return name
    gpt: GPTModel = model  # names of the form decoder.layers.N.* come from a GPTModel
    layer = gpt.decoder.layers[int(match.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}.{name[match.end() :]}"
    expert = _LOCAL_EXPERT.search(name)
    if expert is None:
        return name
    local_experts = cast(Any, gpt.config).num_moe_experts // ep_size
    global_index = ep_rank * local_experts + int(expert.group(1))
    return (
        f"{name[: expert.start()]}.mlp.experts.local_experts.{global_index}.{name[expert.end() :]}"
    )


def is_expert_parameter(name: str) -> bool:
    """Whether parameter ``name`` belongs to a routed MoE expert (``SequentialMLP``), which is
    sharded over the expert TP group, not the TP group. (megatron's ``allreduce=False`` tag is
    set only under EP > 1, so the name decides; shared experts are dense layers.)"""
    return ".mlp.experts." in name


def full_parameter_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The deterministic full fp32 value of canonical parameter ``name``.

    Norm weights are ``1 + 0.1 N(0,1)``; biases and everything else ``0.02 N(0,1)`` — biases and
    norms are random (not megatron's 0/1) so their gradients are exercised by parity tests.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    is_norm_weight = "norm" in name and name.endswith("weight")
    return 1.0 + 0.1 * values if is_norm_weight else 0.02 * values


def tensor_parallel_shard(
    full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice (of ``tp_size``) of ``full`` for ``param`` (megatron marks
    sharded params with ``tensor_model_parallel`` and ``partition_dim``; the tiny GPT has only
    stride-1 shards)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if getattr(param, "partition_stride", 1) != 1:
        raise ValueError("tensor_parallel_shard supports partition_stride == 1 only")
    dim: int = cast(Any, param).partition_dim  # set on the tensor by megatron
    return full.chunk(tp_size, dim=dim)[tp_rank]


def full_shape(param: torch.Tensor, tp_size: int) -> torch.Size:
    """Unsharded shape of a (possibly tensor-parallel over ``tp_size`` ranks) megatron
    parameter."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[cast(Any, param).partition_dim] *= tp_size
    return torch.Size(shape)


@torch.no_grad()
def load_deterministic_weights(
    model: torch.nn.Module, seed: int, groups: ParallelGroups | None = None
) -> None:
    """Overwrite every parameter of ``model`` (this rank's chunk under ``groups``' layout;
    ``None``: one rank) with its layout-independent deterministic value (experts: their global
    index's value, sharded over the expert TP group).

    Raises:
        ValueError: ``model``'s megatron config has other TP/PP/VPP/CP sizes than ``groups``.
    """
    groups = layout_groups(groups)
    config = getattr(model, "config", None)
    if config is not None:
        check_config_layout(config, groups)
    for name, param in model.named_parameters():
        expert = is_expert_parameter(name)
        tp_rank, tp_size = (
            (groups.etp_rank, groups.etp_size) if expert else (groups.tp_rank, groups.tp_size)
        )
        canonical = canonical_name(model, name, groups.ep_rank, groups.ep_size)
        full = full_parameter_value(canonical, full_shape(param, tp_size), seed)
        param.copy_(tensor_parallel_shard(full, param, tp_rank, tp_size).to(param.dtype))
