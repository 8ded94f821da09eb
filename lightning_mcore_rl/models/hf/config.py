"""Hugging Face `config.json` -> megatron-core `TransformerConfig` fields and `GPTModel` arguments,
for the dense decoder families and the routed-expert ones (Qwen3-MoE, Mixtral)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_mcore_rl.megatron_defaults import local_spec_settings

# every field that would change the function computed is either mapped or rejected with a
# `ValueError` naming it: an import never silently builds a different model
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")

# the families whose transformers modeling code reads the field (the others hard-code no bias)
_BIAS_FIELDS = {"attention_bias": ("llama", "qwen3", "qwen3_moe"), "mlp_bias": ("llama",)}
# every layer windowed when `sliding_window` is set (their modeling code has no layer types)
_WINDOW_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")
# HF field holding the expert count (transformers' to_dict() writes `num_local_experts` for both)
_EXPERT_COUNT_FIELD = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}
# HF module and projection names of the routed experts on disk (transformers 5 fuses them in
# memory, `mlp.experts.gate_up_proj`, but saves and loads one tensor per expert)
_EXPERT_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
_REFUSED_MODEL_TYPES = {
    "olmoe": (
        "its q_norm/k_norm normalise the whole q/k projection (all heads at once) where "
        "megatron's qk_layernorm normalises each head, and it can clamp q/k/v (`clip_qkv`)"
    ),
}

# megatron-core 0.16 ``RotaryEmbedding._apply_scaling`` hard-codes these llama3 parameters.
_LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclasses.dataclass(frozen=True)
class MoEArchitecture:
    """The routed experts of a Qwen3-MoE or Mixtral checkpoint.

    Attributes:
        ffn_hidden_size: `F_e`, each expert's width (each of gate and up).
        moe_layers: per layer (length `L`), whether its MLP is the routed experts.
        normalize_top_k: the `k` routing weights are renormalised to sum to 1.
        hf_module: the MoE block's module name on disk (`mlp` / `block_sparse_moe`).
        hf_projections: the experts' `(gate, up, down)` projection names on disk.
    """

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    moe_layers: tuple[bool, ...]
    normalize_top_k: bool
    hf_module: str
    hf_projections: tuple[str, str, str]

    def config_fields(self) -> dict[str, Any]:
        """megatron's MoE fields reproducing transformers' forward."""
        return {
            "num_moe_experts": self.num_experts,
            "moe_router_topk": self.top_k,
            "moe_ffn_hidden_size": self.ffn_hidden_size,
            "moe_layer_freq": [int(moe) for moe in self.moe_layers],
            # softmax over all E router logits, then top-k: megatron's top-k of the logits then
            # softmax over those k equals the renormalised top-k of the full softmax;
            # `moe_router_pre_softmax=True` keeps the full softmax's values
            "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": not self.normalize_top_k,
            # no load-balancing loss (HF adds its aux loss only with `output_router_logits`, which
            # is refused) and no capacity limit (transformers never drops a token)
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_expert_capacity_factor": None,
            "moe_grouped_gemm": False,
            "moe_token_dispatcher_type": "alltoall",
        }

    def router_name(self, layer: int) -> str:
        """HF name of layer `layer`'s router weight `[E, h]`."""
        return f"model.layers.{layer}.{self.hf_module}.gate.weight"

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """HF names of global expert `expert`'s `(gate [F_e, h], up [F_e, h], down [h, F_e])`
        weights in layer `layer`."""
        prefix = f"model.layers.{layer}.{self.hf_module}.experts.{expert}."
        return tuple(f"{prefix}{proj}.weight" for proj in self.hf_projections)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the bridge needs to know about one HF checkpoint: `L` layers, hidden `h`, `H` query and
    `G` key/value heads of dim `d`, MLP width `F`, vocab `V`, and the flags below.

    Attributes:
        qkv_bias: q/k/v projections carry a bias (Qwen2).
        qk_layernorm: per-head RMSNorm on q and k (Qwen3).
        rope_scaling_factor: llama3 RoPE scaling factor, `None` without scaling.
        sliding_window: `w`: a windowed layer's query `i` attends keys `i - w < j <= i`.
        window_layers: per layer (length `L`), whether it attends within `sliding_window`.
        moe: the routed experts; `None` for a dense model (its dense layers use `ffn_hidden_size`).
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
    moe: MoEArchitecture | None = None

    @property
    def dense_layers(self) -> tuple[bool, ...]:
        """Per layer (length `L`), whether its MLP is the dense `ffn_hidden_size` one."""
        if self.moe is None:
            return (True,) * self.num_layers
        return tuple(not moe for moe in self.moe.moe_layers)

    def config_fields(self) -> dict[str, Any]:
        """`TransformerConfig` kwargs of the architecture (CPU-safe, no dropout); parallel sizes and
        dtypes are left to the caller."""
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
            **(self.moe.config_fields() if self.moe is not None else {}),
            **local_spec_settings(),
        }

    def _window_fields(self) -> dict[str, Any]:
        """megatron's `window_size` and `window_attn_skip_freq` of the windowed layers."""
        if self.sliding_window is None:
            return {}
        # megatron's window (left, right) lets query i attend keys i - left <= j <= i + right, so
        # transformers' window w is (w - 1, 0); `window_attn_skip_freq` lists the windowed layers
        # (None: all)
        every = all(self.window_layers)
        return {
            "window_size": (self.sliding_window - 1, 0),
            "window_attn_skip_freq": None if every else [int(w) for w in self.window_layers],
        }

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """`GPTModel` constructor arguments other than config, spec, stages and `vp_stage`."""
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
    """`(rope_theta, llama3 factor or None)` from `rope_parameters` (transformers >= 5) or the older
    top-level `rope_theta` + `rope_scaling`."""
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
    """`(w, windowed layers)` as transformers' modeling code applies them."""
    model_type = config["model_type"]
    window = config.get("sliding_window")
    # Mistral, Mixtral and Qwen3-MoE window every layer when `sliding_window` is set (Mistral
    # ignores `layer_types`; Qwen3-MoE's is null unless `use_sliding_window`), Qwen2/Qwen3 the
    # `sliding_attention` entries of `layer_types`, Llama none
    if model_type in _WINDOW_EVERY_LAYER:
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
    """`config` (a `config.json` dict) as `transformers` reads it: the `to_dict()` of its
    `model_type`'s config class.

    Raises:
        ValueError: unknown `model_type`, or a config the transformers class rejects.
    """
    model_type = config.get("model_type")
    if model_type in _REFUSED_MODEL_TYPES:
        raise ValueError(
            f"Unsupported Hugging Face `model_type` {model_type!r}: "
            f"{_REFUSED_MODEL_TYPES[model_type]}."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Unsupported Hugging Face `model_type` {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    from transformers import CONFIG_MAPPING

    # missing keys take the class's defaults (e.g. Mistral's `sliding_window` 4096) and derived ones
    # are computed (Qwen2/Qwen3 `layer_types`)
    config_class = CONFIG_MAPPING[model_type]
    try:
        resolved = config_class.from_dict(dict(config)).to_dict()
    except Exception as err:  # ValueError/TypeError, or huggingface_hub's StrictDataclassError
        raise ValueError(
            f"transformers' {config_class.__name__} rejects this config.json: {err}"
        ) from err
    return dict(resolved)


def parse_architecture(config: Mapping[str, Any]) -> Architecture:
    """Validate an HF `config.json` dict (at transformers' defaults, `resolve_config`) and map it.

    Raises:
        ValueError: unknown `model_type`, or a field whose value the megatron model cannot reproduce
            (naming the field and value).
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
        # no `num_key_value_heads`: plain multi-head attention; no `head_dim`: hidden / heads
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config["max_position_embeddings"]),
        layernorm_epsilon=float(config["rms_norm_eps"]),
        # Qwen2's modeling code always gives q/k/v a bias, the others none (or `attention_bias`,
        # refused above)
        qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        tied_embeddings=bool(config["tie_word_embeddings"]),
        rotary_base=theta,
        rope_scaling_factor=factor,
        sliding_window=window,
        window_layers=window_layers,
        moe=_moe(config, num_layers) if model_type in _EXPERT_NAMES else None,
    )


def _moe(config: Mapping[str, Any], num_layers: int) -> MoEArchitecture | None:
    """The routed experts as transformers builds them (`None` when every layer is dense); raises
    `ValueError` naming a router setting megatron's MoE layer cannot reproduce."""
    model_type = config["model_type"]
    if config.get("output_router_logits"):
        raise _unsupported(
            "output_router_logits",
            config["output_router_logits"],
            "transformers then adds one aux loss pooled over all layers' router logits, "
            "megatron's load-balancing loss is per layer; set it false (megatron's own "
            "`moe_aux_loss_coeff` can be enabled through the TransformerConfig overrides)",
        )
    jitter = config.get("router_jitter_noise", 0.0)
    if jitter:
        raise _unsupported(
            "router_jitter_noise", jitter, "megatron's router has no multiplicative input noise"
        )
    num_experts = int(config["num_local_experts"])  # to_dict() name of `num_experts` too
    if model_type == "qwen3_moe":
        step = config["decoder_sparse_step"]
        # dense layers: `mlp_only_layers`, and all but every `decoder_sparse_step`-th; none routed
        # with no experts
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise _unsupported("decoder_sparse_step", step, "a positive layer interval")
        dense = set(config["mlp_only_layers"])
        layers = tuple(
            i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
        normalize, ffn = bool(config["norm_topk_prob"]), int(config["moe_intermediate_size"])
    else:  # mixtral: every layer routed, top-k always renormalised
        layers, normalize, ffn = (True,) * num_layers, True, int(config["intermediate_size"])
    if not any(layers):
        return None
    count_field = _EXPERT_COUNT_FIELD[model_type]
    top_k = config["num_experts_per_tok"]
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise _unsupported(
            "num_experts_per_tok", top_k, f"must be in [1, `{count_field}` = {num_experts}]"
        )
    if top_k == 1 and normalize:
        field = "norm_topk_prob" if model_type == "qwen3_moe" else "num_experts_per_tok"
        raise _unsupported(
            field,
            config[field],
            "one expert renormalised to weight 1 needs megatron's softmax after top-k, which "
            "megatron 0.16 refuses at top-k 1 (`moe_router_pre_softmax` required)",
        )
    module, projections = _EXPERT_NAMES[model_type]
    return MoEArchitecture(
        num_experts=num_experts,
        top_k=top_k,
        ffn_hidden_size=ffn,
        moe_layers=layers,
        normalize_top_k=normalize,
        hf_module=module,
        hf_projections=projections,
    )
