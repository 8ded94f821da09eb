"""Core attention that honours THD `cu_seqlens` without Transformer Engine, also under CP, and the
local layer spec built around it (`get_packed_local_layer_spec`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from lightning_mcore_rl.data.packed_checks import (
    check_packed_core_attention,
    shared_causal_mask,
)
from lightning_mcore_rl.data.packing import cp_local_indices
from lightning_mcore_rl.ops.context_parallel import (
    allgather_cp_to_positions,
    get_tokens_on_this_cp_rank,
)

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import ModuleSpec, TransformerConfig

__all__ = [
    "PackedDotProductAttention",
    "check_packed_core_attention",
    "get_packed_local_layer_spec",
    "shared_causal_mask",
]

# megatron's local `DotProductAttention` rejects `packed_seq_params` (only TE's takes THD input) and
# context parallelism, so packing could not run on CPU or on the local spec. Supported with packing:
# learned absolute position embeddings with per-document `position_ids`
# (`data.packing.packed_position_ids`), RoPE (megatron's attention applies it per span from
# `cu_seqlens_q_padded` with CP-aware positions) and causal sliding windows `(left, 0)` on the
# layers `window_attn_skip_freq` selects
_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


class PackedDotProductAttention(MegatronModule):
    """Local (non-TE) core attention with THD packed-sequence support, a drop-in `core_attention`
    for `get_gpt_layer_local_spec()` (`np` heads, `ng` key/value groups on this TP rank, `hn` head
    dim): padded `query [sq, b, np, hn]`, `key/value [sk, b, ng, hn]` -> `[sq, b, np*hn]`; packed
    `query [T/CP, np, hn]`, `key/value [T/CP, ng, hn]` -> `[T/CP, np*hn]`, causal within each span.

    Args:
        config: the transformer config.
        layer_number: 1-based layer index.
        attn_mask_type: the layer's mask type; packed input requires a causal type.
        attention_type: `"self"` (recorded only, as in megatron).
        attention_dropout: dropout probability; default `config.attention_dropout`.
        softmax_scale: default `1/sqrt(hn)`.
        cp_comm_type: accepted for signature compatibility; keys/values are always all-gathered.
        pg_collection: process groups (`tp`, and `cp` under CP); default megatron's global groups.

    Raises:
        ValueError: a window looking ahead, a non-vanilla softmax, or a CP group that does not
            match `config.context_parallel_size`.
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
        window = config.window_size
        # query i attends keys i - left <= j <= i of its span; windows looking ahead are not
        # supported
        if window is not None and window[1] != 0:
            raise ValueError(f"only causal windows `window_size = (left, 0)` work, got {window}")
        windowed = is_layer_window_attention(window, config.window_attn_skip_freq, layer_number)
        self.window_left = window[0] if windowed and window is not None and window[0] >= 0 else None
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type must be 'vanilla', got {config.softmax_type!r}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        cp = getattr(pg_collection, "cp", None)
        self.cp_group = cp if cp is not None and cp.size() > 1 else None
        cp_size = 1 if self.cp_group is None else self.cp_group.size()
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"the attention's CP group has {cp_size} ranks but "
                f"`config.context_parallel_size` is {config.context_parallel_size}; build the "
                "model after megatron's parallel state (or pass its pg_collection)."
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.num_heads = config.num_attention_heads // tp_size
        self.num_query_groups = config.num_query_groups // tp_size
        head_dim = config.kv_channels
        # megatron's DotProductAttention divides by the layer number under
        # `apply_query_key_layer_scaling` and its softmax multiplies it back: the net is this
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        # padded input with a causal mask runs SDPA over the whole width with is_causal=True: on CPU
        # its flash kernel keeps a [b, np, sq] log-sum-exp for the backward instead of megatron's
        # [b, np, sq, sk] fp32 scores and probabilities. Any other mask, dropout in training or the
        # `unfused` backend runs megatron's own attention (bitwise the plain local spec)
        self.padded_sdpa = config.attention_backend != AttnBackend.unfused
        self.dense: DotProductAttention | None = None
        if self.cp_group is None:  # padded input with any other mask: megatron's local attention
            self.dense = DotProductAttention(
                config, layer_number, attn_mask_type, attention_type, attention_dropout,
                softmax_scale, cp_comm_type, pg_collection,
            )  # fmt: skip

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
        """Attention over padded `[sq, b, np, hn]` / `[sk, b, ng, hn]` input (-> `[sq, b, np*hn]`)
        or packed `[T, np, hn]` / `[T, ng, hn]` (-> `[T, np*hn]`).

        Args:
            attention_mask: padded only: megatron's boolean `[b|1, 1, sq, sk]`, True = masked out;
                `None` gives causal attention on a causal layer.
            packed_seq_params: THD boundaries; `cu_seqlens_q` must equal `cu_seqlens_kv`.

        Raises:
            ValueError: an `attention_bias`, padded input under CP, or malformed packed input.
        """
        if attention_bias is not None:
            raise ValueError("PackedDotProductAttention does not support `attention_bias`")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, mask_type, packed_seq_params)
        # CP needs packing: the zigzag shard of each span is defined by cu_seqlens
        if self.dense is None:
            raise ValueError(
                f"context parallelism (CP={self.config.context_parallel_size}) needs packed THD "
                "input (`packed_seq_params`, i.e. sequence_packing=True); got padded input of "
                f"shape {tuple(query.shape)}"
            )
        if self._padded_is_causal(query, key, attention_mask, mask_type):
            return self._forward_padded(query, key, value)
        return self.dense(query, key, value, attention_mask, attn_mask_type=mask_type)

    def _padded_is_causal(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_mask: torch.Tensor | None,
        mask_type: AttnMaskType,
    ) -> bool:
        """Whether padded input takes SDPA: a causal self-attention mask (`None` on a causal layer,
        the shared `shared_causal_mask`, or on CPU any mask equal to it), no dropout to draw, the
        backend not `unfused`."""
        sq, sk = query.shape[0], key.shape[0]
        if not self.padded_sdpa or sq != sk or (self.training and self.dropout_p > 0.0):
            return False
        if attention_mask is None:
            return mask_type == AttnMaskType.causal
        causal = shared_causal_mask(sq, attention_mask.device)
        if attention_mask is causal:
            return True
        # off the CPU only the shared mask counts: a value check would wait for the device in every
        # layer
        if attention_mask.device.type != "cpu" or attention_mask.dtype != torch.bool:
            return False
        if attention_mask.dim() != 4 or attention_mask.shape[-3:] != (1, sq, sk):
            return False
        return torch.equal(attention_mask, causal.expand_as(attention_mask))

    def _forward_padded(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Causal padded attention: `query [s, b, np, hn]`, `key/value [s, b, ng, hn]` ->
        `[s, b, np*hn]` (within the window on a windowed layer)."""
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if self.window_left is None:
            out = self._attend(q, k, v, attn_mask=None, is_causal=True)
        else:
            span = torch.arange(query.shape[0], device=query.device)
            out = self._attend(q, k, v, self._allowed(span, span), is_causal=False)
        # [b, np, s, hn] -> [s, b, np*hn]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

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
        cu = params.cu_seqlens_q
        bounds = cu.tolist()
        cp_size = 1 if self.cp_group is None else self.cp_group.size()
        if query.ndim != 3 or bounds[-1] != query.shape[0] * cp_size:
            raise ValueError(
                f"packed query must be [T/CP, np, hn] with T = cu_seqlens_q[-1] = {bounds[-1]} "
                f"and CP = {cp_size}, got shape {tuple(query.shape)}"
            )
        if cp_size > 1:
            return self._forward_packed_cp(query, key, value, cu)
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end == start:
                continue
            # [L, h, d] -> [1, h, L, d]: one span, attended causally on its own
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            if self.window_left is None:
                pieces.append(self._attend(q, k, v, attn_mask=None, is_causal=True)[0])
                continue
            span = torch.arange(end - start, device=query.device)
            pieces.append(self._attend(q, k, v, self._allowed(span, span), is_causal=False)[0])
        # [np, T, hn] -> [T, np*hn]
        return torch.cat(pieces, dim=1).transpose(0, 1).reshape(query.shape[0], -1)

    def _forward_packed_cp(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor
    ) -> torch.Tensor:
        """Packed attention under CP: `query/key/value [T/CP, n, hn]` (this rank's zigzag shard of
        every span) -> `[T/CP, np*hn]`."""
        cp_group = self.cp_group
        assert cp_group is not None  # only called under CP
        cp_rank, cp_size = cp_group.rank(), cp_group.size()
        bounds = cu.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if (end - start) % (2 * cp_size) != 0:
                raise ValueError(
                    f"span [{start}, {end}) of cu_seqlens_q is not a multiple of 2*CP = "
                    f"{2 * cp_size}; pack with pad_individual a multiple of 2*CP"
                )
        # each rank holds the zigzag shard of every span (`cp_local_indices`); keys and values are
        # all-gathered over the CP group megatron hands the attention (backward: a reduce-scatter to
        # the owners), and each local query attends the keys of its span at global positions <= its
        # own: sum(len_i^2)/CP per rank
        positions = torch.cat([cp_local_indices(cu, r, cp_size) for r in range(cp_size)])
        # one all-gather for keys and values: [T/CP, ng, 2*hn] -> [T, ng, 2*hn]
        kv = allgather_cp_to_positions(torch.cat([key, value], dim=-1), positions, cp_group)
        full_key, full_value = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end == start:
                continue
            # this rank's query positions inside the span (chunks r and 2CP-1-r of 2CP)
            span = torch.arange(end - start, device=query.device)
            q_pos = get_tokens_on_this_cp_rank(span, cp_rank, cp_size, seq_dim=0)  # [L/CP]
            allowed = self._allowed(q_pos, span)  # [L/CP, L]
            q = query[start // cp_size : end // cp_size].transpose(0, 1).unsqueeze(0)
            k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (full_key, full_value))
            pieces.append(self._attend(q, k, v, attn_mask=allowed, is_causal=False)[0])
        # [np, T/CP, hn] -> [T/CP, np*hn]
        return torch.cat(pieces, dim=1).transpose(0, 1).reshape(query.shape[0], -1)

    def _allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """`[len(q_pos), len(k_pos)]`, True where the query attends the key: causal, and
        `q - k <= window_size[0]` on a windowed layer."""
        offset = q_pos[:, None] - k_pos[None, :]
        allowed = offset >= 0
        if self.window_left is not None:
            allowed &= offset <= self.window_left
        return allowed

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        """SDPA on `q [b, np, sq, hn]`, `k/v [b, ng, sk, hn]` -> `[b, np, sq, hn]`."""
        # grouped queries go to SDPA as they are (`enable_gqa`): keys and values are not repeated to
        # np heads. What SDPA keeps for its backward is made compact: the value, a view into
        # `linear_qkv`'s whole output, would keep all of it
        q, k, v = (_own_storage(x) for x in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=self.num_heads != self.num_query_groups,
        )


def _own_storage(x: torch.Tensor) -> torch.Tensor:
    """`x`, copied when it views a larger storage (a slice of a fused projection's output)."""
    # saving a view for the backward would keep the rest of its storage
    if x.untyped_storage().nbytes() <= x.numel() * x.element_size():
        return x
    return x.clone(memory_format=torch.contiguous_format)


def get_packed_local_layer_spec(**kwargs: Any) -> ModuleSpec:
    """megatron's local GPT layer spec (`**kwargs` to `get_gpt_layer_local_spec`, e.g.
    `qk_layernorm`) with `PackedDotProductAttention` as core attention, `GatedMLP` as a dense
    layer's MLP and `LocalNorm` for the norms; pass it to `GPTModel(transformer_layer_spec=...)`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from lightning_mcore_rl._compat import replace_dense_mlp
    from lightning_mcore_rl.models.layers.gated_mlp import GatedMLP
    from lightning_mcore_rl.models.layers.rms_norm import LocalNorm

    spec = get_gpt_layer_local_spec(**kwargs)
    attention = spec.submodules.self_attention.submodules
    # GatedMLP: megatron's `MLP` whose SwiGLU keeps only `linear_fc1`'s output for the backward;
    # LocalNorm: an RMSNorm whose backward keeps only its input (megatron's `WrappedTorchNorm` for a
    # LayerNorm)
    attention.core_attention = PackedDotProductAttention
    gated = replace_dense_mlp(spec.submodules.mlp, GatedMLP, GatedMLP.local_submodules())
    if gated is not None:  # a dense layer (a MoE layer keeps megatron's experts)
        spec.submodules.mlp = gated
    for owner, name in ((spec.submodules, "input_layernorm"),
                        (spec.submodules, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):  # fmt: skip
        if getattr(owner, name, None) is WrappedTorchNorm:  # megatron's, not Apex's fused norm
            setattr(owner, name, LocalNorm)
    return spec
