"""On-policy distillation on the embedded toy task: the student samples, a hosted frozen teacher
scores every sampled position, the student is trained towards it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torchmetrics.aggregation import MeanMetric

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import (
    DistillationLossConfig,
    DistillationLossFn,
    OPDFullLossConfig,
    OPDFullLossFn,
)
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.recipes.common import (
    DEFAULT_TASK,
    HFModelSpec,
    RecipeModel,
    RecipeModule,
    TinyGPTSpec,
    check_step_microbatches,
)
from lightning_mcore_rl.recipes.evaluation import RolloutEvaluation
from lightning_mcore_rl.recipes.grpo import (
    RolloutSpec,
    rollout_batch,
    rollout_scores,
    rollout_seed,
    sample_groups,
    validation_seed,
)
from lightning_mcore_rl.recipes.rollout_choice import recipe_rollout, rollout_generate, spec_hparams
from lightning_mcore_rl.rollout import ModularCountingTask, Rollout, RolloutChoice

if TYPE_CHECKING:
    from lightning_mcore_rl.train import LossPostProcessor

Vocabulary = Literal["topk", "full"]
"""The teacher signal: its top-``K`` logits or its full-vocabulary distribution."""

Payload = Literal["logits", "hidden_states"]
"""How the full-vocabulary teacher reaches the loss: its logits ``[B, S, V]`` or its pre-LM-head
hidden states ``[B, S, H_t]`` (projected in the loss with its LM-head shard)."""

DEFAULT_TOPK_LOSS = DistillationLossConfig()
"""``DistillationModule``'s default top-k loss: the mixed KL (w = 0.5), no tail term."""

DEFAULT_FULL_LOSS = OPDFullLossConfig()
"""``DistillationModule``'s default full-vocabulary loss: the reverse KL's token mean."""


@dataclass
class TeacherSpec:
    """The hosted teacher.

    Attributes:
        model: a tiny GPT (its seed gives the weights) or a Hugging Face directory.
        checkpoint: a ``dist_checkpointing`` directory whose weights replace the built ones.
        checkpoint_prefix: the weights' key prefix in ``checkpoint`` (``""``: a run's policy).
        backend: how the teacher samples for ``val_teacher_reward``, as ``RolloutSpec.backend``."""

    model: TinyGPTSpec | HFModelSpec = field(default_factory=TinyGPTSpec)
    # e.g. trainer.save_checkpoint of a GRPO run, saved under any TP/PP layout; it must hold a
    # model of `model`'s shapes (a tiny GPT: the same size, V and P + N positions as this run)
    checkpoint: str | None = None
    # "" for a run's policy, "teacher." for a teacher saved with save_teacher_in_checkpoint
    checkpoint_prefix: str = ""
    # a refit source is refit once, from the hosted teacher's weights
    backend: RolloutChoice = "megatron"


DEFAULT_STUDENT = TinyGPTSpec(seed=1)
"""``DistillationModule``'s default student: the tiny GPT with other initial weights than the
default teacher's (each module copies it)."""

DEFAULT_TEACHER = TeacherSpec()
"""``DistillationModule``'s default teacher: the seed-0 tiny GPT (each module copies it; give it a
``checkpoint`` to distil a trained model)."""

DEFAULT_ROLLOUT = RolloutSpec()
"""``DistillationModule``'s default sampling settings (each module copies it)."""


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


class DistillationModule(RecipeModule):
    """On-policy distillation of a hosted frozen teacher into a student that samples itself.

    Args:
        task: the task of the prompts; its reward is logged, not trained on.
        model: the student (`TinyGPTSpec` or `HFModelSpec`).
        teacher: the teacher (`TeacherSpec`), of the student's vocabulary.
        rollout: the student's sampling settings and source (synchronous, no top-k/top-p).
        vocabulary: ``"topk"`` (`DistillationLossFn`) or ``"full"`` (`OPDFullLossFn`).
        topk: ``K`` of the top-k signal, in ``[1, V]``.
        topk_loss: the top-k loss (forward / reverse / mixed KL, optional tail term).
        payload: the full-vocabulary teacher payload, ``"logits"`` or ``"hidden_states"``.
        full_loss: the full-vocabulary loss (token or sequence mean).
        lr: Adam learning rate.
        pass_at_k: the ``k`` of ``val_pass@k`` (each ``<= group_size``)."""

    def __init__(
        self,
        task: ModularCountingTask | None = DEFAULT_TASK,
        model: TinyGPTSpec | HFModelSpec | None = DEFAULT_STUDENT,
        teacher: TeacherSpec | None = DEFAULT_TEACHER,
        rollout: RolloutSpec | None = DEFAULT_ROLLOUT,
        vocabulary: Vocabulary = "topk",
        topk: int = 8,
        topk_loss: DistillationLossConfig | None = DEFAULT_TOPK_LOSS,
        payload: Payload = "logits",
        full_loss: OPDFullLossConfig | None = DEFAULT_FULL_LOSS,
        lr: float = 5e-3,
        pass_at_k: tuple[int, ...] = (1,),
    ) -> None:
        _choice("vocabulary", vocabulary, ("topk", "full"))
        _choice("payload", payload, ("logits", "hidden_states"))
        # no reference policy here: the teacher is the target
        if full_loss is not None and full_loss.reference_policy_kl_penalty != 0:
            raise ValueError(
                "DistillationModule has no reference policy: `full_loss.reference_policy_kl_"
                f"penalty` must be 0, got {full_loss.reference_policy_kl_penalty}."
            )
        if rollout is not None:
            rollout.check_synchronous("DistillationModule")
        # the mutable spec defaults are shared instances: each module keeps its own copy
        rollout = replace(rollout) if rollout is not None else RolloutSpec()
        loss_fn = (
            DistillationLossFn(topk_loss or DEFAULT_TOPK_LOSS)
            if vocabulary == "topk"
            else OPDFullLossFn(full_loss or DEFAULT_FULL_LOSS)
        )
        # the sampling temperature also scales the student's and the teacher's logits in the loss
        super().__init__(
            loss_fn=loss_fn, sampling_params=TrainingSamplingParams(temperature=rollout.temperature)
        )
        self.task = task or ModularCountingTask()
        self.model_spec = replace(model) if model is not None else TinyGPTSpec()
        teacher = teacher or TeacherSpec()
        # copied down to its model spec: the defaults are shared instances
        self.teacher_spec = replace(teacher, model=replace(teacher.model))
        self.rollout = rollout
        self.vocabulary = vocabulary
        self.payload = payload
        length = self.task.prompt_length + rollout.max_new_tokens
        vocab = self._shared_vocab_size()
        if not 1 <= topk <= vocab:
            raise ValueError(f"`topk` must be in [1, V={vocab}], got {topk}.")
        self.topk = topk
        name = "prompt_length + max_new_tokens"
        self.policy = RecipeModel(self.model_spec, vocab, length, name)
        self.teacher_model = RecipeModel(self.teacher_spec.model, vocab, length, name)
        self.rollout_source = recipe_rollout(rollout.backend, self.policy)
        self.teacher_rollout = recipe_rollout(
            self.teacher_spec.backend, self.teacher_model, frozen=True
        )
        self.lr = lr
        self.pass_at_k = tuple(pass_at_k)
        self.evaluation: RolloutEvaluation | None = None
        self.rollout_reward: MeanMetric | None = None
        self.teacher_reward: MeanMetric | None = None
        self.save_hyperparameters(
            {
                "task": asdict(self.task),
                "model": asdict(self.model_spec),
                "teacher": spec_hparams(self.teacher_spec),
                "rollout": spec_hparams(self.rollout),
                "vocabulary": vocabulary,
                "topk": topk,
                "payload": payload,
                "lr": lr,
            }
        )

    def _shared_vocab_size(self) -> int:
        """``V`` of student and teacher: the task's, or an HF model's.

        Raises:
            ValueError: two HF models of different vocabularies."""
        from lightning_mcore_rl.models import HFBridge

        # an HF model's vocabulary, read from its config.json; two HF models must agree
        sizes = {
            role: HFBridge.from_pretrained(spec.path).vocab_size
            for role, spec in (("model", self.model_spec), ("teacher", self.teacher_spec.model))
            if isinstance(spec, HFModelSpec)
        }
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"Student and teacher must share one vocabulary; the HF models have vocab_size "
                f"{sizes['model']} (model) and {sizes['teacher']} (teacher)."
            )
        return next(iter(sizes.values()), self.task.vocab_size)

    # ---------------------------------------------------------------- models

    def build_teacher_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        """The teacher's chunk, its weights from ``teacher.checkpoint`` if given (collective)."""
        from lightning_mcore_rl.strategy import load_dist_checkpoint

        chunk = self.teacher_model.build_chunk(self, vp_stage)
        spec = self.teacher_spec
        if spec.checkpoint is not None:
            load_dist_checkpoint(chunk, spec.checkpoint, prefix=spec.checkpoint_prefix)
        return chunk

    def loss_post_processor(self, num_microbatches: int | None = None) -> LossPostProcessor:
        """The default post-processor; with the ``"hidden_states"`` payload also the teacher's
        LM-head shard ``[V/TP, H_t]`` (last pipeline stage) that projects them."""
        from lightning_mcore_rl.train import LossPostProcessor

        weight = self.teacher_output_weight() if self.payload == "hidden_states" else None
        assert self.loss_fn is not None  # set in __init__
        return LossPostProcessor(
            self.loss_fn,
            self.mcore_strategy.policy_config(),
            num_microbatches,
            sampling_params=self.sampling_params(),
            teacher_output_layer_weight_by_index=None if weight is None else {0: weight},
            use_fused_linear_logprobs=self.mcore_strategy.use_fused_linear_logprobs,
        )

    def setup(self, stage: str) -> None:
        """Build the reward metrics; when fitting, check the micro-batching."""
        # megatron's groups exist by now; micro_batch_size must divide the rank's
        # prompts_per_step / DP x group_size completions, checked before any rollout
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
        if self.teacher_reward is None:
            self.teacher_reward = MeanMetric(process_group=group).to(device)

    # ---------------------------------------------------------------- steps

    # The base step takes Mapping batches; this recipe's loader yields prompt tensors and the
    # step is replaced whole (Lightning hooks take whatever the dataloader yields).
    def training_step(  # type: ignore[override]
        self, batch: torch.Tensor, batch_idx: int = 0
    ) -> dict[str, Any]:
        """Student rollout, teacher signal, a distillation step on the rank's prompts ``[b, P]``."""
        # G completions per prompt from the student, seeded per step and DP rank as GRPO's;
        # their reward is logged, not trained on
        seed = rollout_seed(self.rollout, self.global_step, self.mcore_strategy.groups.dp_rank)
        out, rewards = self._sample(batch, seed)
        # the hosted teacher, forward-only on the samples (teacher=True)
        data = self.teacher_signal(rollout_batch(out))
        # DistillationLossFn (KL over the teacher's top-k) or OPDFullLossFn (the exact
        # full-vocabulary reverse KL): a token mean over the global batch's completion tokens
        step = self.forward_backward(data)
        assert self.rollout_reward is not None  # built in setup()
        self.rollout_reward(rewards)  # this step's mean over all data-parallel ranks
        self.log("reward", self.rollout_reward, on_step=True, on_epoch=False, prog_bar=True)
        return step.as_step_result()

    @torch.no_grad()
    def validation_step(  # type: ignore[override]
        self, batch: torch.Tensor, batch_idx: int = 0
    ) -> dict[str, torch.Tensor]:
        """Score ``G`` completions per held-out prompt of the student and (same seeds) the teacher:
        ``rewards``, ``correct``, ``lengths``, ``truncated``, ``teacher_rewards`` ``[b*G]``."""
        assert self.evaluation is not None and self.teacher_reward is not None  # setup()
        seed = validation_seed(self.rollout, batch_idx, self.mcore_strategy.groups.dp_rank)
        out, rewards = self._sample(batch, seed)
        # the same seeds: student and teacher are compared on the same draws
        _, teacher_rewards = self._sample(batch, seed, teacher=True)
        scores = rollout_scores(out, rewards, self.rollout.max_new_tokens)
        self.evaluation.update(**scores)
        self.evaluation.log(self)
        self.teacher_reward.update(teacher_rewards)
        self.log("val_teacher_reward", self.teacher_reward, on_step=False, on_epoch=True)
        return {**scores, "teacher_rewards": teacher_rewards}

    # ---------------------------------------------------------------- pieces

    def _sample(
        self, prompts: torch.Tensor, seed: int, *, teacher: bool = False
    ) -> tuple[Rollout, torch.Tensor]:
        """``G`` completions per prompt ``[b*G, P+N]`` of the student (or teacher), and rewards."""
        if teacher:
            generate = rollout_generate(
                self, self.teacher_rollout, self.teacher_model, teacher=True
            )
        else:
            generate = rollout_generate(self, self.rollout_source, self.policy)
        return sample_groups(generate, prompts, self.rollout, seed, self.task)

    @torch.no_grad()
    def teacher_signal(self, data: BatchedDataDict) -> BatchedDataDict:
        """``data`` plus the teacher's ``teacher_topk_logits``/``_indices [B, S, K]``, or
        ``teacher_full_payload`` ``[B, S, V]`` / ``[B, S, H_t]`` (with ``teacher_index [B]``)."""
        if self.vocabulary == "topk":
            values, indices = self.compute_topk_logits(data, self.topk, teacher=True)
            return BatchedDataDict(
                {**data, "teacher_topk_logits": values, "teacher_topk_indices": indices}
            )
        # its logits [B, S, V], or its pre-LM-head hidden states [B, S, H_t], projected in the
        # loss with its LM-head shard
        _, payload = self.compute_teacher_payload(data, self.payload, torch.float32, teacher=True)
        extra: dict[str, torch.Tensor] = {"teacher_full_payload": payload}
        if self.payload == "hidden_states":
            extra["teacher_index"] = torch.zeros(payload.shape[0], dtype=torch.long)
        return BatchedDataDict({**data, **extra})
