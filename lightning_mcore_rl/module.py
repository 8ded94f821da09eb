"""``MCoreRLModule``: the LightningModule users subclass to train megatron-core models.

The user supplies ``build_chunk(vp_stage)`` (one megatron model chunk per virtual pipeline stage)
and ``configure_optimizers`` (a megatron ``OptimizerConfig``). The module declares what a step
computes (its ``loss_fn``, :meth:`~MCoreRLModule.sampling_params`, the post-processor hooks
:meth:`~MCoreRLModule.loss_post_processor`, ...); the strategy asks those hooks before a pass
starts and never calls back into the module during it. ``training_step`` returns the step's
:class:`~lightning_mcore_rl.train.StepOutput` as data, which the
:class:`~lightning_mcore_rl.callbacks.TrainingStatistics` callback logs in
``on_train_batch_end``. The module never touches a process group or megatron's
``parallel_state``: :attr:`~MCoreRLModule.parallel_groups` (the strategy's groups, read once)
is what ``build_chunk`` passes to the model builders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback, LightningModule

from lightning_mcore_rl.train.step import lm_forward_step

if TYPE_CHECKING:
    from lightning_mcore_rl.ops import TrainingSamplingParams
    from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy
    from lightning_mcore_rl.train import (
        LogprobsPostProcessor,
        LossPostProcessor,
        ParallelGroups,
        StepOutput,
        TeacherFullPayloadPostProcessor,
        TopkLogitsPostProcessor,
    )


class MCoreRLModule(LightningModule):
    """Base LightningModule for :class:`~lightning_mcore_rl.MCoreRLStrategy`.

    Override :meth:`build_chunk` and ``configure_optimizers``; optionally ``forward_step``
    (megatron's ``forward_step_func(data_iterator, model)``; default:
    :func:`~lightning_mcore_rl.train.lm_forward_step`, the mean token cross entropy on
    ``{"tokens": [B, S], "labels": [B, S]}`` batches) for another LM-path loss.

    With a ``loss_fn`` (an RL/distillation ``LossFunction``), batches are ``BatchedDataDict``-style
    mappings (``input_ids``, ``input_lengths``, ``token_mask``, ``sample_mask`` + the loss's
    fields, all ``[B, ...]``) and each microbatch's loss comes from the
    :meth:`loss_post_processor` hook. The model config needs ``calculate_per_token_loss=True``
    (:meth:`transformer_config` sets it).

    A frozen teacher (distillation) is hosted by overriding :meth:`build_teacher_chunk`; the
    forward-only passes take ``teacher=True`` to run on it.

    Args:
        loss_fn: the loss (``lightning_mcore_rl.losses``); ``None`` runs :meth:`forward_step`.
        sampling_params: temperature / top-k / top-p the rollouts were sampled with; applied to
            the logits of every logprob path, training and forward-only (temperature once).

    Attributes:
        chunks: the policy's raw megatron chunks, one per virtual pipeline stage.
        teacher_chunks: the hosted teacher's raw chunks (``None``: no teacher); a plain list,
            not registered as submodules, so they are outside ``parameters()``/``state_dict()``
            and Lightning's ``train()`` never leaves eval mode for them.
        save_teacher_in_checkpoint: also save (and restore) the teacher's weights in the
            strategy's checkpoints (default ``False``: checkpoints hold the policy only).
    """

    def __init__(
        self, loss_fn: Any | None = None, sampling_params: TrainingSamplingParams | None = None
    ) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self._sampling_params = sampling_params
        self.chunks: torch.nn.ModuleList | None = None
        self.teacher_chunks: list[torch.nn.Module] | None = None
        self.save_teacher_in_checkpoint = False

    # ---------------------------------------------------------------- model construction

    @property
    def mcore_strategy(self) -> MCoreRLStrategy:
        """The Trainer's :class:`MCoreRLStrategy` (``TypeError`` under any other strategy)."""
        from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, MCoreRLStrategy):
            raise TypeError(
                f"{type(self).__name__} needs `Trainer(strategy=MCoreRLStrategy(...))` or "
                f"strategy='mcore_rl', got {type(strategy).__name__}."
            )
        return strategy

    @property
    def parallel_groups(self) -> ParallelGroups:
        """This rank's :class:`~lightning_mcore_rl.train.ParallelGroups` (the strategy's, read
        once in its set-up): what :meth:`build_chunk` passes to the model builders
        (``tiny_gpt(config, groups=self.parallel_groups, ...)``, ``HFBridge.build_chunk``)."""
        return self.mcore_strategy.groups

    def configure_model(self) -> None:
        """Build one chunk per virtual pipeline stage of this rank, then the teacher's
        (:meth:`build_teacher_chunk`); idempotent: Lightning calls it again for every
        ``fit``/``validate``."""
        from lightning_mcore_rl.strategy.model import build_stage_chunks
        from lightning_mcore_rl.strategy.teacher import build_teacher_chunks

        if self.chunks is not None:
            return
        stages = self.mcore_strategy.vp_stages
        self.chunks = torch.nn.ModuleList(
            build_stage_chunks(self.build_chunk, stages, "build_chunk")
        )
        self.teacher_chunks = build_teacher_chunks(self.build_teacher_chunk, stages)

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        """Build this rank's megatron model chunk for virtual pipeline stage ``vp_stage``.

        Build stage-aware with this rank's layout, :attr:`parallel_groups` (``pre_process`` =
        ``parallel_groups.is_first_stage(vp_stage)``, ``post_process`` likewise; the model
        builders take ``groups=self.parallel_groups``), with a config from
        :meth:`transformer_config`.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement `build_chunk(vp_stage)` returning a megatron "
            "model chunk (e.g. a GPTModel built with `self.transformer_config(...)`)."
        )

    def build_teacher_chunk(self, vp_stage: int | None) -> torch.nn.Module | None:
        """This rank's chunk of a frozen teacher for ``vp_stage``, or ``None`` (default: no
        teacher).

        Called after :meth:`build_chunk` for every stage (``self.chunks`` exists), with the
        policy's parallel layout: build stage-aware like :meth:`build_chunk`, with a config from
        :meth:`transformer_config`, and load the teacher's weights here, e.g. with
        ``HFBridge.build_chunk`` / ``HFBridge.load_weights`` or from a megatron checkpoint with
        :func:`lightning_mcore_rl.strategy.load_dist_checkpoint` (on every rank). The teacher may
        differ from the policy in size. The strategy freezes it (``requires_grad=False``, eval
        mode), wraps it without megatron DDP (``Float16Module`` under bf16), never gives it to
        the optimizer, and saves it only with :attr:`save_teacher_in_checkpoint`.
        """
        return None

    def build_draft_model(self) -> torch.nn.Module | None:
        """An EAGLE draft model trained next to the policy in every training step, or ``None``
        (default: no draft).

        Called once per fit on every rank after :meth:`build_chunk` (``self.chunks`` exists);
        return the same kind of answer everywhere, e.g. ``eagle_draft(self.chunks[-1].config,
        vocab_size=V, aux_layers=(i, j), groups=self.parallel_groups)``
        (:mod:`lightning_mcore_rl.models.draft`; ``models.eagle3.eagle3_draft`` for a draft vLLM
        and SGLang load; the aux layers must be decoder layers of the last pipeline stage). The strategy keeps it on the last pipeline stage, wraps it in
        megatron DDP, gives it its own Adam (the policy optimizer's settings, its own clipping
        at ``gradient_clip_val``) and trains it in the policy's step: ``train_draft_loss``,
        ``train_draft_top1_agreement`` and ``train_draft_expected_acceptance`` are logged; the policy's loss and gradients are unchanged
        (docs/speculative-decoding.md). The draft's weight in the loss is the loss
        post-processor's ``PolicyConfig.draft_loss_weight``.
        """
        return None

    def teacher_output_weight(self) -> torch.Tensor | None:
        """The teacher's LM-head shard ``[V/TP, H_t]`` on the last pipeline stage (``None``
        elsewhere or without a teacher): the ``teacher_output_layer_weight_by_index`` entry a
        ``LossPostProcessor`` needs for ``"hidden_states"`` teacher payloads."""
        from lightning_mcore_rl.train.fused import output_weight

        last = self.teacher_chunks[-1] if self.teacher_chunks else None
        if last is None or not getattr(last, "post_process", False):
            return None
        return output_weight(last)

    def transformer_config(self, **fields: Any) -> Any:
        """A megatron ``TransformerConfig`` with the strategy's parallel sizes and the Trainer's
        precision; ``fields`` may not set those (``ValueError`` names the conflicting field)."""
        from megatron.core.transformer import TransformerConfig

        owned = self.mcore_strategy.transformer_config_kwargs()
        if self.loss_fn is not None:
            fields.setdefault("calculate_per_token_loss", True)
        for key in sorted(set(fields) & set(owned)):
            if fields[key] != owned[key]:
                raise ValueError(
                    f"`{key}={fields[key]!r}` conflicts with the strategy/Trainer value "
                    f"{owned[key]!r}; set it on MCoreRLStrategy or Trainer(precision=...)."
                )
        return TransformerConfig(**{**fields, **owned})

    def configure_callbacks(self) -> list[Callback]:
        """:class:`~lightning_mcore_rl.callbacks.TrainingStatistics` (the Trainer's own if it has
        one: never logged twice) first, then the Trainer's other callbacks. Call ``super()``
        when overriding."""
        from lightning_mcore_rl.callbacks.training_statistics import TrainingStatistics

        callbacks: list[Callback] = list(getattr(self.trainer, "callbacks", []))
        stats = next((c for c in callbacks if isinstance(c, TrainingStatistics)), None)
        # Lightning replaces the Trainer's callbacks of the types returned here by these, in
        # this order (its documented `configure_callbacks` rule; `ModelCheckpoint`s still run
        # last): returning the others after the statistics runs every other callback's
        # `on_train_batch_end` after this step's values reached `trainer.callback_metrics`.
        # (a plain `Callback` instance Lightning would keep as well: left where it is)
        others = (c for c in callbacks if c is not stats and type(c) is not Callback)
        return [stats or TrainingStatistics(), *others]

    # ---------------------------------------------------------------- post-processing hooks

    def sampling_params(self) -> TrainingSamplingParams | None:
        """Sampling parameters of every logprob path (default: the constructor's). Their
        temperature is THE temperature of every pass (applied once to the logits, before any
        post-processor); post-processors use only their top-k/top-p, and one built with a
        different temperature raises ``ValueError``."""
        return self._sampling_params

    def loss_post_processor(self, num_microbatches: int | None = None) -> LossPostProcessor:
        """The per-microbatch training-loss callback, asked by the strategy before every
        ``loss_fn`` step as ``loss_post_processor(None)`` (positionally, so an override
        ``def loss_post_processor(self, num_microbatches)`` works).

        Args:
            num_microbatches: ``None``: the pass binds its own ``M``; an int: a post-processor
                for exactly that ``M``, which the pass checks equals its own (``ValueError``
                otherwise).
        """
        from lightning_mcore_rl.train import LossPostProcessor

        if self.loss_fn is None:
            raise ValueError(
                f"{type(self).__name__} has no `loss_fn`; pass `MCoreRLModule(loss_fn=...)` or "
                "override `forward_step` for the LM path."
            )
        context = self.mcore_strategy.step_context
        return LossPostProcessor(
            self.loss_fn,
            context.policy,
            num_microbatches,
            sampling_params=context.sampling_params,
            use_fused_linear_logprobs=context.use_fused_linear_logprobs,
        )

    def logprobs_post_processor(self) -> LogprobsPostProcessor:
        """The forward-only callback of :meth:`compute_logprobs`."""
        from lightning_mcore_rl.train import LogprobsPostProcessor

        context = self.mcore_strategy.step_context
        return LogprobsPostProcessor(
            context.policy,
            sampling_params=context.sampling_params,
            use_fused_linear_logprobs=context.use_fused_linear_logprobs,
        )

    def topk_logits_post_processor(self, k: int) -> TopkLogitsPostProcessor:
        """The forward-only callback of :meth:`compute_topk_logits`."""
        from lightning_mcore_rl.train import TopkLogitsPostProcessor

        return TopkLogitsPostProcessor(self.mcore_strategy.step_context.policy, k)

    def teacher_payload_post_processor(
        self, payload: str, payload_dtype: torch.dtype
    ) -> TeacherFullPayloadPostProcessor:
        """The forward-only callback of :meth:`compute_teacher_payload`."""
        from lightning_mcore_rl.train import TeacherFullPayloadPostProcessor

        context = self.mcore_strategy.step_context
        return TeacherFullPayloadPostProcessor(
            context.policy, payload, payload_dtype, sampling_params=context.sampling_params
        )

    # ---------------------------------------------------------------- steps

    forward_step = staticmethod(lm_forward_step)
    """Megatron ``forward_step_func(data_iterator, model)`` of the LM path (override with a
    method for another loss; megatron calls it per microbatch)."""

    def forward_backward(self, batch: Mapping[str, Any], forward_only: bool = False) -> StepOutput:
        """Run this DP rank's share of one global batch through the strategy's step.

        Returns:
            ``StepOutput(loss, metrics, ...)``, identical on every rank.
        """
        return self.mcore_strategy.forward_backward(self, batch, forward_only=forward_only)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """One optimizer step's forward and backward.

        Returns:
            ``{"loss": loss, "step_output": StepOutput}``
            (:meth:`~lightning_mcore_rl.train.StepOutput.as_step_result`): Lightning hands it to
            every callback's ``on_train_batch_end``, where ``TrainingStatistics`` logs it.
            Overrides return the same for their last ``forward_backward``.
        """
        return self.forward_backward(batch).as_step_result()

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """Forward-only step; returns like :meth:`training_step` (``TrainingStatistics`` logs
        ``val_loss`` and ``val_<metric>`` in ``on_validation_batch_end``)."""
        return self.forward_backward(batch, forward_only=True).as_step_result()

    # ---------------------------------------------------------------- forward-only passes

    # Each pass runs on the policy by default and on the hosted teacher with ``teacher=True``
    # (``ValueError`` without one): explicit at every call, whether or not a teacher is hosted.

    @torch.no_grad()
    def compute_logprobs(self, batch: Mapping[str, Any], *, teacher: bool = False) -> torch.Tensor:
        """Token logprobs ``[B, S]`` (0 at position 0) of this DP rank's batch, forward-only
        (dropout off) through :meth:`logprobs_post_processor`, in the batch's sample order, on
        every rank; ``teacher=True``: the hosted teacher's."""
        post = self.logprobs_post_processor()
        return self.mcore_strategy.forward_only(batch, post, teacher=teacher)["logprobs"]

    @torch.no_grad()
    def compute_topk_logits(
        self, batch: Mapping[str, Any], k: int, *, teacher: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact global top-``k`` logits and vocabulary indices ``[B, S, K]`` per position
        (position-aligned with the inputs), forward-only, on every rank; ``teacher=True``: the
        hosted teacher's (``teacher_topk_logits``/``teacher_topk_indices`` of a distillation
        batch)."""
        post = self.topk_logits_post_processor(k)
        out = self.mcore_strategy.forward_only(batch, post, teacher=teacher)
        return out["topk_logits"], out["topk_indices"]

    @torch.no_grad()
    def compute_teacher_payload(
        self,
        batch: Mapping[str, Any],
        payload: str,
        payload_dtype: torch.dtype,
        *,
        teacher: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled-token logprobs ``[B, S]`` and the full-vocabulary payload ``[B, S, D]``
        (``"logits"``: ``D = V``; ``"hidden_states"``: ``D = H``, the output layer's input,
        also under sequence parallelism), forward-only, on every rank; ``teacher=True``: the
        hosted teacher's (``teacher_full_payload`` of an ``OPDFullLossFn`` batch)."""
        post = self.teacher_payload_post_processor(payload, payload_dtype)
        out = self.mcore_strategy.forward_only(batch, post, teacher=teacher)
        return out["logprobs"], out["teacher_full_payload"]
