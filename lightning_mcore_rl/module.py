"""`MCoreRLModule`: the LightningModule users subclass to train megatron-core models (they supply
`build_chunk(vp_stage)` and `configure_optimizers`)."""

# The module declares what a step computes (its `loss_fn`, `sampling_params`, the post-processor
# hooks); the strategy asks those hooks before a pass starts and never calls back into the module
# during it. `training_step` returns the step's `StepOutput` as data, which `TrainingStatistics`
# logs. The module never touches a process group or megatron's `parallel_state`:
# `parallel_groups` (the strategy's groups, read once) is what `build_chunk` passes to builders.

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
    """Base LightningModule for `MCoreRLStrategy`: override `build_chunk` and
    `configure_optimizers`; optionally `forward_step` (default `lm_forward_step`: mean token cross
    entropy on `{"tokens": [B, S], "labels": [B, S]}`) or `build_teacher_chunk`.

    Args:
        loss_fn: the loss (`lightning_mcore_rl.losses`); `None` runs `forward_step`.
        sampling_params: temperature / top-k / top-p the rollouts were sampled with.
    """

    # With a `loss_fn`, batches are `BatchedDataDict`-style mappings (`input_ids`, `input_lengths`,
    # `token_mask`, `sample_mask` + the loss's fields, all `[B, ...]`), each microbatch's loss
    # comes from the `loss_post_processor` hook, and the
    # model config needs `calculate_per_token_loss=True` (`transformer_config` sets it). The
    # sampling parameters apply to the logits of every logprob path (temperature once).
    # `teacher_chunks` is a plain list, not submodules: outside `parameters()`/`state_dict()`,
    # and Lightning's `train()` never takes them out of eval mode. `save_teacher_in_checkpoint`
    # (default False) also saves and restores the teacher's weights in the strategy's checkpoints.

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
        """The Trainer's `MCoreRLStrategy` (``TypeError`` under any other strategy)."""
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
        """This rank's `ParallelGroups` (the strategy's): what `build_chunk` passes to the model
        builders (`tiny_gpt(config, groups=self.parallel_groups, ...)`, `HFBridge.build_chunk`)."""
        return self.mcore_strategy.groups

    def configure_model(self) -> None:
        """Build one chunk per virtual pipeline stage of this rank, then the teacher's."""
        # idempotent: Lightning calls it again for every `fit`/`validate`
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
        """Build this rank's megatron model chunk for `vp_stage`, stage-aware with
        `parallel_groups` (`pre_process = parallel_groups.is_first_stage(vp_stage)`, ...) and a
        config from `transformer_config`."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `build_chunk(vp_stage)` returning a megatron "
            "model chunk (e.g. a GPTModel built with `self.transformer_config(...)`)."
        )

    def build_teacher_chunk(self, vp_stage: int | None) -> torch.nn.Module | None:
        """This rank's chunk of a frozen teacher for `vp_stage` (default `None`), built like
        `build_chunk`, its weights loaded here (e.g. `strategy.load_dist_checkpoint`)."""
        # after `build_chunk`, with the policy's layout (any size); `HFBridge.load_weights` works
        # too, on every rank
        # the strategy freezes it, wraps it without megatron DDP (`Float16Module` under bf16),
        # never gives it to the optimizer, saves it only with `save_teacher_in_checkpoint`
        return None

    def build_draft_model(self) -> torch.nn.Module | None:
        """An EAGLE draft model trained next to the policy (default `None`; the same kind on every
        rank), e.g. `eagle_draft(self.chunks[-1].config, vocab_size=V, aux_layers=(i, j),
        groups=self.parallel_groups)` (aux layers of the last stage; `models.eagle3` for vLLM)."""
        # Called once per fit after `build_chunk`. The strategy keeps it on the last stage, in
        # megatron DDP, with its own Adam (the policy's settings and clipping), trains it in the
        # policy's step (weight `PolicyConfig.draft_loss_weight`; the policy's loss and gradients
        # unchanged) and logs train_draft_loss/_top1_agreement/_expected_acceptance
        # (docs/speculative-decoding.md).
        return None

    def teacher_output_weight(self) -> torch.Tensor | None:
        """The teacher's LM-head shard `[V/TP, H_t]` on the last pipeline stage (else `None`), for
        `"hidden_states"` teacher payloads."""
        from lightning_mcore_rl.train.fused import output_weight

        last = self.teacher_chunks[-1] if self.teacher_chunks else None
        if last is None or not getattr(last, "post_process", False):
            return None
        return output_weight(last)

    def transformer_config(self, **fields: Any) -> Any:
        """A megatron `TransformerConfig` with the strategy's parallel sizes and the Trainer's
        precision; `fields` may not set those (`ValueError` names the conflicting field)."""
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
        """`TrainingStatistics` (the Trainer's own if it has one) first, then the Trainer's other
        callbacks; call `super()` when overriding."""
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
        """Sampling parameters of every logprob path (default: the constructor's)."""
        # Their temperature is THE temperature of every pass (applied once to the logits, before
        # any post-processor); a post-processor built with another one raises `ValueError`
        return self._sampling_params

    def loss_post_processor(self, num_microbatches: int | None = None) -> LossPostProcessor:
        """The per-microbatch training-loss callback, asked before every `loss_fn` step as
        `loss_post_processor(None)` (the pass binds its own `M`; an int must equal it)."""
        # asked positionally, so an override `def loss_post_processor(self, num_microbatches)`
        # works
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
        """The forward-only callback of `compute_logprobs`."""
        from lightning_mcore_rl.train import LogprobsPostProcessor

        context = self.mcore_strategy.step_context
        return LogprobsPostProcessor(
            context.policy,
            sampling_params=context.sampling_params,
            use_fused_linear_logprobs=context.use_fused_linear_logprobs,
        )

    def topk_logits_post_processor(self, k: int) -> TopkLogitsPostProcessor:
        """The forward-only callback of `compute_topk_logits`."""
        from lightning_mcore_rl.train import TopkLogitsPostProcessor

        return TopkLogitsPostProcessor(self.mcore_strategy.step_context.policy, k)

    def teacher_payload_post_processor(
        self, payload: str, payload_dtype: torch.dtype
    ) -> TeacherFullPayloadPostProcessor:
        """The forward-only callback of `compute_teacher_payload`."""
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
        """This DP rank's share of one global batch through the strategy's step (`StepOutput`)."""
        return self.mcore_strategy.forward_backward(self, batch, forward_only=forward_only)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """One optimizer step's forward and backward: `StepOutput.as_step_result()` (overrides
        return the same for their last `forward_backward`)."""
        # Lightning hands it to every callback's `on_train_batch_end`, where TrainingStatistics
        # logs it
        return self.forward_backward(batch).as_step_result()

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """Forward-only step; returns like `training_step` (logged as `val_<metric>`)."""
        return self.forward_backward(batch, forward_only=True).as_step_result()

    # ---------------------------------------------------------------- forward-only passes

    # Each pass runs on the policy by default and on the hosted teacher with ``teacher=True``
    # (``ValueError`` without one): explicit at every call, whether or not a teacher is hosted.

    @torch.no_grad()
    def compute_logprobs(self, batch: Mapping[str, Any], *, teacher: bool = False) -> torch.Tensor:
        """Token logprobs `[B, S]` (0 at position 0) of this DP rank's batch, forward-only, on
        every rank; `teacher=True`: the hosted teacher's."""
        post = self.logprobs_post_processor()
        return self.mcore_strategy.forward_only(batch, post, teacher=teacher)["logprobs"]

    @torch.no_grad()
    def compute_topk_logits(
        self, batch: Mapping[str, Any], k: int, *, teacher: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact global top-`k` logits and indices `[B, S, K]`, forward-only, on every rank."""
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
        """Sampled-token logprobs `[B, S]` and the full payload `[B, S, D]` (`D = V` logits or
        `D = H` hidden states), forward-only, on every rank; `teacher=True`: the teacher's."""
        post = self.teacher_payload_post_processor(payload, payload_dtype)
        out = self.mcore_strategy.forward_only(batch, post, teacher=teacher)
        return out["logprobs"], out["teacher_full_payload"]
