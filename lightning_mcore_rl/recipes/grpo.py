"""GRPO: generate with the policy, score, train; one optimizer step per Lightning batch of
prompts, on the embedded counting task or a text task (`TextRewardTask`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from torchmetrics.aggregation import MeanMetric

from lightning_mcore_rl.algorithms import (
    grpo_advantages,
    reinforce_plus_plus_advantages,
    token_level_advantages,
)
from lightning_mcore_rl.algorithms.advantages import nonfinite_reward_groups
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossConfig, ClippedPGLossFn, calculate_kl
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.recipes.common import (
    DEFAULT_TASK,
    HFModelSpec,
    RecipeModel,
    RecipeModule,
    TinyGPTSpec,
    check_step_microbatches,
    rank_train_loader,
    rank_val_loader,
)
from lightning_mcore_rl.recipes.evaluation import RolloutEvaluation
from lightning_mcore_rl.recipes.prompt_data import PromptBatch
from lightning_mcore_rl.recipes.rollout_choice import (
    Generate,
    recipe_rollout,
    rollout_generate,
    rollout_submit,
    spec_hparams,
)
from lightning_mcore_rl.recipes.rollout_queue import RolloutQueue
from lightning_mcore_rl.recipes.text_task import TextRewardTask
from lightning_mcore_rl.reliability.nonfinite import NonFiniteWarning
from lightning_mcore_rl.rollout import (
    ModularCountingTask,
    Rollout,
    RolloutChoice,
    SamplingConfig,
    SubmittedRollout,
    mismatch_extrema,
)
from lightning_mcore_rl.strategy import ResumableLoader
from lightning_mcore_rl.train.validation import loss_input_keys

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lightning_mcore_rl.models import HFBridge

Task = ModularCountingTask | TextRewardTask
"""What a GRPO module is rewarded on: the embedded counting task (``[b, P]`` prompt tensors) or a
text task (:class:`~.prompt_data.PromptBatch` prompts and a reward function)."""


@dataclass
class RolloutSpec:
    """How completions are sampled.

    Attributes:
        group_size: ``G`` completions per prompt.
        max_new_tokens: completion length.
        temperature: sampling temperature (the loss uses the same one).
        top_k: sample from the ``top_k`` largest scaled logits only (``None``: all).
        top_p: then from the smallest top set reaching probability ``top_p`` (``1.0``: all).
        seed: base seed; each step and data-parallel rank derives its own stream.
        backend: ``"megatron"``, ``"hf"``, ``"vllm"``, a `RolloutSource` or a factory of one.
        stop_at_eos: with a text task, a completion ends at the tokenizer's EOS token.
        max_staleness: asynchronous GRPO: rollouts submitted this many batches ahead (0: sync)."""

    group_size: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    seed: int = 1234
    backend: RolloutChoice = "megatron"
    stop_at_eos: bool = True
    max_staleness: int = 0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"`max_staleness` must be >= 0, got {self.max_staleness}")
        params = self.training_params()  # checks temperature, top_k and top_p
        # a token sampled by older weights may lie outside the current weights' filtered set,
        # where its logprob is -inf and the ratio undefined
        if self.max_staleness and params.filters:
            raise ValueError(
                f"`max_staleness={self.max_staleness}` cannot be combined with `top_k="
                f"{self.top_k}` / `top_p={self.top_p}`: a token sampled by older weights may lie "
                "outside the current weights' filtered set, where its logprob is -inf and the "
                "loss's ratio undefined; sample without filters, or synchronously."
            )

    def training_params(self) -> TrainingSamplingParams:
        """The trainer's sampling parameters, the sampler's (temperature, top-k, top-p)."""
        # the loss's logprobs use the same filters as the draw (vLLM's, in its order)
        return TrainingSamplingParams(self.temperature, self.top_k, self.top_p)

    def check_synchronous(self, owner: str) -> None:
        """``ValueError`` naming ``owner`` unless this spec samples synchronously, unfiltered."""
        if self.training_params().filters:
            raise ValueError(
                f"{owner} samples without top-k/top-p: `rollout.top_k` must be None and "
                f"`rollout.top_p` 1.0, got {self.top_k} and {self.top_p}."
            )
        if self.max_staleness != 0:
            raise ValueError(
                f"{owner} samples synchronously: `rollout.max_staleness` must be 0, got "
                f"{self.max_staleness} (asynchronous rollouts are GRPOModule's)."
            )


DEFAULT_MODEL = TinyGPTSpec()
"""``GRPOModule``'s default policy size (each module copies it)."""

DEFAULT_ROLLOUT = RolloutSpec()
"""``GRPOModule``'s default sampling settings (each module copies it)."""

DEFAULT_GRPO_LOSS = ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
"""``GRPOModule``'s default loss: NeMo RL's clipped PG defaults without the reference KL."""

AdvantageEstimator = Literal["grpo", "reinforce_plus_plus"]
"""NeMo RL's ``adv_estimator.name`` values the recipe supports (RLOO is ``"grpo"`` with
``use_leave_one_out_baseline=True``, ``normalize_rewards=False``, as in NeMo RL)."""

ReferenceModel = Literal["recompute", "frozen_copy"]
"""Where the reference policy's logprobs come from (see :class:`GRPOModule`)."""

PrevLogprobsPass = Literal["auto", "always"]
"""``"auto"``: no forward-only ``prev_logprobs`` pass where `prev_logprobs_skippable` holds;
``"always"``: the pass every step."""

MISMATCH_METRICS = ("gen_train_ratio_min", "gen_train_ratio_max")
"""The sampler/trainer mismatch extremes the step logs (`mismatch_extrema`)."""


def prev_logprobs_skippable(loss: ClippedPGLossConfig, rollout: RolloutSpec) -> bool:
    """Whether a GRPO step can take ``prev_logprobs`` from its training forward (detached):
    synchronous sampling, and a loss that reads them only as the PPO ratio's denominator."""
    # GRPOModule trains each rollout batch with one optimizer step by the weights that sampled
    # it, and recipe policies have no dropout: the forward-only pass would compute c itself, so
    # the ratio exp(c - sg(c)) is exactly 1 either way (`force_on_policy_ratio`). Kept: async
    # (max_staleness > 0), the importance-sampling correction, the KL in the reward (the
    # advantages read p), GSPO (exp(mean(c - p)) has another gradient than a token ratio of 1),
    # REINFORCE and CISPO (their losses are not the ratio-1 one).
    return not (
        rollout.max_staleness
        or loss.use_importance_sampling_correction
        or loss.use_kl_in_reward
        or loss.sequence_level_importance_ratios
        or loss.disable_ppo_ratio
        or loss.use_cispo
    )


class PromptDataset(Dataset):
    """``num_prompts`` fixed random prompts of a task (map-style)."""

    # map-style, so a DistributedSampler splits it over the DP ranks
    def __init__(self, task: ModularCountingTask, num_prompts: int, seed: int = 0) -> None:
        self.prompts = task.prompts(num_prompts, torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.prompts[index]


class PromptDataModule(LightningDataModule):
    """Prompts for GRPO: ``prompts_per_step`` per optimizer step over all data-parallel ranks.

    Args:
        task: the task that makes the prompts.
        prompts_per_step: global prompts per optimizer step (divisible by DP).
        num_steps: how many steps' worth of distinct prompts to make (one epoch).
        seed: prompt seed, also the seed of their (per-epoch) shuffled order.
        val_prompts: held-out prompts for validation (0: none), divisible by DP.
        val_seed: seed of the held-out prompts."""

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
        for name, value in (("prompts_per_step", prompts_per_step), ("num_steps", num_steps)):
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}")
        self.task = task or ModularCountingTask()
        self.prompts_per_step = prompts_per_step
        self.num_steps = num_steps
        self.seed = seed
        self.val_prompts = val_prompts
        self.val_seed = val_seed

    def train_dataloader(self) -> ResumableLoader:
        """This rank's batches of ``prompts_per_step / DP`` prompts ``[b, P]`` (shuffled)."""
        # a ResumableLoader: fit(ckpt_path=...) mid-epoch continues with the next unseen batch
        dataset = PromptDataset(self.task, self.prompts_per_step * self.num_steps, self.seed)
        return rank_train_loader(
            self.trainer, dataset, self.prompts_per_step, "prompts_per_step", self.seed
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """This rank's share of the held-out prompts ``[b, P]`` (none when ``val_prompts`` is 0)."""
        if self.val_prompts == 0:
            return []
        # a DistributedSampler over the DP group, no shuffling; batches of prompts_per_step / DP
        dataset = PromptDataset(self.task, self.val_prompts, self.val_seed)
        return rank_val_loader(self.trainer, dataset, self.prompts_per_step, "val_prompts")


class GRPOModule(RecipeModule):
    """Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300).

    Args:
        task: the counting task (`PromptDataModule`) or a `TextRewardTask` (`PromptFileDataModule`).
        model: the policy: a tiny GPT (`TinyGPTSpec`) or a Hugging Face checkpoint (`HFModelSpec`).
        rollout: sampling settings.
        loss: ``ClippedPGLossFn`` settings (NeMo RL keys); default: no reference KL.
        lr: Adam learning rate.
        pass_at_k: the ``k`` of the validation's ``val_pass@k`` (each ``<= group_size``).
        advantage_estimator: ``"grpo"`` (group-relative) or ``"reinforce_plus_plus"``.
        normalize_rewards: ``"grpo"``: divide by the group's standard deviation.
        use_leave_one_out_baseline: ``"grpo"``: RLOO's baseline (arXiv:2402.14740).
        minus_baseline: ``"reinforce_plus_plus"``: subtract the group mean first.
        reference_model: ``"recompute"`` (swap the initial weights in) or ``"frozen_copy"``.
        prev_logprobs_pass: ``"auto"`` skips the forward-only ``prev_logprobs`` pass where it
            cannot change the step (`prev_logprobs_skippable`); ``"always"`` runs it."""

    def __init__(
        self,
        task: ModularCountingTask | TextRewardTask | None = DEFAULT_TASK,
        model: TinyGPTSpec | HFModelSpec | None = DEFAULT_MODEL,
        rollout: RolloutSpec | None = DEFAULT_ROLLOUT,
        loss: ClippedPGLossConfig | None = DEFAULT_GRPO_LOSS,
        lr: float = 5e-3,
        pass_at_k: tuple[int, ...] = (1,),
        advantage_estimator: AdvantageEstimator = "grpo",
        normalize_rewards: bool = True,
        use_leave_one_out_baseline: bool = False,
        minus_baseline: bool = True,
        reference_model: ReferenceModel = "recompute",
        prev_logprobs_pass: PrevLogprobsPass = "auto",
    ) -> None:
        loss = loss or DEFAULT_GRPO_LOSS
        _check_choice("advantage_estimator", advantage_estimator, ("grpo", "reinforce_plus_plus"))
        _check_choice("reference_model", reference_model, ("recompute", "frozen_copy"))
        _check_choice("prev_logprobs_pass", prev_logprobs_pass, ("auto", "always"))
        self._check_kl_in_reward(loss, advantage_estimator)
        # the mutable spec defaults are shared instances: each module keeps its own copy
        rollout = replace(rollout) if rollout is not None else RolloutSpec()
        skip = prev_logprobs_pass == "auto" and prev_logprobs_skippable(loss, rollout)
        super().__init__(
            # ratio 1 from the training forward: the loss no longer reads prev_logprobs
            loss_fn=ClippedPGLossFn(replace(loss, force_on_policy_ratio=True) if skip else loss),
            sampling_params=rollout.training_params(),
        )
        self.kl_penalty = loss.reference_policy_kl_penalty
        self.loss_config = loss
        self.advantage_estimator = advantage_estimator
        self.normalize_rewards = normalize_rewards
        self.use_leave_one_out_baseline = use_leave_one_out_baseline
        self.minus_baseline = minus_baseline
        self.reference_model = reference_model
        self.prev_logprobs_pass = prev_logprobs_pass
        self.task: Task = task or ModularCountingTask()
        self.model_spec = replace(model) if model is not None else TinyGPTSpec()
        self.rollout = rollout
        self.tokenizer = self._text_tokenizer()
        self.policy = self._recipe_model()
        self.rollout_source = recipe_rollout(rollout.backend, self.policy)
        self.rollout_queue = RolloutQueue(rollout.max_staleness)
        self.lr = lr
        # validation samples group_size completions per held-out prompt; reward 1 is correct
        self.pass_at_k = tuple(pass_at_k)
        self.evaluation: RolloutEvaluation | None = None
        self.rollout_reward: MeanMetric | None = None
        self.save_hyperparameters(
            {
                "task": (
                    self.task.describe()
                    if isinstance(self.task, TextRewardTask)
                    else asdict(self.task)
                ),
                "model": asdict(self.model_spec),
                "rollout": spec_hparams(self.rollout),
                "lr": lr,
                "advantage_estimator": advantage_estimator,
                "reference_model": reference_model,
                "prev_logprobs_pass": prev_logprobs_pass,
            }
        )

    def _text_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """A text task's tokenizer: the `HFModelSpec` policy's (``None`` for the counting task).

        Raises:
            ValueError: a text task with a policy that is not a Hugging Face checkpoint."""
        if not isinstance(self.task, TextRewardTask):
            return None
        if not isinstance(self.model_spec, HFModelSpec):
            raise ValueError(
                "A TextRewardTask decodes completions with the policy's tokenizer and needs an "
                f"HFModelSpec model, got {type(self.model_spec).__name__}."
            )
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_spec.path)

    def _recipe_model(self) -> RecipeModel:
        """The policy, sized by the task's vocabulary and prompt plus completion length."""
        new_tokens = self.rollout.max_new_tokens
        if isinstance(self.task, TextRewardTask):
            assert self.tokenizer is not None  # set for text tasks
            return RecipeModel(
                self.model_spec,
                len(self.tokenizer),
                self.task.max_prompt_length + new_tokens,
                "max_prompt_length + max_new_tokens",
            )
        return RecipeModel(
            self.model_spec,
            self.task.vocab_size,
            self.task.prompt_length + new_tokens,
            "prompt_length + max_new_tokens",
        )

    def _check_kl_in_reward(self, loss: ClippedPGLossConfig, estimator: str) -> None:
        """``use_kl_in_reward`` only with an estimator that puts the KL into the reward."""
        if loss.use_kl_in_reward and estimator != "reinforce_plus_plus":
            raise ValueError(
                f"`use_kl_in_reward=True` is not supported by advantage_estimator="
                f"{estimator!r}: only 'reinforce_plus_plus' folds the KL into the reward "
                "(NeMo RL's GRPO estimator ignores it, so the KL would vanish)."
            )

    def _needs_prev_logprobs(self) -> bool:
        """Whether this step runs the forward-only ``prev_logprobs`` pass (the loss or the
        advantages read them)."""
        # PPOModule's loss keeps them
        reads = "prev_logprobs" in loss_input_keys(self.loss_fn)
        return self.prev_logprobs_pass == "always" or reads or self._advantages_need_logprobs()

    def _advantages_need_logprobs(self) -> bool:
        """Whether the advantages wait for the step's logprobs (`training_step` fills them)."""
        return bool(self.loss_config.use_kl_in_reward)

    def build_teacher_chunk(self, vp_stage: int | None) -> torch.nn.Module | None:
        """A frozen copy of the initial policy for ``reference_model="frozen_copy"``, else none."""
        # one more set of weights in memory, for no weight swap or checkpoint read per step
        # none without a reference KL either
        if self.reference_model != "frozen_copy" or self.kl_penalty == 0:
            return None
        return self.policy.build_chunk(self, vp_stage)

    def hf_bridge(self) -> HFBridge:
        """The `HFBridge` of an `HFModelSpec` policy (``ValueError``: too small for the task)."""
        return self.policy.hf_bridge()

    # The base step takes Mapping batches; this recipe's loader yields prompt tensors and the
    # step is replaced whole (Lightning hooks take whatever the dataloader yields).
    def training_step(  # type: ignore[override]
        self, batch: torch.Tensor | PromptBatch, batch_idx: int = 0
    ) -> dict[str, Any]:
        """Rollout, score, advantages, ``prev_logprobs``, one policy-gradient step on this rank's
        ``b`` prompts (``[b, P]`` ids, or a `PromptBatch` for a text task)."""
        # G completions per prompt from the rollout source (`recipe_rollout`), scored by the
        # task (a text task decodes them), rewards turned into advantages
        data, rewards = self.make_rollout(batch)
        prev_pass = self._needs_prev_logprobs()
        if prev_pass:
            # the current weights' logprobs, forward-only: the PPO ratio uses them, the
            # sampler's generation_logprobs drive the importance-sampling metrics
            data["prev_logprobs"] = self.compute_logprobs(data)
            mismatch = mismatch_extrema(data, self.mcore_strategy.groups.dp_group)
            self.log_dict(mismatch, on_step=True, on_epoch=False, batch_size=1)
        if self.kl_penalty > 0:
            # the reference policy is the initial model (swapped back in, or a hosted copy)
            data["reference_policy_logprobs"] = self.reference_logprobs(data)
        if self._advantages_need_logprobs():
            data["advantages"] = self.advantages(rewards, data)
        # ClippedPGLossFn: a global token mean whatever the TP/PP/DP layout
        out = self.forward_backward(data)
        if not prev_pass:
            # the loss measured the mismatch extremes in the training forward (MIN/MAX over all
            # ranks); logged under the pass's names, not twice. A step the non-finite policy
            # skipped ran no loss: nothing to log (the same on every rank)
            mismatch = {k: out.metrics.pop(k) for k in MISMATCH_METRICS if k in out.metrics}
            self.log_dict(mismatch, on_step=True, on_epoch=False, batch_size=1)
        assert self.rollout_reward is not None  # built in setup()
        self.rollout_reward(rewards)  # this step's mean over all data-parallel ranks
        self.log("reward", self.rollout_reward, on_step=True, on_epoch=False, prog_bar=True)
        return out.as_step_result()

    def reference_logprobs(self, batch: BatchedDataDict) -> torch.Tensor:
        """The reference policy's token logprobs ``[B, S]`` of this rank's batch."""
        if self.reference_model == "frozen_copy":
            return self.compute_logprobs(batch, teacher=True)
        with self.reference_weights():
            return self.compute_logprobs(batch)

    def advantages(self, rewards: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        """Token advantages ``[b*G, S]`` of the ``advantage_estimator`` from ``rewards [b*G]`` and
        the batch's ``token_mask`` (with ``use_kl_in_reward`` also its logprobs); NaN for a group
        with a NaN/inf reward."""
        # A NaN/inf reward's group counts as 0 in the estimator (the other groups' advantages are
        # unchanged) and gets NaN advantages: the step's input agreement then skips the step on
        # every rank, as the non-finite policy does for any non-finite input.
        bad = nonfinite_reward_groups(rewards, self.rollout.group_size)  # [b*G]
        if not bool(bad.any()):
            return self._advantages(rewards, batch)
        where = (~torch.isfinite(rewards)).nonzero()[:, 0].tolist()
        warnings.warn(
            f"Non-finite rewards on this rank: completions {where} = "
            f"{rewards[where].tolist()}; the advantages of their groups (completions "
            f"{bad.nonzero()[:, 0].tolist()}) are NaN, so the non-finite policy skips this step "
            "on every rank.",
            NonFiniteWarning,
            stacklevel=2,
        )
        advantages = self._advantages(rewards.masked_fill(bad, 0.0), batch)
        return advantages.masked_fill(bad[:, None], float("nan"))

    def _advantages(self, rewards: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        token_mask, group_size = batch["token_mask"], self.rollout.group_size
        # "grpo": (r - baseline) / (std + 1e-6) per group; the baseline is the group mean, or the
        # mean of the other G - 1 rewards with use_leave_one_out_baseline (RLOO)
        if self.advantage_estimator == "grpo":
            per_sample = grpo_advantages(
                rewards,
                group_size,
                normalize_std=self.normalize_rewards,
                leave_one_out=self.use_leave_one_out_baseline,
            )
            return token_level_advantages(per_sample, token_mask)
        kl = None
        cfg = self.loss_config
        # NeMo RL's semantics: with use_kl_in_reward, penalty * KL(prev_logprobs || reference) is
        # subtracted from the token rewards before the whitening, and the loss has no KL term
        if cfg.use_kl_in_reward and self.kl_penalty > 0:
            kl = calculate_kl(
                batch["prev_logprobs"],
                batch["reference_policy_logprobs"],
                cfg.reference_policy_kl_type,
                cfg.kl_input_clamp_value,
                cfg.kl_output_clamp_value,
            )
        # r - group mean, the optional reward KL, then whitened over the DP group: every layout
        # sees the global batch's statistics
        return reinforce_plus_plus_advantages(
            rewards,
            group_size,
            token_mask,
            minus_baseline=self.minus_baseline,
            kl=kl,
            kl_coef=self.kl_penalty,
            group=self.mcore_strategy.groups.dp_group,
        )

    @contextlib.contextmanager
    def reference_weights(self) -> Iterator[None]:
        """Temporarily give the model its initial weights (the reference policy)."""
        # regenerated from the tiny GPT's seed or re-read from the HF checkpoint: no extra memory
        with self.policy.initial_weights(self.mcore_strategy.model_chunks, self.parallel_groups):
            yield

    def setup(self, stage: str) -> None:
        """Build the reward and validation metrics; when fitting, check the micro-batching."""
        # megatron's groups exist by now (the strategy builds them before this hook); the
        # micro-batch check runs before any rollout
        if stage == "fit":
            size = self.rollout.group_size
            owner = f"{type(self).__name__}(rollout.group_size={size})"
            check_step_microbatches(self, "prompts_per_step", size, owner)
        group, device = self.mcore_strategy.groups.dp_group, self.mcore_strategy.root_device
        if self.evaluation is None:
            self.evaluation = RolloutEvaluation(self.pass_at_k, self.rollout.group_size, group).to(
                device
            )
        if self.rollout_reward is None:
            self.rollout_reward = MeanMetric(process_group=group, dist_sync_on_step=True).to(device)

    @torch.no_grad()
    def validation_step(  # type: ignore[override]
        self, batch: torch.Tensor | PromptBatch, batch_idx: int = 0
    ) -> dict[str, torch.Tensor]:
        """Score ``G`` completions per held-out prompt: ``rewards``, ``correct``, ``lengths``,
        ``truncated`` ``[b*G]``."""
        assert self.evaluation is not None  # built in setup()
        seed = validation_seed(self.rollout, batch_idx, self.mcore_strategy.groups.dp_rank)
        out, rewards = self._sample(batch, seed)
        stops = stop_tokens(self.rollout, self.tokenizer)
        scores = rollout_scores(out, rewards, self.rollout.max_new_tokens, stops)
        self.evaluation.update(**scores)
        self.evaluation.log(self)
        return scores

    def _sample(
        self, prompts: torch.Tensor | PromptBatch, seed: int
    ) -> tuple[Rollout, torch.Tensor]:
        """``G`` completions per prompt (group-major ``[b*G, P+N]``) and their rewards."""
        generate = rollout_generate(self, self.rollout_source, self.policy)
        return sample_groups(generate, prompts, self.rollout, seed, self.task, self.tokenizer)

    @torch.no_grad()
    def make_rollout(
        self, prompts: torch.Tensor | PromptBatch
    ) -> tuple[BatchedDataDict, torch.Tensor]:
        """Sample ``G`` completions per prompt (or take those submitted ahead): ``(batch, rewards
        [b*G])``, the `rollout_batch` rows plus ``advantages [b*G, P+N]``."""
        if self.rollout.max_staleness == 0:
            seed = rollout_seed(self.rollout, self.global_step, self.mcore_strategy.groups.dp_rank)
            out, rewards = self._sample(prompts, seed)
        else:
            out = self.take_rollout(prompts)
            rewards = group_rewards(out, prompts, self.rollout, self.task, self.tokenizer)
        batch = rollout_batch(out)
        batch["advantages"] = (
            torch.zeros_like(out.completion_mask, dtype=torch.float32)
            if self._advantages_need_logprobs()  # the training step fills them
            else self.advantages(rewards, batch)
        )
        return batch, rewards

    def take_rollout(self, prompts: torch.Tensor | PromptBatch) -> Rollout:
        """Asynchronous GRPO: this step's rollout, after submitting those of the next
        ``max_staleness`` batches; logs ``rollout_staleness``.

        Raises:
            TypeError: the train loader has no ``peek`` (on every rank, before any collective)."""
        peek = getattr(self.trainer.train_dataloader, "peek", None)
        if peek is None:
            raise TypeError(
                f"`rollout.max_staleness={self.rollout.max_staleness}` submits the rollouts of "
                "the next prompt batches ahead and needs a train loader with `peek(count)` "
                "(a ResumableLoader, as PromptDataModule's and PromptFileDataModule's), got "
                f"{type(self.trainer.train_dataloader).__name__}."
            )
        # A source that samples in the background ("vllm", "hf") samples the next batches while
        # the trainer trains them; a batch is trained by weights up to max_staleness steps newer
        # than those that sampled it (the loss's importance-sampling correction applies).
        ahead = self.rollout.max_staleness
        # none past max_steps
        if self.trainer.max_steps >= 0:
            ahead = min(ahead, self.trainer.max_steps - self.global_step - 1)
        upcoming = peek(ahead) if ahead > 0 else []
        submit = rollout_submit(self, self.rollout_source, self.policy)
        dp_rank = self.mcore_strategy.groups.dp_rank

        def start(batch: torch.Tensor | PromptBatch, steps_ahead: int) -> SubmittedRollout:
            seed = rollout_seed(self.rollout, self.global_step + steps_ahead, dp_rank)
            return submit(*group_request(batch, self.rollout, seed, self.task, self.tokenizer))

        submitted = self.rollout_queue.take(prompts, upcoming, start)
        out = submitted.pending.result()  # collective over the source's group
        # optimizer steps between the weights that sampled the rollout and those it trains
        staleness = float(self.global_step - submitted.weights_step)
        self.log("rollout_staleness", staleness, on_step=True, on_epoch=False, batch_size=1)
        return out

    def on_train_end(self) -> None:
        """Wait for the rollouts still being sampled ahead and drop them."""
        self.rollout_queue.clear()
        self.rollout_source.wait()


def rollout_seed(spec: RolloutSpec, global_step: int, dp_rank: int) -> int:
    """The sampling seed of a training step's rollouts on data-parallel rank ``dp_rank``."""
    # a prime stride: no two (step, DP rank) pairs share a seed below a million ranks
    return spec.seed + 1_000_003 * global_step + dp_rank


def validation_seed(spec: RolloutSpec, batch_idx: int, dp_rank: int) -> int:
    """The sampling seed of validation batch ``batch_idx`` on data-parallel rank ``dp_rank``."""
    # a stride of its own, so validation draws differ from the training steps'
    return spec.seed + 7_000_003 * (batch_idx + 1) + dp_rank


def sample_groups(
    generate: Generate,
    prompts: torch.Tensor | PromptBatch,
    spec: RolloutSpec,
    seed: int,
    task: Task,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[Rollout, torch.Tensor]:
    """``spec.group_size`` completions per prompt from ``generate`` and the task's rewards:
    the group-major rollout ``[b*G, P+N]`` and rewards ``[b*G]``."""
    # generate: (prompts [B, P], sampling, prompt_lengths [B] | None) -> Rollout; a text task's
    # tokenizer decodes the completions (and its EOS may stop them)
    out = generate(*group_request(prompts, spec, seed, task, tokenizer))
    return out, group_rewards(out, prompts, spec, task, tokenizer)


def group_request(
    prompts: torch.Tensor | PromptBatch,
    spec: RolloutSpec,
    seed: int,
    task: Task,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[torch.Tensor, SamplingConfig, torch.Tensor | None]:
    """``(prompts [b*G, P]`` group-major, sampling settings, ``prompt_lengths [b*G]`` or
    ``None)`` for ``spec.group_size`` completions per prompt (arguments as `sample_groups`)."""
    group = spec.group_size
    if isinstance(task, TextRewardTask):
        assert tokenizer is not None and isinstance(prompts, PromptBatch)  # GRPOModule's check
        ids, lengths = task.prompts(prompts)
        pad = tokenizer.pad_token_id
        sampling = SamplingConfig(
            spec.max_new_tokens,
            spec.temperature,
            seed,
            stop_tokens(spec, tokenizer),
            pad if pad is not None else 0,
            spec.top_k,
            spec.top_p,
        )
        # group-major: a prompt's G rows are adjacent, the groups the advantages normalise over
        return ids.repeat_interleave(group, dim=0), sampling, lengths.repeat_interleave(group)
    assert isinstance(prompts, torch.Tensor)  # the counting task's loaders yield tensors
    sampling = SamplingConfig(
        spec.max_new_tokens, spec.temperature, seed, top_k=spec.top_k, top_p=spec.top_p
    )
    return prompts.repeat_interleave(group, dim=0), sampling, None


def group_rewards(
    out: Rollout,
    prompts: torch.Tensor | PromptBatch,
    spec: RolloutSpec,
    task: Task,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> torch.Tensor:
    """The task's rewards ``[b*G]`` of the group-major rollout of ``prompts``."""
    if isinstance(task, TextRewardTask):
        assert tokenizer is not None and isinstance(prompts, PromptBatch)  # GRPOModule's check
        return task.rewards(prompts, out, spec.group_size, tokenizer)
    return task.rewards(out.tokens, out.completion_mask)


def stop_tokens(spec: RolloutSpec, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    """The ids that end a completion: a text task's EOS with ``spec.stop_at_eos``, else none."""
    # the counting task has no EOS; a stopped completion is padded and masked out of the loss
    eos = None if tokenizer is None else tokenizer.eos_token_id
    return (int(eos),) if spec.stop_at_eos and eos is not None else ()


def rollout_scores(
    out: Rollout,
    rewards: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Per-sample ``rewards``, ``correct``, completion ``lengths`` and ``truncated`` ``[B]``
    (truncated: ``max_new_tokens`` long without a stop token at the end)."""
    # (what RolloutEvaluation aggregates)
    lengths = out.completion_mask.sum(dim=1)
    prompt_width = out.prompt_width
    last = out.tokens.gather(1, (prompt_width + lengths - 1)[:, None])[:, 0]
    stopped = torch.isin(last, torch.tensor(stop_token_ids, dtype=last.dtype))
    return {
        "rewards": rewards,
        "correct": rewards >= 1.0,
        "lengths": lengths,
        "truncated": (lengths >= max_new_tokens) & ~stopped,
    }


def rollout_batch(out: Rollout) -> BatchedDataDict:
    """A rollout's training rows, right-aligned (prompt's real tokens, completion, zeros):
    ``input_ids``, ``token_mask``, ``generation_logprobs`` ``[B, P+N]``; ``input_lengths``,
    ``sample_mask`` ``[B]``; ``routed_experts [B, P+N, L, K]`` when the source recorded them."""
    # A left-padded prompt's pad columns move to the end (the data contract), so positions
    # start at 0 at the prompt's first token, as the rollout sources' do.
    rows, width = out.tokens.shape
    prompt_width = out.prompt_width
    columns = torch.arange(width)[None, :]
    shift = (prompt_width - out.prompt_lengths)[:, None]  # [B, 1] pad columns per row
    source = (columns + shift).clamp(max=width - 1)  # [B, P+N]
    lengths = out.prompt_lengths + out.completion_mask.sum(dim=1)
    valid = columns < lengths[:, None]
    batch = BatchedDataDict(
        input_ids=out.tokens.gather(1, source).masked_fill(~valid, 0),
        input_lengths=lengths,
        token_mask=(out.completion_mask.gather(1, source) * valid).float(),
        generation_logprobs=out.generation_logprobs.gather(1, source).masked_fill(~valid, 0.0),
        sample_mask=torch.ones(rows),
    )
    if out.routed_experts is not None:
        experts = out.routed_experts  # [B, P+N, L, K]
        index = source[:, :, None, None].expand_as(experts)
        batch["routed_experts"] = experts.gather(1, index).masked_fill(~valid[:, :, None, None], 0)
    return batch


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")
