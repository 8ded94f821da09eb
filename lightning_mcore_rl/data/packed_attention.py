"""Core attention that honours THD ``cu_seqlens`` without Transformer Engine.

megatron-core's local ``DotProductAttention`` rejects ``packed_seq_params`` (only
``TEDotProductAttention`` takes THD input), so packing could not run on CPU or on the local layer
spec. :class:`PackedDotProductAttention` is a drop-in ``core_attention`` for
``get_gpt_layer_local_spec()``: with ``packed_seq_params`` (``qkv_format="thd"``) it runs causal
attention within each span ``[cu_seqlens_q[i], cu_seqlens_q[i+1])`` — block-diagonal causal
attention, computed span by span with ``torch.nn.functional.scaled_dot_product_attention`` so the
cost is ``sum(len_i^2)``, not ``T^2``; without it, ordinary causal (or masked) attention on
``[sq, b, np, hn]``.

Supported with packing: learned absolute position embeddings with per-document ``position_ids``
(:func:`~lightning_mcore_rl.data.packing.packed_position_ids`) and RoPE (megatron applies it per
span from ``cu_seqlens_q_padded``). Not supported: context parallelism (needs TE's CP attention),
sliding windows and non-vanilla softmax; these raise at construction.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import ModuleSpec, TransformerConfig

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


class PackedDotProductAttention(MegatronModule):
    """Local (non-TE) core attention with THD packed-sequence support.

    Shapes (``np`` heads and ``ng`` key/value groups on this TP rank, ``hn`` head dim):

    * padded: ``query [sq, b, np, hn]``, ``key/value [sk, b, ng, hn]`` -> ``[sq, b, np*hn]``
    * packed (thd): ``query [T, np, hn]``, ``key/value [T, ng, hn]`` -> ``[T, np*hn]``

    Output ``o_t = sum_{s <= t, s in span(t)} softmax_s(scale * q_t . k_s) v_s``: tokens attend
    causally within their own span only. Padding is part of each span, so real tokens (which
    precede their span's padding) never see it.

    Args:
        config: the transformer config.
        layer_number: 1-based layer index (query-key layer scaling).
        attn_mask_type: the layer's mask type; packed input requires a causal type.
        attention_type: ``"self"`` (recorded only, as in megatron).
        attention_dropout: dropout probability; default ``config.attention_dropout``.
        softmax_scale: default ``1/sqrt(hn)``.
        cp_comm_type: accepted for signature compatibility; CP is unsupported.
        pg_collection: process groups (``tp`` used); default megatron's global groups.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"PackedDotProductAttention does not support context parallelism "
                f"(context_parallel_size={config.context_parallel_size}); use Transformer Engine's "
                "TEDotProductAttention for CP > 1."
            )
        if config.window_size is not None:
            raise ValueError(f"sliding-window attention is unsupported, got {config.window_size}")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type must be 'vanilla', got {config.softmax_type!r}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.num_heads = config.num_attention_heads // tp_size
        self.num_query_groups = config.num_query_groups // tp_size
        head_dim = config.kv_channels
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            scale /= self.layer_number  # megatron's DotProductAttention does the same
        self.softmax_scale = scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention over padded ``[s, b, h, d]`` or packed ``[T, h, d]`` input (class docstring).

        Args:
            query: ``[sq, b, np, hn]``, or ``[T, np, hn]`` when packed.
            key: ``[sk, b, ng, hn]``, or ``[T, ng, hn]`` when packed.
            value: same shape as ``key``.
            attention_mask: padded only: megatron's boolean mask ``[b|1, 1, sq, sk]``, True =
                masked out; ``None`` gives causal attention. Ignored when packed.
            attn_mask_type: overrides the layer's mask type.
            attention_bias: unsupported, must be ``None``.
            packed_seq_params: THD boundaries; ``cu_seqlens_q`` must equal ``cu_seqlens_kv``.

        Returns:
            ``[sq, b, np*hn]`` padded, or ``[T, np*hn]`` packed.
        """
        if attention_bias is not None:
            raise ValueError("PackedDotProductAttention does not support `attention_bias`")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, mask_type, packed_seq_params)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is not None:
            context = self._attend(q, k, v, attn_mask=~attention_mask, is_causal=False)
        else:
            context = self._attend(q, k, v, attn_mask=None, is_causal=mask_type in _CAUSAL_TYPES)
        # [b, np, sq, hn] -> [sq, b, np*hn]
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _forward_packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask_type: AttnMaskType,
        params: PackedSeqParams,
    ) -> torch.Tensor:
        if params.qkv_format != "thd":
            raise ValueError(
                f"packed_seq_params.qkv_format must be 'thd', got {params.qkv_format!r}"
            )
        if mask_type not in _CAUSAL_TYPES:
            raise ValueError(f"packed attention needs a causal mask type, got {mask_type}")
        if not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        bounds = params.cu_seqlens_q.tolist()
        if query.ndim != 3 or bounds[-1] != query.shape[0]:
            raise ValueError(
                f"packed query must be [T, np, hn] with T = cu_seqlens_q[-1] = {bounds[-1]}, got "
                f"shape {tuple(query.shape)}"
            )
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end == start:
                continue
            # [L, h, d] -> [1, h, L, d]: one span, attended causally on its own
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            pieces.append(self._attend(q, k, v, attn_mask=None, is_causal=True)[0])
        # [np, T, hn] -> [T, np*hn]
        return torch.cat(pieces, dim=1).transpose(0, 1).reshape(query.shape[0], -1)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        """SDPA on ``q [b, np, sq, hn]``, ``k/v [b, ng, sk, hn]`` (groups repeated to ``np``)."""
        if self.num_heads != self.num_query_groups:
            repeats = self.num_heads // self.num_query_groups
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=is_causal,
            scale=self.softmax_scale,
        )


def get_packed_local_layer_spec(**kwargs: Any) -> ModuleSpec:
    """megatron's local GPT layer spec with :class:`PackedDotProductAttention` as core attention.

    Args:
        **kwargs: forwarded to ``get_gpt_layer_local_spec`` (e.g. ``qk_layernorm``).

    Returns:
        The layer ``ModuleSpec`` (pass it to ``GPTModel(transformer_layer_spec=...)``).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(**kwargs)
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec
