"""GRPO on an embedded toy task: generate with the policy itself, score, train — one optimizer
step per Lightning batch of prompts.

Each ``training_step`` receives this data-parallel rank's prompts ``[b, P]`` and:

1. samples ``G`` completions per prompt with :func:`~lightning_mcore_rl.rollout.generate`
   (``generation_logprobs``);
2. scores them with the task and turns rewards into group-relative advantages;
3. recomputes the logprobs of the current weights forward-only (``prev_logprobs``; the PPO ratio
   uses them, the sampler's logprobs drive the importance-sampling metrics);
4. runs megatron's schedule with :class:`~lightning_mcore_rl.losses.ClippedPGLossFn` — the loss is
   a global token mean whatever the TP/PP/DP layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from torchmetrics.aggregation import MeanMetric

from lightning_mcore_rl.algorithms import grpo_advantages, token_level_advantages
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossConfig, ClippedPGLossFn
from lightning_mcore_rl.module import MCoreRLModule
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.recipes.common import (
    DEFAULT_TASK,
    HFModelSpec,
    RecipeModel,
    TinyGPTSpec,
    rank_train_loader,
    rank_val_loader,
)
from lightning_mcore_rl.recipes.evaluation import RolloutEvaluation
from lightning_mcore_rl.rollout import ModularCountingTask, generate
from lightning_mcore_rl.strategy import ResumableLoader

if TYPE_CHECKING:
    from lightning_mcore_rl.models import HFBridge


@dataclass
class RolloutSpec:
    """How completions are sampled.

    Attributes:
        group_size: ``G`` completions per prompt.
        max_new_tokens: completion length.
        temperature: sampling temperature (the loss uses the same one).
        seed: base seed; each step and data-parallel rank derives its own stream.
    """

    group_size: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    seed: int = 1234


DEFAULT_MODEL = TinyGPTSpec()
"""``GRPOModule``'s default policy size (each module copies it)."""

DEFAULT_ROLLOUT = RolloutSpec()
"""``GRPOModule``'s default sampling settings (each module copies it)."""

DEFAULT_GRPO_LOSS = ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
"""``GRPOModule``'s default loss: NeMo RL's clipped PG defaults without the reference KL."""


class PromptDataset(Dataset):
    """``num_prompts`` fixed random prompts of a task (map-style, so a ``DistributedSampler``
    splits them over data-parallel ranks)."""

    def __init__(self, task: ModularCountingTask, num_prompts: int, seed: int = 0) -> None:
        self.prompts = task.prompts(num_prompts, torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.prompts[index]


class PromptDataModule(LightningDataModule):
    """Prompts for GRPO: ``prompts_per_step`` prompts per optimizer step over all data-parallel
    ranks (each rank's loader yields its ``prompts_per_step / DP`` share).

    Args:
        task: the task that makes the prompts.
        prompts_per_step: global prompts per optimizer step (divisible by DP).
        num_steps: how many steps' worth of distinct prompts to make (one epoch).
        seed: prompt seed, also the seed of their (per-epoch) shuffled order.
        val_prompts: held-out prompts for validation (0: no validation loop), split over DP
            (divisible by DP) in batches of ``prompts_per_step / DP``.
        val_seed: seed of the held-out prompts.
    """

    def __init__(
        self,
        task: ModularCountingTask | None = DEFAULT_TASK,
        prompts_per_step: int = 16,
        num_steps: int = 150,
        seed: int = 0,
        val_prompts: int = 0,
        val_seed: int = 1,
    ) -> None:
        super().__init__()
        self.task = task or ModularCountingTask()
        self.prompts_per_step = prompts_per_step
        self.num_steps = num_steps
        self.seed = seed
        self.val_prompts = val_prompts
        self.val_seed = val_seed

    def train_dataloader(self) -> ResumableLoader:
        """Per-rank batches of ``prompts_per_step / DP`` prompts ``[b, P]``: each data-parallel
        rank reads its own prompts, shuffled with a fixed seed (re-permuted per epoch). The loader
        is a :class:`~lightning_mcore_rl.strategy.ResumableLoader`, so ``fit(ckpt_path=...)``
        mid-epoch continues with the next unseen batch."""
        dataset = PromptDataset(self.task, self.prompts_per_step * self.num_steps, self.seed)
        return rank_train_loader(
            self.trainer, dataset, self.prompts_per_step, "prompts_per_step", self.seed
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Held-out prompts ``[b, P]`` (``val_prompts``; none when 0). Lightning gives each
        data-parallel rank its share (a ``DistributedSampler`` over the DP group, no shuffling)."""
        if self.val_prompts == 0:
            return []
        dataset = PromptDataset(self.task, self.val_prompts, self.val_seed)
        return rank_val_loader(self.trainer, dataset, self.prompts_per_step, "val_prompts")


class GRPOModule(MCoreRLModule):
    """Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) of a tiny GPT.

    Args:
        task: the rewarded task.
        model: the policy: a tiny GPT (:class:`TinyGPTSpec`) or a Hugging Face checkpoint
            (:class:`HFModelSpec`, imported with :class:`~lightning_mcore_rl.models.HFBridge`).
        rollout: sampling settings.
        loss: ``ClippedPGLossFn`` settings (NeMo RL keys), e.g. clip ratios; default
            :data:`DEFAULT_GRPO_LOSS` (NeMo RL's defaults without the reference KL). With
            ``reference_policy_kl_penalty > 0`` the reference policy is the initial model: its
            logprobs are computed each step by temporarily loading the initial weights again
            (regenerated from the tiny GPT's seed, or re-read from the HF checkpoint).
        lr: Adam learning rate.
        pass_at_k: the ``k`` of the validation's ``val_pass@k`` (each ``<= group_size``: the
            validation samples ``group_size`` completions per held-out prompt; a completion is
            correct when its reward is 1).
    """

    def __init__(
        self,
        task: ModularCountingTask | None = DEFAULT_TASK,
        model: TinyGPTSpec | HFModelSpec | None = DEFAULT_MODEL,
        rollout: RolloutSpec | None = DEFAULT_ROLLOUT,
        loss: ClippedPGLossConfig | None = DEFAULT_GRPO_LOSS,
        lr: float = 5e-3,
        pass_at_k: tuple[int, ...] = (1,),
    ) -> None:
        loss = loss or DEFAULT_GRPO_LOSS
        if loss.use_kl_in_reward:
            raise ValueError(
                "GRPOModule applies the reference KL in the loss; `use_kl_in_reward=True` is "
                "not supported by this recipe."
            )
        # the mutable spec defaults are shared instances: each module keeps its own copy
        rollout = replace(rollout) if rollout is not None else RolloutSpec()
        super().__init__(
            loss_fn=ClippedPGLossFn(loss),
            sampling_params=TrainingSamplingParams(temperature=rollout.temperature),
        )
        self.kl_penalty = loss.reference_policy_kl_penalty
        self.task = task or ModularCountingTask()
        self.model_spec = replace(model) if model is not None else TinyGPTSpec()
        self.rollout = rollout
        self.policy = RecipeModel(
            self.model_spec,
            self.task.vocab_size,
            self.task.prompt_length + rollout.max_new_tokens,
            "prompt_length + max_new_tokens",
        )
        self.lr = lr
        self.pass_at_k = tuple(pass_at_k)
        self.evaluation: RolloutEvaluation | None = None
        self.rollout_reward: MeanMetric | None = None
        self.save_hyperparameters(
            {
                "task": asdict(self.task),
                "model": asdict(self.model_spec),
                "rollout": asdict(self.rollout),
                "lr": lr,
            }
        )

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        """The policy chunk for ``vp_stage``, built from the strategy's config: the tiny GPT
        (layout-invariant deterministic weights) or the HF checkpoint's shards."""
        return self.policy.build_chunk(self, vp_stage)

    def hf_bridge(self) -> HFBridge:
        """The :class:`~lightning_mcore_rl.models.HFBridge` of an :class:`HFModelSpec` policy,
        checked against the task (``ValueError``: vocabulary or positions too small)."""
        return self.policy.hf_bridge()

    def configure_optimizers(self) -> Any:
        """Megatron Adam at ``lr`` (clipping comes from ``Trainer(gradient_clip_val=...)``)."""
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=self.lr, weight_decay=0.0)

    # The base step takes Mapping batches; this recipe's loader yields prompt tensors and the
    # step is replaced whole (Lightning hooks take whatever the dataloader yields).
    def training_step(  # type: ignore[override]
        self, batch: torch.Tensor, batch_idx: int = 0
    ) -> torch.Tensor:
        """Rollout, score, advantages, ``prev_logprobs``, one policy-gradient step.

        Args:
            batch: ``[b, P]`` prompts of this data-parallel rank.
        """
        data, rewards = self.make_rollout(batch)
        data["prev_logprobs"] = self.compute_logprobs(data)
        if self.kl_penalty > 0:
            with self.reference_weights():
                data["reference_policy_logprobs"] = self.compute_logprobs(data)
        out = self.forward_backward(data)
        assert self.rollout_reward is not None  # built in setup()
        self.rollout_reward(rewards)  # this step's mean over all data-parallel ranks
        self.log("reward", self.rollout_reward, on_step=True, on_epoch=False, prog_bar=True)
        return out.loss

    @contextlib.contextmanager
    def reference_weights(self) -> Iterator[None]:
        """Temporarily give the model its initial weights (the reference policy; regenerated
        from the seed or re-read from the checkpoint, see
        :meth:`~lightning_mcore_rl.recipes.common.RecipeModel.initial_weights`); the current
        weights are restored on exit, also on error."""
        with self.policy.initial_weights(self.mcore_strategy.model_chunks):
            yield

    def setup(self, stage: str) -> None:
        """The rollout reward and validation metrics (torchmetrics over the data-parallel group,
        known once the strategy has built megatron's groups, which happens before this hook)."""
        group, device = self.mcore_strategy.groups.dp_group, self.mcore_strategy.root_device
        if self.evaluation is None:
            self.evaluation = RolloutEvaluation(self.pass_at_k, self.rollout.group_size, group).to(
                device
            )
        if self.rollout_reward is None:
            self.rollout_reward = MeanMetric(process_group=group, dist_sync_on_step=True).to(device)

    @torch.no_grad()
    def validation_step(  # type: ignore[override]
        self, batch: torch.Tensor, batch_idx: int = 0
    ) -> dict[str, torch.Tensor]:
        """Sample ``G`` completions per held-out prompt and score them (no training).

        Returns:
            This rank's ``rewards``, ``correct``, ``lengths`` and ``truncated`` ``[b*G]``.
        """
        assert self.evaluation is not None  # built in setup()
        seed = self.rollout.seed + 7_000_003 * (batch_idx + 1) + self.mcore_strategy.groups.dp_rank
        out, rewards = self._sample(batch, torch.Generator().manual_seed(seed))
        lengths = out.completion_mask.sum(dim=1)
        scores = {
            "rewards": rewards,
            "correct": rewards >= 1.0,
            "lengths": lengths,
            "truncated": lengths >= self.rollout.max_new_tokens,
        }
        self.evaluation.update(**scores)
        self.evaluation.log(self)
        return scores

    def _sample(
        self, prompts: torch.Tensor, generator: torch.Generator
    ) -> tuple[Any, torch.Tensor]:
        """``G`` completions per prompt (group-major ``[b*G, P+N]``) and their rewards."""
        spec = self.rollout
        out = generate(
            self.mcore_strategy.model_chunks[0],
            prompts.repeat_interleave(spec.group_size, dim=0),  # group-major [b*G, P]
            max_new_tokens=spec.max_new_tokens,
            generator=generator,
            temperature=spec.temperature,
            tp_group=self.mcore_strategy.groups.tp_group,
        )
        return out, self.task.rewards(out.tokens, out.completion_mask)

    @torch.no_grad()
    def make_rollout(self, prompts: torch.Tensor) -> tuple[BatchedDataDict, torch.Tensor]:
        """Sample ``G`` completions per prompt and build the GRPO batch.

        Returns:
            ``(batch, rewards [b*G])`` with ``input_ids/generation_logprobs/token_mask/advantages
            [b*G, P+N]``, ``input_lengths``, ``sample_mask``.
        """
        spec = self.rollout
        generator = torch.Generator().manual_seed(
            spec.seed + 1_000_003 * self.global_step + self.mcore_strategy.groups.dp_rank
        )
        out, rewards = self._sample(prompts, generator)
        token_mask = out.completion_mask.float()
        batch = BatchedDataDict(
            input_ids=out.tokens,
            input_lengths=torch.full((out.tokens.shape[0],), out.tokens.shape[1]),
            token_mask=token_mask,
            sample_mask=torch.ones(out.tokens.shape[0]),
            advantages=token_level_advantages(
                grpo_advantages(rewards, spec.group_size), token_mask
            ),
            generation_logprobs=out.logprobs,
        )
        return batch, rewards
