"""Multi-token prediction (MTP, DeepSeek-V3 §2.2) on a megatron `GPTModel` for RL training."""

# Notation: `B` sequences, `S` tokens (`T/CP` of a packed row), `H` hidden, `V/tp` the local
# vocabulary shard, `D = mtp_num_layers`.

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from torch import Tensor


# megatron-core 0.16's `GPTModel._postprocess` computes the MTP loss only from `labels` and then
# returns the main LM loss instead of logits, which an RL loss cannot use. Newer megatron derives
# the labels from `input_ids` when none are given (`process_mtp_loss`, Megatron-LM
# `megatron/core/transformer/multi_token_prediction.py` at d98e8a64dd); this class backports that:
# megatron's own MTP block and output layer, labels rolled from the input ids, the MTP loss
# attached to the main hidden states with `MTPLossAutoScaler`, and the logits returned.
class MTPGPTModel(GPTModel):
    """`GPTModel` whose multi-token-prediction layers train without `labels` (RL losses).

    Build it with `mtp_block_spec` (`get_gpt_mtp_block_spec`) and `config.mtp_num_layers` set.

    Attributes:
        mtp_losses: `[D]` detached `L_d` of the last labels-free forward (`None` before one).
    """

    # for the `mtp_loss` metric; the gradient flows through `MTPLossAutoScaler`, not this
    mtp_losses: Tensor | None = None

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        labels: Tensor | None,
        rotary_pos_emb: Any,
        rotary_pos_cos: Any,
        rotary_pos_sin: Any,
        mtp_in_postprocess: bool | None = None,
        loss_mask: Tensor | None = None,
        decoder_input: Tensor | None = None,
        attention_mask: Tensor | None = None,
        inference_params: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: Any = None,
        runtime_gather_output: bool | None = None,
        extra_block_kwargs: dict[str, Any] | None = None,
        inference_context: Any = None,
    ) -> Tensor:
        """The MTP block, then the labels-free MTP loss and the logits.

        `hidden_states` `[S, B, H]`, `input_ids` and `loss_mask` (`w`; `None`: all 1) `[B, S]`
        (packed: `[1, T/CP]`). Returns logits `[B, S, V/tp]` on the last stage (megatron's loss
        with `labels`), the hidden states `[S, B, H]` elsewhere.

        Raises:
            ValueError: a dynamic-batching inference context.
        """
        # with `labels` (megatron's LM path) megatron's own post-processing runs unchanged
        if labels is not None:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=mtp_in_postprocess,
                loss_mask=loss_mask, decoder_input=decoder_input, attention_mask=attention_mask,
                inference_params=inference_params, packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                runtime_gather_output=runtime_gather_output,
                extra_block_kwargs=extra_block_kwargs, inference_context=inference_context,
            )  # fmt: skip
        # KV-cache decoding (an inference context, eval mode) runs the main head only
        if inference_context is not None and not self.training:
            return self._inference_logits(hidden_states, inference_context, runtime_gather_output)
        if mtp_in_postprocess:
            hidden_states = self.mtp(
                input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                embedding=self.embedding, **(extra_block_kwargs or {}),
            )  # fmt: skip  # [(1 + D) S, B, H]
        if not self.post_process:
            return hidden_states
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()
        # the MTP loss rides on the main hidden states, so its gradient flows in the same backward
        hidden_states = self._attach_mtp_loss(
            hidden_states, input_ids, loss_mask, output_weight, packed_seq_params
        )
        logits, _ = self.output_layer(
            hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
        )
        return logits.transpose(0, 1).contiguous()  # [S, B, V/tp] -> [B, S, V/tp]

    def _inference_logits(
        self, hidden_states: Tensor, inference_context: Any, runtime_gather_output: bool | None
    ) -> Tensor:
        """KV-cache decoding with the main head only: logits `[B, S, V/tp]` (`[B, 1, V/tp]`
        for the last token only).

        Raises:
            ValueError: a dynamic-batching context.
        """
        # the MTP layers are a training signal only: decoding never runs them
        if not self.post_process:
            return hidden_states
        # last position only when the context asks for it, as megatron's static batching does
        if inference_context.materialize_only_last_token_logits:
            if not inference_context.is_static_batching():
                raise ValueError(
                    "MTPGPTModel decodes with megatron's static inference context only; got a "
                    f"dynamic-batching {type(inference_context).__name__}"
                )
            hidden_states = hidden_states[-1:, :, :]
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()
        logits, _ = self.output_layer(
            hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
        )
        return logits.transpose(0, 1).contiguous()

    def _attach_mtp_loss(
        self,
        hidden_states: Tensor,
        input_ids: Tensor,
        loss_mask: Tensor | None,
        output_weight: Tensor | None,
        packed_seq_params: Any,
    ) -> Tensor:
        """Split `[(1 + D) S, B, H]` into main + D depths, attach each depth's `L_d` to the main
        `[S, B, H]` and record them in `mtp_losses`."""
        # Depth `d` (0-based) at position `t` predicts token `t + d + 2` from the main hidden state
        # at `t` and the embeddings of tokens `t + 1 .. t + d + 1`. With `w` the `loss_mask` (the
        # forward step passes `token_mask * sample_mask / N_t`, N_t the global valid-token count
        # of the policy loss), `L_d = sum_t w[t + d + 2] * CE_d[t]`; positions past a sequence's
        # end score nothing. The backward adds `mtp_loss_scaling_factor / D * sum_d L_d`.
        from megatron.core.transformer.multi_token_prediction import (
            MTPLossAutoScaler,
            roll_tensor,
        )

        depths = int(self.config.mtp_num_layers)
        parts = torch.chunk(hidden_states, 1 + depths, dim=0)
        main = parts[0]

        def roll(tensor: Tensor) -> Tensor:  # left by one token, within each packed sequence
            rolled, _ = roll_tensor(
                tensor, shifts=-1, dims=-1, cp_group=self.cp_group,
                packed_seq_params=packed_seq_params,
            )  # fmt: skip
            return rolled

        labels = roll(input_ids)  # labels[t] = ids[t + 1]
        weights = roll(torch.ones_like(labels, dtype=torch.float32) if loss_mask is None
                       else loss_mask.float())  # fmt: skip
        scale = self.config.mtp_loss_scaling_factor / depths
        losses = []
        for depth in range(depths):
            logits, _ = self.output_layer(parts[depth + 1], weight=output_weight)
            labels, weights = roll(labels), roll(weights)  # ids[t + d + 2], w[t + d + 2]
            per_token = self.compute_language_model_loss(labels, logits)  # [B, S]
            loss = (weights * per_token.float()).sum()
            losses.append(loss.detach())
            # identity forward; in backward it adds the gradient of `scale * loss`
            main = MTPLossAutoScaler.apply(main, scale * loss)
        self.mtp_losses = torch.stack(losses)
        return main


def build_mtp_block_spec(config: Any, layer_spec: Any, vp_stage: int | None) -> Any:
    """megatron's MTP block spec for this stage (`None` off the last pipeline stage)."""
    # the MTP transformer layers reuse the decoder's layer spec (local, non-TE)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(
        config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage
    )
