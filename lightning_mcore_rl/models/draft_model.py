"""An EAGLE-3-style draft model (Li et al. 2025, "EAGLE-3", §3) built from megatron-core layers."""

# Notation: `B` sequences, `S` tokens (`T` of a packed row, `B = 1`), `H` hidden, `V`
# vocabulary, `k` aux layers.

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from lightning_mcore_rl.megatron_defaults import local_spec_settings
from lightning_mcore_rl.models.layout import layout_groups
from lightning_mcore_rl.models.tiny_gpt import (
    full_parameter_value,
    full_shape,
    tensor_parallel_shard,
)

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from lightning_mcore_rl.parallel import ParallelGroups


# The draft reads the policy's hidden states at a few chosen decoder layers ("aux" layers,
# EAGLE-3's low/mid/high features) and the embedding of the next token. Every projection is
# megatron's tensor-parallel linear, so the draft runs under the policy's TP layout; it has no
# pipeline stages (it lives on the policy's last stage).
class EagleDraftModel(MegatronModule):
    """The EAGLE-3-style draft: aux hidden states + next-token embedding -> logits of token t + 2.

    Args:
        config: the draft's `TransformerConfig` (`eagle_draft_config`).
        vocab_size: `V`, divisible by TP.
        aux_layers: the policy's decoder layers (0-based global indices) whose outputs it reads.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, aux_layers: tuple[int, ...]):
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
        from megatron.core.transformer.spec_utils import build_module

        from lightning_mcore_rl.models.layers import get_packed_local_layer_spec

        super().__init__(config=config)
        hidden = config.hidden_size
        self.aux_layers = tuple(aux_layers)
        self.vocab_size = vocab_size
        init = config.init_method

        def linear(inputs: int, outputs: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                inputs, outputs, config=config, init_method=init, bias=False, gather_output=True
            )

        # the draft's own vocab-parallel table, not the policy's
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden, init_method=init,
                                                   config=config)  # fmt: skip
        self.fc = linear(len(self.aux_layers) * hidden, hidden)
        self.enorm = torch.nn.LayerNorm(hidden, eps=config.layernorm_epsilon)
        self.hnorm = torch.nn.LayerNorm(hidden, eps=config.layernorm_epsilon)
        self.eh_proj = linear(2 * hidden, hidden)
        # one causal self-attention layer over the draft's own sequence (packed-capable local spec)
        self.layer = build_module(get_packed_local_layer_spec(), config=config, layer_number=1)
        self.final_layernorm = torch.nn.LayerNorm(hidden, eps=config.layernorm_epsilon)
        # gathered: the draft loss needs full-vocabulary logits
        self.lm_head = linear(hidden, vocab_size)

    def forward(
        self,
        hidden_states: Tensor,
        next_input_ids: Tensor,
        attention_mask: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """Full-vocabulary draft logits `[B, S, V]` (token `t + 2` at position `t`) from the aux
        layers' outputs `[S, B, k H]` (`aux_layers` order, detached) and the next ids `y_{t+1}`
        `[B, S]` (0 past a sequence); `attention_mask` `[1, 1, S, S]`, `None` packed."""
        # EAGLE-3 §3: f_t = fc([h^{l_1}_t ; ... ; h^{l_k}_t]) ([S, B, k H] -> [S, B, H]),
        # x_t = eh_proj([enorm(E[y_{t+1}]) ; hnorm(f_t)]) ([S, B, 2 H] -> [S, B, H]),
        # z_t = lm_head(final_norm(layer(x)_t)) ([S, B, V]: token t + 2)
        embeds = self.embed_tokens(next_input_ids).transpose(0, 1)  # [B, S, H] -> [S, B, H]
        features, _ = self.fc(hidden_states)
        x = torch.cat([self.enorm(embeds), self.hnorm(features)], dim=-1)  # [S, B, 2H]
        x, _ = self.eh_proj(x)
        x, _ = self.layer(
            hidden_states=x, attention_mask=attention_mask, packed_seq_params=packed_seq_params
        )
        logits, _ = self.lm_head(self.final_layernorm(x))  # [S, B, V]
        return logits.transpose(0, 1).contiguous()


def eagle_draft_config(
    policy_config: TransformerConfig, groups: ParallelGroups | None = None, **overrides: Any
) -> TransformerConfig:
    """The draft's config: one layer of the policy's width, heads, precision and TP size."""
    # no pipeline, no CP, no sequence parallelism: the draft runs on the last stage over full
    # sequences; dropout off; `calculate_per_token_loss` like the policy's
    from megatron.core.transformer import TransformerConfig

    groups = layout_groups(groups)
    fields: dict[str, Any] = {
        "num_layers": 1,
        "hidden_size": policy_config.hidden_size,
        "num_attention_heads": policy_config.num_attention_heads,
        "ffn_hidden_size": policy_config.ffn_hidden_size,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": groups.tp_size,
        "params_dtype": policy_config.params_dtype,
        "pipeline_dtype": policy_config.params_dtype,
        "bf16": policy_config.bf16,
        "calculate_per_token_loss": policy_config.calculate_per_token_loss,
        **local_spec_settings(),
    }
    fields.update(overrides)
    return TransformerConfig(**fields)


def eagle_draft(
    policy_config: TransformerConfig,
    *,
    vocab_size: int,
    aux_layers: tuple[int, ...],
    groups: ParallelGroups | None = None,
    seed: int = 0,
    **config_overrides: Any,
) -> EagleDraftModel:
    """Build this rank's shard of the draft with layout-independent deterministic weights.

    Raises:
        ValueError: bad `aux_layers`, `vocab_size` not divisible by TP, or CP > 1.
    """
    # `**config_overrides`: other `TransformerConfig` fields (e.g. `ffn_hidden_size`)
    layers, groups = checked_draft_layout(policy_config, vocab_size, aux_layers, groups)
    config = eagle_draft_config(policy_config, groups, **config_overrides)
    draft = EagleDraftModel(config, vocab_size, layers)
    fill_draft_weights(draft, "draft", groups, seed)
    return draft


def checked_draft_layout(
    policy_config: TransformerConfig,
    vocab_size: int,
    aux_layers: tuple[int, ...],
    groups: ParallelGroups | None,
) -> tuple[tuple[int, ...], ParallelGroups]:
    """The sorted `aux_layers` and this rank's layout.

    Raises:
        ValueError: `aux_layers` empty, repeated or out of range, `vocab_size` not divisible by
            TP, or CP > 1.
    """
    layers = tuple(aux_layers)
    total = policy_config.num_layers
    if not layers or len(set(layers)) != len(layers) or not all(0 <= i < total for i in layers):
        raise ValueError(
            f"`aux_layers` must be distinct decoder-layer indices in [0, {total}) of the policy, "
            f"got {aux_layers!r}"
        )
    layout = layout_groups(groups)
    # the policy's config too: `groups` omitted under CP is the single-rank layout
    check_draft_context_parallel(max(layout.cp_size, policy_config.context_parallel_size))
    if vocab_size % layout.tp_size != 0:
        raise ValueError(f"`vocab_size` ({vocab_size}) must be divisible by TP ({layout.tp_size}).")
    return tuple(sorted(layers)), layout


def check_draft_context_parallel(cp_size: int) -> None:
    """Refuse a draft under context parallelism.

    Raises:
        ValueError: `cp_size > 1`, naming the size and the layouts that work.
    """
    # the draft attends over whole sequences (its config has no CP), so its attention cannot be
    # built on CP-sharded ranks; reads a size only, so every rank raises alike before any collective
    if cp_size > 1:
        raise ValueError(
            f"An EAGLE draft needs context_parallel_size=1 (it attends over whole sequences), "
            f"but this layout has context_parallel_size={cp_size}. Train the draft with "
            "context_parallel_size=1 (the same ranks as data or tensor parallelism, e.g. "
            "MCoreRLStrategy(context_parallel_size=1, tensor_model_parallel_size=...)), or "
            "return None from build_draft_model() under CP."
        )


@torch.no_grad()
def fill_draft_weights(
    draft: torch.nn.Module, prefix: str, groups: ParallelGroups, seed: int
) -> None:
    """Give every parameter its layout-independent value and keep this rank's TP shard."""
    # drawn by `prefix.name` like the tiny GPT's: the same full weights under any layout
    for name, param in draft.named_parameters():
        full = full_parameter_value(f"{prefix}.{name}", full_shape(param, groups.tp_size), seed)
        param.copy_(tensor_parallel_shard(full, param, groups.tp_rank, groups.tp_size))
