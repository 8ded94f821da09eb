"""Direct Preference Optimization (arXiv:2305.18290 Eq. 7) against a frozen reference model, on
interleaved ``chosen_0, rejected_0, chosen_1, ...`` rows (``[2b, S]``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import DPOLossConfig, DPOLossFn
from lightning_mcore_rl.recipes.common import (
    DEFAULT_TASK,
    HFModelSpec,
    RecipeModel,
    RecipeModule,
    TinyGPTSpec,
    agree_on_batch,
    check_rows,
    check_step_microbatches,
    rank_train_loader,
    rank_val_loader,
)
from lightning_mcore_rl.recipes.toy_data import CountingPreferenceDataset, collate_pairs
from lightning_mcore_rl.rollout import ModularCountingTask
from lightning_mcore_rl.strategy import ResumableLoader

if TYPE_CHECKING:
    from lightning_mcore_rl.train import LossPostProcessor

PREFERENCE_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")
"""The batch keys of the preference recipes (rows interleave chosen/rejected)."""

DEFAULT_DPO_LOSS = DPOLossConfig()
"""``DPOModule``'s default loss: NeMo RL's DPO defaults (beta 0.05, no SFT term)."""


class PreferenceDataModule(LightningDataModule):
    """Chosen/rejected pairs of the counting task, ``pairs_per_step`` per step, interleaved rows.

    Args:
        task: the prompts' task (``V = task.vocab_size``, ``P = task.prompt_length``).
        max_new_tokens: ``N``, the longest response; rows are ``P + N`` wide.
        pairs_per_step: global pairs per optimizer step (divisible by DP).
        num_steps: steps' worth of distinct pairs (one epoch).
        seed: data seed, also the seed of the (per-epoch) shuffled order.
        val_pairs: held-out pairs (0: no validation loop), divisible by DP.
        val_seed: seed of the held-out pairs.
        chosen_demonstration: chosen responses are the SFT demonstrations (an easier task)."""

    def __init__(
        self,
        task: ModularCountingTask | None = DEFAULT_TASK,
        max_new_tokens: int = 8,
        pairs_per_step: int = 8,
        num_steps: int = 40,
        seed: int = 0,
        val_pairs: int = 0,
        val_seed: int = 1,
        chosen_demonstration: bool = False,
    ) -> None:
        super().__init__()
        self.chosen_demonstration = chosen_demonstration
        self.task = task or ModularCountingTask()
        self.max_new_tokens = max_new_tokens
        self.pairs_per_step = pairs_per_step
        self.num_steps = num_steps
        self.seed = seed
        self.val_pairs = val_pairs
        self.val_seed = val_seed

    def train_dataloader(self) -> ResumableLoader:
        """This rank's ``pairs_per_step / DP`` pairs per step, interleaved (resumable)."""
        dataset = self._dataset(self.pairs_per_step * self.num_steps, self.seed)
        return rank_train_loader(
            self.trainer, dataset, self.pairs_per_step, "pairs_per_step", self.seed, collate_pairs
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Held-out pairs (``val_pairs``; none when 0), split over data-parallel ranks."""
        if self.val_pairs == 0:
            return []
        dataset = self._dataset(self.val_pairs, self.val_seed)
        return rank_val_loader(
            self.trainer, dataset, self.pairs_per_step, "val_pairs", collate_pairs
        )

    def _dataset(self, num_pairs: int, seed: int) -> CountingPreferenceDataset:
        return CountingPreferenceDataset(
            self.task, num_pairs, self.max_new_tokens, seed, self.chosen_demonstration
        )


def check_preference_batch(owner: str, batch: Mapping[str, Any], max_sequence_length: int) -> None:
    """The host-side checks of an interleaved preference batch (before any collective).

    Raises:
        ValueError: a missing key, too wide rows, an odd row count, or unequal pair masks."""
    check_rows(owner, batch, PREFERENCE_KEYS, max_sequence_length)
    rows = int(batch["input_ids"].shape[0])
    if rows % 2:
        raise ValueError(
            f"{owner}: a preference batch interleaves chosen/rejected rows, so `input_ids` needs "
            f"an even number of rows; got {rows}."
        )
    # the loss pairs rows [::2] with [1::2]
    mask = batch["sample_mask"]
    unequal = mask[::2] != mask[1::2]
    if bool(unequal.any()):
        pair = int(unequal.nonzero()[0, 0])
        raise ValueError(
            f"{owner}: `sample_mask` must be equal within a pair; pair {pair} (rows {2 * pair}, "
            f"{2 * pair + 1}) has {float(mask[2 * pair])} / {float(mask[2 * pair + 1])}."
        )


def check_pair_microbatching(owner: str, micro_batch_size: int, token_budget: int | None) -> None:
    """Microbatches must hold whole chosen/rejected pairs.

    Raises:
        ValueError: a token budget (it regroups rows by length) or an odd ``micro_batch_size``."""
    # the loss splits each microbatch's rows [::2] / [1::2]
    if token_budget is not None:
        raise ValueError(
            f"{owner} needs microbatches of whole chosen/rejected pairs, but "
            f"`max_tokens_per_microbatch={token_budget}` regroups rows by length; use an even "
            "`micro_batch_size` instead."
        )
    if micro_batch_size % 2:
        raise ValueError(
            f"{owner} needs microbatches of whole chosen/rejected pairs: `micro_batch_size` must "
            f"be even, got {micro_batch_size}."
        )


def shift_left(logprobs: Tensor) -> Tensor:
    """Stored logprobs ``[B, S]`` (``lp[:, t] = log p(x_t | x_<t)``) in DPO's layout ``[B, S]``:
    ``out[:, t] = log p(x_{t+1} | x_<=t)``, the last column 0."""
    return logprobs.roll(-1, dims=1)


class DPOModule(RecipeModule):
    """DPO of a tiny GPT or an HF model against its initial weights, on `PREFERENCE_KEYS` batches.

    Args:
        model: a tiny GPT (`TinyGPTSpec`) or an HF checkpoint (`HFModelSpec`), its own reference.
        vocab_size: ``V`` of the data (the tiny GPT's vocabulary; an HF model's must cover it).
        max_sequence_length: the widest row ``S`` (the tiny GPT's positions).
        loss: ``DPOLossFn`` settings (NeMo RL keys): beta, the SFT term's weight, averaging flags.
        lr: Adam learning rate."""

    def __init__(
        self,
        model: TinyGPTSpec | HFModelSpec | None = None,
        vocab_size: int = 16,
        max_sequence_length: int = 16,
        loss: DPOLossConfig | None = DEFAULT_DPO_LOSS,
        lr: float = 1e-3,
    ) -> None:
        loss = loss or DEFAULT_DPO_LOSS
        super().__init__(loss_fn=DPOLossFn(loss))
        self.model_spec = replace(model) if model is not None else TinyGPTSpec()
        self.policy = RecipeModel(self.model_spec, vocab_size, max_sequence_length)
        self.lr = lr
        self.save_hyperparameters(
            {
                "model": asdict(self.model_spec),
                "vocab_size": vocab_size,
                "max_sequence_length": max_sequence_length,
                "loss": asdict(loss),
                "lr": lr,
            }
        )

    def setup(self, stage: str) -> None:
        """Reject microbatching that would split pairs or, when fitting, not divide the rank's
        ``2 x pairs_per_step / DP`` rows."""
        # the same verdict on every rank, before any step
        batching = self.mcore_strategy.microbatching
        check_pair_microbatching(
            type(self).__name__, batching.micro_batch_size, batching.max_tokens_per_microbatch
        )
        if stage == "fit":
            check_step_microbatches(self, "pairs_per_step", 2, "2 rows per chosen/rejected pair")

    def loss_post_processor(self, num_microbatches: int | None = None) -> LossPostProcessor:
        """The base hook's loss callback, with packed microbatches scored in one loss call."""
        from lightning_mcore_rl.train import LossPostProcessor

        loss_fn: Any = self.loss_fn  # the DPOLossFn of __init__ (the base types it loosely)
        strategy = self.mcore_strategy
        cfg = strategy.policy_config()
        # fuse_loss: the per-sequence wrapper would call the loss on single rows and split the
        # pairs of a packed microbatch
        return LossPostProcessor(
            loss_fn,
            replace(cfg, fuse_loss=cfg.sequence_packing),
            num_microbatches,
            sampling_params=self.sampling_params(),
            use_fused_linear_logprobs=strategy.use_fused_linear_logprobs,
        )

    @contextlib.contextmanager
    def reference_weights(self) -> Iterator[None]:
        """Temporarily give the model its initial weights (the frozen reference)."""
        # regenerated from the tiny GPT's seed or re-read from the HF checkpoint
        with self.policy.initial_weights(self.mcore_strategy.model_chunks, self.parallel_groups):
            yield

    def preference_batch(self, batch: Mapping[str, Any]) -> BatchedDataDict:
        """The checked batch plus ``reference_policy_logprobs [2b, S]`` (shifted left by one).

        Raises:
            ValueError: as `check_preference_batch`; a batch with ``reference_policy_logprobs``."""
        owner = type(self).__name__

        def check() -> None:
            check_preference_batch(owner, batch, self.policy.max_sequence_length)
            if "reference_policy_logprobs" in batch:
                raise ValueError(
                    f"{owner} computes `reference_policy_logprobs` from its frozen reference; "
                    "remove the key from the batch."
                )

        # checked on every rank: keys, whole pairs, pair-equal sample_mask
        agree_on_batch(self, check)
        data = BatchedDataDict(dict(batch))
        # forward-only, dropout off: at step 0, where the policy is the reference, every implicit
        # reward is 0 and the loss is exactly ln 2
        with self.reference_weights():
            reference = self.compute_logprobs(data)  # [2b, S], 0 at position 0
        # DPOLossFn reads them shifted left by one
        data["reference_policy_logprobs"] = shift_left(reference)
        return data

    def training_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """Reference logprobs, then one optimizer step of the DPO loss."""
        # DPOLossFn, optionally plus the SFT term on the chosen rows
        return self.forward_backward(self.preference_batch(batch)).as_step_result()

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """Held-out DPO loss and metrics (``val_loss``, ``val_accuracy``, ...), forward-only."""
        return self.forward_backward(
            self.preference_batch(batch), forward_only=True
        ).as_step_result()
