"""Hugging Face ``config.json`` -> megatron-core ``TransformerConfig`` fields and ``GPTModel``
arguments, for the dense decoder families megatron's GPT layer spec expresses exactly.

Every field that would change the function computed is either mapped or rejected with a
``ValueError`` naming it: an import never silently builds a different model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_mcore_rl.megatron_defaults import local_spec_settings

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# megatron-core 0.16 ``RotaryEmbedding._apply_scaling`` hard-codes these llama3 parameters.
_LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the bridge needs to know about one HF checkpoint.

    Attributes:
        model_type: HF ``model_type`` (one of :data:`SUPPORTED_MODEL_TYPES`).
        num_layers: ``L``.
        hidden_size: ``h``.
        num_heads: query heads ``H``.
        num_query_groups: key/value heads ``G``.
        head_dim: ``d`` (``kv_channels``).
        ffn_hidden_size: MLP width ``F`` (each of gate and up).
        vocab_size: ``V``.
        max_position_embeddings: longest sequence.
        layernorm_epsilon: RMSNorm epsilon.
        qkv_bias: q/k/v projections carry a bias (Qwen2).
        qk_layernorm: per-head RMSNorm on q and k (Qwen3).
        tied_embeddings: ``lm_head`` shares the input embedding.
        rotary_base: RoPE theta.
        rope_scaling_factor: llama3 RoPE scaling factor, ``None`` without scaling.
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    layernorm_epsilon: float
    qkv_bias: bool
    qk_layernorm: bool
    tied_embeddings: bool
    rotary_base: float
    rope_scaling_factor: float | None

    def config_fields(self) -> dict[str, Any]:
        """``TransformerConfig`` kwargs of the architecture (CPU-safe: no fused kernels,
        CPU allocation without random init, no dropout); parallel sizes and dtypes are left to
        the caller."""
        import torch

        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.head_dim,
            "ffn_hidden_size": self.ffn_hidden_size,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.layernorm_epsilon,
            "gated_linear_unit": True,
            "activation_func": torch.nn.functional.silu,
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
            "qk_layernorm": self.qk_layernorm,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "perform_initialization": False,  # build_chunk overwrites every parameter
            **local_spec_settings(),
        }

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """``GPTModel`` constructor arguments other than config, spec, stages and ``vp_stage``."""
        return {
            "vocab_size": self.vocab_size,
            "max_sequence_length": self.max_position_embeddings,
            "share_embeddings_and_output_weights": self.tied_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": self.rotary_base,
            "rope_scaling": self.rope_scaling_factor is not None,
            "rope_scaling_factor": self.rope_scaling_factor or 8.0,
        }


def _unsupported(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"Unsupported Hugging Face config field `{field}` = {value!r}: {why}.")


def _rope(config: Mapping[str, Any]) -> tuple[float, float | None]:
    """``(rope_theta, llama3 factor or None)`` from ``rope_parameters`` (transformers >= 5) or
    the older top-level ``rope_theta`` + ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    field = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _unsupported("partial_rotary_factor", partial, "only full rotary embeddings map")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise _unsupported(
            f"{field}.rope_type", rope_type, "megatron-core's GPTModel supports only 'llama3'"
        )
    for key, fixed in _LLAMA3_FIXED.items():
        if float(params.get(key, fixed)) != float(fixed):
            raise _unsupported(
                f"{field}.{key}",
                params.get(key),
                f"megatron-core 0.16 fixes llama3 `{key}` to {fixed}",
            )
    return theta, float(params["factor"])


def _check_sliding_window(config: Mapping[str, Any]) -> None:
    layer_types = config.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise _unsupported("layer_types", layer_types, "sliding-window layers are not supported")
    if config.get("use_sliding_window", False):
        raise _unsupported("use_sliding_window", True, "sliding-window attention is not supported")
    window = config.get("sliding_window")
    if (
        config.get("model_type") == "mistral"
        and window is not None
        and window < config["max_position_embeddings"]
    ):
        raise _unsupported(
            "sliding_window",
            window,
            f"a window shorter than max_position_embeddings "
            f"({config['max_position_embeddings']}) is not supported",
        )


def parse_architecture(config: Mapping[str, Any]) -> Architecture:
    """Validate an HF ``config.json`` dict and map it.

    Raises:
        ValueError: unknown ``model_type``, or a field whose value the megatron model cannot
            reproduce (message names the field and value).
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Unsupported Hugging Face `model_type` {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported("hidden_act", act, "only SwiGLU (silu) MLPs map")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field, False):
            raise _unsupported(field, True, "megatron's add_qkv_bias cannot express it")
    _check_sliding_window(config)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    theta, factor = _rope(config)
    return Architecture(
        model_type=model_type,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config["max_position_embeddings"]),
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type == "qwen3",
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        rotary_base=theta,
        rope_scaling_factor=factor,
    )
