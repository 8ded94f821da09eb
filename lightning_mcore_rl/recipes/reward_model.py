"""A Bradley-Terry reward model: a megatron GPT (the tiny GPT or a Hugging Face checkpoint) whose LM
head is replaced by a scalar head, trained on chosen/rejected pairs with `PreferenceLossFn`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_mcore_rl.losses import PreferenceLossFn
from lightning_mcore_rl.recipes.common import (
    HFModelSpec,
    RecipeModel,
    RecipeModule,
    TinyGPTSpec,
    agree_on_batch,
    check_step_microbatches,
    unwrap,
)
from lightning_mcore_rl.recipes.dpo import check_pair_microbatching, check_preference_batch

if TYPE_CHECKING:
    from lightning_mcore_rl.data import BatchedDataDict
    from lightning_mcore_rl.train import LossPostProcessor


# The loss is -log sigmoid(s_chosen - s_rejected) averaged over the global batch's pairs, the
# score of a row the head's value at its last real token; accuracy is the fraction of pairs with
# s_chosen > s_rejected.


class ScalarHead(torch.nn.Module):
    """The reward head in place of ``GPTModel.output_layer``: ``values = h @ w^T``, ``w [1, H]``."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        # Replicated on the TP ranks, not sharded: h [S, B, H] is full on every TP rank without
        # sequence parallelism, so each computes the same values and gradient, and megatron
        # counts it once in the grad norm.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))

    def forward(
        self,
        hidden_states: Tensor,
        weight: Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[Tensor, None]:
        """``[S, B, H] -> ([S, B, 1], None)``; the LM head's other call arguments are unused."""
        # the head is never tied, so no output weight comes in
        return hidden_states @ self.weight.t(), None


def last_token_scores(
    logits: Tensor,
    data: BatchedDataDict,
    loss_fn: Any,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> tuple[dict[str, Tensor], BatchedDataDict]:
    """The reward model's loss input (a ``prepare_fn``): ``{"logits": [B]}``, each row's value
    ``[B, S, 1]`` at its last real token."""
    # rows are right-padded: the last real token is at input_lengths - 1
    lengths = torch.as_tensor(data["input_lengths"], device=logits.device).long()  # [B]
    rows = torch.arange(logits.shape[0], device=logits.device)
    return {"logits": logits[rows, lengths - 1, 0]}, data


class RewardModelModule(RecipeModule):
    """A Bradley-Terry reward model (a GPT with a scalar head) on `PreferenceDataModule` pairs.

    Args:
        model: the tiny GPT's size and seed, or a Hugging Face checkpoint (`HFModelSpec`).
        vocab_size: ``V`` of the data.
        max_sequence_length: the widest row ``S``.
        lr: Adam learning rate."""

    causal_lm = False
    """The LM head is the score head (:class:`ScalarHead`, ``[1, H]``): no causal-LM export
    (:class:`~lightning_mcore_rl.callbacks.HFExport` refuses the module)."""

    def __init__(
        self,
        model: TinyGPTSpec | HFModelSpec | None = None,
        vocab_size: int = 16,
        max_sequence_length: int = 16,
        lr: float = 1e-3,
    ) -> None:
        if model is not None and not isinstance(model, (TinyGPTSpec, HFModelSpec)):
            raise TypeError(
                "RewardModelModule builds the tiny GPT (`TinyGPTSpec`) or a Hugging Face "
                f"checkpoint (`HFModelSpec`), got {type(model).__name__}."
            )
        super().__init__(loss_fn=PreferenceLossFn())
        self.model_spec = replace(model) if model is not None else TinyGPTSpec()
        self.policy = RecipeModel(self.model_spec, vocab_size, max_sequence_length)
        self.lr = lr
        self.save_hyperparameters(
            {
                "model": asdict(self.model_spec),
                "vocab_size": vocab_size,
                "max_sequence_length": max_sequence_length,
                "lr": lr,
            }
        )

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        """The model's chunk; on the last stage its LM head replaced by a `ScalarHead`.

        Raises:
            ValueError: an HF checkpoint with tied embeddings under pipeline parallelism."""
        from lightning_mcore_rl.models.tiny_gpt import load_deterministic_weights

        chunk = self.policy.build_chunk(self, vp_stage)
        gpt: Any = unwrap(chunk)  # a megatron GPTModel
        # megatron would all-reduce the first stage's embedding gradient with the last stage's
        # head, which the score head replaced
        if gpt.share_embeddings_and_output_weights and not (gpt.pre_process and gpt.post_process):
            raise ValueError(
                "RewardModelModule: the HF checkpoint ties its input and output embeddings, "
                "which pipeline parallelism cannot split once the LM head is replaced by the "
                "score head; use pipeline_model_parallel_size=1 or an untied checkpoint."
            )
        if gpt.post_process:
            gpt.output_layer = ScalarHead(gpt.config.hidden_size, gpt.config.params_dtype)
            # The tiny GPT's head comes from the seed, as output_layer.weight; an HF model's LM
            # head is dropped and the head stays zero: every score 0, the loss ln 2 at step 0.
            if isinstance(self.model_spec, TinyGPTSpec):
                load_deterministic_weights(gpt, self.model_spec.seed, self.parallel_groups)
        return chunk

    def setup(self, stage: str) -> None:
        """Reject layouts the last-token score cannot follow and, when fitting, a
        ``micro_batch_size`` not dividing the rank's ``2 x pairs_per_step / DP`` rows."""
        # TP, PP and DP remain, with an even micro_batch_size
        strategy = self.mcore_strategy
        owner = type(self).__name__
        parallel = strategy.parallel
        # the score is read at a padded row's last real token; context parallelism needs packing
        if parallel.sequence_packing or parallel.sequence_parallel:
            raise ValueError(
                f"{owner} reads each padded row's last real token: `sequence_packing` and "
                "`sequence_parallel` must be False (so is context parallelism, which needs "
                "packing)."
            )
        # the same verdict on every rank, before any step
        batching = strategy.microbatching
        check_pair_microbatching(
            owner, batching.micro_batch_size, batching.max_tokens_per_microbatch
        )
        if stage == "fit":
            check_step_microbatches(self, "pairs_per_step", 2, "2 rows per chosen/rejected pair")

    def loss_post_processor(self, num_microbatches: int | None = None) -> LossPostProcessor:
        """The base hook's loss callback with `last_token_scores` as the input preparation."""
        from lightning_mcore_rl.train import LossPostProcessor

        loss_fn: Any = self.loss_fn  # the PreferenceLossFn of __init__
        strategy = self.mcore_strategy
        return LossPostProcessor(
            loss_fn, strategy.policy_config(), num_microbatches, prepare_fn=last_token_scores
        )

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Every rank agrees that each holds a well-formed interleaved preference batch."""
        owner, size = type(self).__name__, self.policy.max_sequence_length
        agree_on_batch(self, lambda: check_preference_batch(owner, batch, size))

    def training_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """One optimizer step of the Bradley-Terry loss over the global batch's pairs."""
        self.check_batch(batch)
        return self.forward_backward(batch).as_step_result()

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """Held-out loss and ``val_accuracy``, forward-only."""
        self.check_batch(batch)
        return self.forward_backward(batch, forward_only=True).as_step_result()
