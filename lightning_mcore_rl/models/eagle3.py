"""An EAGLE-3 draft with the exact architecture vLLM and SGLang load (``LlamaForCausalLMEagle3``),
built from megatron-core's tensor-parallel layers, and its export to a Hugging Face directory.

The architecture (vLLM ``model_executor/models/llama_eagle3.py``, one decoder layer, HF names):

    h   = fc([h^{l_1} ; ... ; h^{l_k}])                      # [.., k H] -> [.., H]
    x   = [input_layernorm(E[y_{t+1}]) ; hidden_norm(h)]      # [.., 2 H]  (RMSNorm)
    a   = o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x))   # causal, per sequence
    r   = a + h;  m = down_proj(silu(gate_proj n) * up_proj n),  n = post_attention_layernorm(r)
    z   = lm_head(norm(m + r))                                # [.., V]: the token at t + 2

``q/k/v/gate/up`` are column-parallel (heads / FFN split over TP), ``o/down`` row-parallel,
``fc``/``lm_head`` column-parallel with gathered outputs, ``E`` vocab-parallel; rope is Llama's
(non-interleaved halves, ``rope_theta``), positions restart at 0 in every packed sequence. The
draft and target vocabularies are the same (no ``d2t``/``t2d`` maps).

Notation: ``B`` sequences, ``S`` tokens (packed: ``B = 1``, ``T`` tokens), ``H`` hidden, ``V``
vocabulary, ``n`` heads (``n/tp`` local), ``d`` head size, ``F`` FFN size, ``k`` aux layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from lightning_mcore_rl.models.draft import (
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
    """Llama's rotary embedding: ``x cos + rotate_half(x) sin`` with ``inv_freq_i =
    theta^(-2i/d)`` over the two halves of each head.

    Args:
        x: ``[B, S, n, d]``.
        positions: ``[B, S]`` integer positions.
        theta: ``rope_theta``.

    Returns:
        ``[B, S, n, d]``.
    """
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, S, d/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [B, S, 1, d]
    return (x.float() * angles.cos() + _rotate_half(x.float()) * angles.sin()).to(x.dtype)


class Eagle3DraftModel(MegatronModule):
    """The EAGLE-3 draft (see the module docstring); the same call as
    :class:`~lightning_mcore_rl.models.draft.EagleDraftModel`, so the step trains either.

    Args:
        config: the draft's ``TransformerConfig`` (width, heads, ``ffn_hidden_size``, TP size).
        vocab_size: ``V``, divisible by TP.
        aux_layers: the policy's decoder layers (0-based global indices) it reads.
        rope_theta: rope base.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        aux_layers: tuple[int, ...],
        rope_theta: float = 10000.0,
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
        self.head_dim = hidden // heads
        init, eps = config.init_method, config.layernorm_epsilon

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
        """Causal self-attention of ``x [B, S, 2H]`` over each row (packed: each span).

        Returns:
            ``[B, S, H]`` (``o_proj``'s all-reduced output).
        """
        batch, width, _ = x.shape

        def heads(proj: Any) -> Tensor:
            out, _ = proj(x)
            return cast(Tensor, out).view(batch, width, -1, self.head_dim)  # [B, S, n/tp, d]

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
        """Full-vocabulary draft logits.

        Args:
            hidden_states: ``[S, B, k H]`` the aux layers' outputs in :attr:`aux_layers` order.
            next_input_ids: ``[B, S]`` the token after each position (0 past a sequence).
            attention_mask: unused: the attention is causal per row (per span when packed).
            packed_seq_params: megatron ``PackedSeqParams`` of a packed row (its padded spans).

        Returns:
            ``[B, S, V]`` logits (token ``t + 2`` at position ``t``).
        """
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
    """This rank's shard of an EAGLE-3 draft with layout-independent deterministic weights (drawn
    by name like the tiny GPT's; RMSNorm weights ``1 + 0.1 N(0, 1)``).

    Args:
        policy_config: the policy chunk's config (width, heads, FFN size, precision).
        vocab_size: ``V`` (the policy's).
        aux_layers: the policy's decoder layers the draft reads.
        groups: this rank's layout (``None``: one rank).
        seed: weight seed.
        rope_theta: rope base.
        **config_overrides: see :func:`~lightning_mcore_rl.models.draft.eagle_draft_config`.

    Raises:
        ValueError: ``aux_layers`` empty, repeated or outside the policy's layers; ``vocab_size``
            or the heads not divisible by TP; context parallelism (CP > 1).
    """
    layers, groups = checked_draft_layout(policy_config, vocab_size, aux_layers, groups)
    config = eagle_draft_config(policy_config, groups, **config_overrides)
    draft = Eagle3DraftModel(config, vocab_size, layers, rope_theta)
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
    """The draft's full (TP-gathered) weights under their EAGLE-3 names. No ``d2t``/``t2d``
    vocabulary maps: the draft vocabulary is the target's, and vLLM has no map to load them into
    then (``draft_vocab_size == vocab_size``). Collective over TP.

    Args:
        draft: the (possibly DDP-wrapped) :class:`Eagle3DraftModel`.
        groups: this rank's layout (``None``: one rank).

    Returns:
        ``{hf_name: fp32 CPU tensor}``.
    """
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


def eagle3_hf_config(draft: torch.nn.Module, max_position_embeddings: int) -> dict[str, Any]:
    """The ``config.json`` of the EAGLE-3 directory (a Llama config vLLM/SGLang read)."""
    from lightning_mcore_rl.parallel import unwrap_model

    inner = cast(Eagle3DraftModel, unwrap_model(draft))
    config = inner.config
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
        "eagle_config": {
            "use_aux_hidden_state": True,
            # vLLM's id k is the hidden state after k decoder layers (``hidden + residual``;
            # models/llama.py ``_maybe_add_hidden_state(..., idx + 1, ...)``): the output of
            # 0-based layer k - 1, which is what the capture records for aux layer k - 1
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in inner.aux_layers],
        },
    }


def save_eagle3(
    draft: torch.nn.Module,
    directory: str | Path,
    *,
    groups: ParallelGroups | None = None,
    max_position_embeddings: int = 4096,
) -> Path | None:
    """Write the draft as an EAGLE-3 Hugging Face directory (``config.json`` +
    ``model.safetensors``) that vLLM (``speculative_config={"method": "eagle3", "model": dir}``)
    and SGLang load. Collective over TP; TP rank 0 writes.

    Args:
        draft: the (possibly wrapped) :class:`Eagle3DraftModel` (on the last pipeline stage).
        directory: where to write.
        groups: this rank's layout (``None``: one rank).
        max_position_embeddings: the ``config.json`` value (the target's context length).

    Returns:
        The directory on the writing rank, ``None`` on the others.
    """
    from lightning_mcore_rl.models.hf.safetensors_io import save_safetensors

    state = eagle3_full_state(draft, groups)
    if layout_groups(groups).tp_rank != 0:
        return None
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, path / "model.safetensors", metadata={"format": "pt"})
    config = eagle3_hf_config(draft, max_position_embeddings)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
