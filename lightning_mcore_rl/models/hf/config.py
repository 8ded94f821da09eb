"""Hugging Face ``config.json`` -> megatron-core ``TransformerConfig`` fields and ``GPTModel``
arguments, for the dense decoder families megatron's GPT layer spec expresses exactly.

``config.json`` is read as ``transformers`` reads it (:func:`resolve_config`: the config class of
its ``model_type``, so a missing key takes that class's default). Every field that would change the
function computed is either mapped or rejected with a ``ValueError`` naming it: an import never
silently builds a different model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_mcore_rl.megatron_defaults import local_spec_settings

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# the families whose transformers modeling code reads the field (the others hard-code no bias)
_BIAS_FIELDS = {"attention_bias": ("llama", "qwen3"), "mlp_bias": ("llama",)}

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
        sliding_window: ``w``: a windowed layer's query ``i`` attends keys ``i - w < j <= i``
            (``w`` tokens, itself included); ``None`` when no layer has a window.
        window_layers: per layer (length ``L``), whether it attends within ``sliding_window``.
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
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] = ()

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
            **self._window_fields(),
            **local_spec_settings(),
        }

    def _window_fields(self) -> dict[str, Any]:
        """megatron's ``window_size = (left, right)`` lets query ``i`` attend keys
        ``i - left <= j <= i + right``, so transformers' window ``w`` is ``(w - 1, 0)``;
        ``window_attn_skip_freq`` lists the windowed layers (``None``: all of them)."""
        if self.sliding_window is None:
            return {}
        every = all(self.window_layers)
        return {
            "window_size": (self.sliding_window - 1, 0),
            "window_attn_skip_freq": None if every else [int(w) for w in self.window_layers],
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
    # transformers >= 5 moves a top-level factor into rope_parameters and leaves None behind
    partial = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
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


def _window(config: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """``(w, windowed layers)`` as transformers' modeling code applies them: Mistral windows every
    layer when ``sliding_window`` is set (it ignores ``layer_types``), Qwen2/Qwen3 the
    ``layer_types`` entries ``sliding_attention``, Llama none."""
    model_type = config["model_type"]
    window = config.get("sliding_window")
    if model_type == "mistral":
        layers = (window is not None,) * num_layers
    elif model_type in ("qwen2", "qwen3"):
        types = list(config["layer_types"])
        if set(types) - {"full_attention", "sliding_attention"}:  # its length: transformers'
            raise _unsupported(
                "layer_types",
                types,
                f"{model_type} layers are 'full_attention' or 'sliding_attention'",
            )
        layers = tuple(t == "sliding_attention" for t in types)
        if any(layers) and window is None:
            raise _unsupported(
                "layer_types",
                types,
                "'sliding_attention' layers need a `sliding_window` (it is null, e.g. with "
                "`use_sliding_window` false; transformers refuses to run it too)",
            )
    else:
        return None, (False,) * num_layers
    if not any(layers):
        return None, layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise _unsupported("sliding_window", window, "a window is a positive number of tokens")
    return window, layers


def resolve_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` dict) as ``transformers`` reads it: the ``to_dict()`` of its
    ``model_type``'s config class, so missing keys hold that class's defaults (e.g. Mistral's
    ``sliding_window`` 4096) and derived ones are computed (Qwen2/Qwen3 ``layer_types``).

    Raises:
        ValueError: unknown ``model_type``, or a config the transformers class rejects.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Unsupported Hugging Face `model_type` {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    try:
        resolved = config_class.from_dict(dict(config)).to_dict()
    except Exception as err:  # ValueError/TypeError, or huggingface_hub's StrictDataclassError
        raise ValueError(
            f"transformers' {config_class.__name__} rejects this config.json: {err}"
        ) from err
    return dict(resolved)


def parse_architecture(config: Mapping[str, Any]) -> Architecture:
    """Validate an HF ``config.json`` dict (missing keys at transformers' defaults,
    :func:`resolve_config`) and map it.

    Raises:
        ValueError: unknown ``model_type``, or a field whose value the megatron model cannot
            reproduce (message names the field and value).
    """
    config = resolve_config(config)
    model_type = config["model_type"]
    act = config["hidden_act"]
    if act != "silu":
        raise _unsupported("hidden_act", act, "only SwiGLU (silu) MLPs map")
    for field, families in _BIAS_FIELDS.items():
        if model_type in families and config.get(field, False):
            raise _unsupported(field, True, "megatron's add_qkv_bias cannot express it")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    num_layers = int(config["num_hidden_layers"])
    theta, factor = _rope(config)
    window, window_layers = _window(config, num_layers)
    return Architecture(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config["max_position_embeddings"]),
        layernorm_epsilon=float(config["rms_norm_eps"]),
        qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type == "qwen3",
        tied_embeddings=bool(config["tie_word_embeddings"]),
        rotary_base=theta,
        rope_scaling_factor=factor,
        sliding_window=window,
        window_layers=window_layers,
    )
