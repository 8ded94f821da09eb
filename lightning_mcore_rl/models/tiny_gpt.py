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

from lightning_mcore_rl.megatron_defaults import local_spec_settings, pipeline_p2p_settings

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import ModuleSpec, TransformerConfig

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.")


def tiny_gpt_config(
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    bf16: bool = False,
    sequence_parallel: bool = False,
    **overrides: Any,
) -> TransformerConfig:
    """``TransformerConfig`` for the tiny GPT, sized from megatron's initialised parallel state.

    Dropout is off (exact comparisons), weights are created on CPU, and the pipeline p2p settings
    come from :func:`~lightning_mcore_rl.megatron_defaults.pipeline_p2p_settings`.

    Args:
        num_layers: transformer layers of the FULL model (split over PP x VPP stages).
        hidden_size: ``H``.
        num_attention_heads: heads; must be divisible by TP.
        bf16: bf16 params and pipeline dtype (use with ``Float16Module``).
        sequence_parallel: megatron sequence parallelism (needs TP > 1).
        **overrides: any other ``TransformerConfig`` field.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    dtype = torch.bfloat16 if bf16 else torch.float32
    kwargs: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "ffn_hidden_size": 4 * hidden_size,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": vpp,
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "sequence_parallel": sequence_parallel,
        "bf16": bf16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        **local_spec_settings(),
        **pipeline_p2p_settings(vpp),
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def tiny_gpt(
    config: TransformerConfig | None = None,
    *,
    vocab_size: int = 128,
    max_sequence_length: int = 64,
    seed: int = 0,
    vp_stage: int | None = None,
    transformer_layer_spec: ModuleSpec | None = None,
    share_embeddings_and_output_weights: bool = False,
    position_embedding_type: str = "learned_absolute",
) -> GPTModel:
    """Build this rank's chunk of the tiny GPT with layout-independent deterministic weights.

    Must run with megatron's parallel state initialised (and on CPU inside ``cpu_emulation()``).

    Args:
        config: model config; default ``tiny_gpt_config()``.
        vocab_size: ``V``; must be divisible by TP.
        max_sequence_length: longest sequence (learned position embeddings).
        seed: weight seed; the same seed gives the same full weights under any layout.
        vp_stage: virtual-pipeline chunk index (``None`` without VPP).
        transformer_layer_spec: layer spec; default megatron's local (non-TE) GPT spec with the
            packed- and CP-capable core attention
            (:func:`~lightning_mcore_rl.data.get_packed_local_layer_spec`).
        share_embeddings_and_output_weights: tie the output layer to the word embedding.
        position_embedding_type: ``"learned_absolute"`` or ``"rope"``.

    Returns:
        The ``GPTModel`` chunk (fp32 params, or bf16 if ``config.bf16``; not wrapped).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from lightning_mcore_rl.data import get_packed_local_layer_spec

    config = config if config is not None else tiny_gpt_config()
    tp = ps.get_tensor_model_parallel_world_size()
    if vocab_size % tp != 0:
        raise ValueError(f"`vocab_size` ({vocab_size}) must be divisible by TP ({tp}).")
    model = GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec or get_packed_local_layer_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        vp_stage=vp_stage,
    )
    load_deterministic_weights(model, seed)
    return model


def canonical_name(model: torch.nn.Module, name: str) -> str:
    """Name of parameter ``name`` of ``model`` in the single-rank, single-chunk model
    (local decoder layer index -> global layer index)."""
    if name == "output_layer.weight" and getattr(
        model, "share_embeddings_and_output_weights", False
    ):
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    match = _LAYER_NAME.match(name)
    if match is None:
        return name
    gpt: GPTModel = model  # names of the form decoder.layers.N.* come from a GPTModel
    layer = gpt.decoder.layers[int(match.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{name[match.end() :]}"


def full_parameter_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The deterministic full fp32 value of canonical parameter ``name``.

    Norm weights are ``1 + 0.1 N(0,1)``; biases and everything else ``0.02 N(0,1)`` — biases and
    norms are random (not megatron's 0/1) so their gradients are exercised by parity tests.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    is_norm_weight = "norm" in name and name.endswith("weight")
    return 1.0 + 0.1 * values if is_norm_weight else 0.02 * values


def tensor_parallel_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice of ``full`` for ``param`` (megatron marks sharded params with
    ``tensor_model_parallel`` and ``partition_dim``; the tiny GPT has only stride-1 shards)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    if getattr(param, "partition_stride", 1) != 1:
        raise ValueError("tensor_parallel_shard supports partition_stride == 1 only")
    dim: int = cast(Any, param).partition_dim  # set on the tensor by megatron
    tp = ps.get_tensor_model_parallel_world_size()
    return full.chunk(tp, dim=dim)[ps.get_tensor_model_parallel_rank()]


def full_shape(param: torch.Tensor) -> torch.Size:
    """Unsharded shape of a (possibly tensor-parallel) megatron parameter."""
    from megatron.core import parallel_state as ps

    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[cast(Any, param).partition_dim] *= ps.get_tensor_model_parallel_world_size()
    return torch.Size(shape)


@torch.no_grad()
def load_deterministic_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter of ``model`` with its layout-independent deterministic value."""
    for name, param in model.named_parameters():
        full = full_parameter_value(canonical_name(model, name), full_shape(param), seed)
        param.copy_(tensor_parallel_shard(full, param).to(param.dtype))
