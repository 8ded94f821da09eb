"""A tiny megatron-core `GPTModel` whose weights are identical whatever the TP/PP/VPP/EP layout."""

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

# every parameter's FULL (unsharded, fp32) value is drawn from a generator seeded by (seed,
# canonical name), the name in a single-rank, single-chunk model; each rank keeps its shard. So a
# TP=2 x PP=2 model and a TP=1 model built with the same seed hold the same function, and their
# losses and gradients compare exactly
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
    """`TransformerConfig` for the tiny GPT with the parallel sizes of `groups` (`None`: one rank);
    `**overrides` sets any other field (e.g. `num_moe_experts=4`).

    Raises:
        ValueError: MoE layers with biases under expert TP > 1, or EP > 1 with expert TP > 1 on
            gloo.
    """
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    kwargs: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        # the layer count is the full model's, split over PP x VPP stages; sequence parallelism
        # needs TP > 1 (megatron requires it for MoE layers under TP > 1)
        "ffn_hidden_size": 4 * hidden_size,
        # dropout off: exact comparisons across layouts
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
    """Refuse MoE layers with biases under expert TP > 1 with a `ValueError` naming
    `add_bias_linear`, the sizes and the fixes."""
    tp = kwargs["tensor_model_parallel_size"]
    # megatron's own check is a bare assertion in `TransformerConfig` ("Bias in Moe is only
    # supported when ETP==1")
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
    """This rank's chunk of the tiny GPT with layout-independent deterministic weights (fp32, or
    bf16 if `config.bf16`; not wrapped); an `MTPGPTModel` with `config.mtp_num_layers`. `config`
    defaults to `tiny_gpt_config(groups)`, `transformer_layer_spec` to
    `get_packed_local_layer_spec`.

    Raises:
        ValueError: `config`'s TP/PP/VPP/CP sizes are not `groups`', `vocab_size` is not divisible
            by TP, or multi-token prediction under PP > 1 without rope.
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
    # megatron's layers read its parallel state: build with it initialised for `groups`' layout (on
    # CPU inside `cpu_emulation()`)
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
    # the same seed gives the same full weights under any layout
    load_deterministic_weights(model, seed, groups)
    return model


def canonical_name(model: torch.nn.Module, name: str, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Name of parameter `name` of `model` in the single-rank, single-chunk model (local layer and
    expert indices made global)."""
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
    # local expert k of EP rank r is global expert r * E/EP + k
    expert = _LOCAL_EXPERT.search(name)
    if expert is None:
        return name
    local_experts = cast(Any, gpt.config).num_moe_experts // ep_size
    global_index = ep_rank * local_experts + int(expert.group(1))
    return (
        f"{name[: expert.start()]}.mlp.experts.local_experts.{global_index}.{name[expert.end() :]}"
    )


def is_expert_parameter(name: str) -> bool:
    """Whether parameter `name` belongs to a routed MoE expert (`SequentialMLP`), sharded over the
    expert TP group, not the TP group."""
    # the name decides: megatron's `allreduce=False` tag is set only under EP > 1, and shared
    # experts are dense layers
    return ".mlp.experts." in name


def full_parameter_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The deterministic full fp32 value of canonical parameter `name`: norm weights
    `1 + 0.1 N(0,1)`, everything else `0.02 N(0,1)`."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    # biases and norms are random, not megatron's 0/1, so that parity tests exercise their gradients
    is_norm_weight = "norm" in name and name.endswith("weight")
    return 1.0 + 0.1 * values if is_norm_weight else 0.02 * values


def tensor_parallel_shard(
    full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """TP rank `tp_rank`'s slice (of `tp_size`) of `full` for `param`; raises `ValueError` for a
    strided shard."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if getattr(param, "partition_stride", 1) != 1:
        raise ValueError("tensor_parallel_shard supports partition_stride == 1 only")
    # megatron marks sharded params with `tensor_model_parallel` and `partition_dim`; the tiny GPT
    # has only stride-1 shards
    dim: int = cast(Any, param).partition_dim  # set on the tensor by megatron
    return full.chunk(tp_size, dim=dim)[tp_rank]


def full_shape(param: torch.Tensor, tp_size: int) -> torch.Size:
    """Unsharded shape of a (possibly tensor-parallel over `tp_size` ranks) megatron parameter."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[cast(Any, param).partition_dim] *= tp_size
    return torch.Size(shape)


@torch.no_grad()
def load_deterministic_weights(
    model: torch.nn.Module, seed: int, groups: ParallelGroups | None = None
) -> None:
    """Overwrite every parameter of `model` (this rank's chunk under `groups`' layout) with its
    layout-independent deterministic value; `ValueError` if `model`'s config has other sizes."""
    groups = layout_groups(groups)
    config = getattr(model, "config", None)
    if config is not None:
        check_config_layout(config, groups)
    for name, param in model.named_parameters():
        # experts take their global index's value, sharded over the expert TP group
        expert = is_expert_parameter(name)
        tp_rank, tp_size = (
            (groups.etp_rank, groups.etp_size) if expert else (groups.tp_rank, groups.tp_size)
        )
        canonical = canonical_name(model, name, groups.ep_rank, groups.ep_size)
        full = full_parameter_value(canonical, full_shape(param, tp_size), seed)
        param.copy_(tensor_parallel_shard(full, param, tp_rank, tp_size).to(param.dtype))
