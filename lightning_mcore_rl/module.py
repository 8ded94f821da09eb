"""``MCoreRLModule``: the LightningModule users subclass to train megatron-core models.

The user supplies ``build_chunk(vp_stage)`` (one megatron model chunk per virtual pipeline stage)
and ``configure_optimizers`` (a megatron ``OptimizerConfig``). Training and validation steps run
megatron's schedule through :meth:`MCoreRLModule.forward_backward`; logged values are identical on
every rank and logged once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch import LightningModule

from lightning_mcore_rl.strategy.schedule import (
    ForwardStepFunc,
    StepOutput,
    lm_forward_step,
    reduce_step_outputs,
)

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from lightning_mcore_rl.losses.interfaces import MetricNormalizer
    from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy

# How ``val_<metric>`` combines over validation batches, by ``MetricNormalizer`` value (the
# per-batch values are already global-batch values; default: mean, like ``val_loss``). Looked up
# with ``None`` for a metric the loss declares no normaliser for.
_VAL_REDUCE_FX: dict[str | None, str] = {"min": "min", "max": "max", "none": "sum"}


class MCoreRLModule(LightningModule):
    """Base LightningModule for :class:`~lightning_mcore_rl.MCoreRLStrategy`.

    Override :meth:`build_chunk` and ``configure_optimizers``; optionally :meth:`forward_step`
    (megatron's ``forward_step_func``) for a loss other than the default LM cross entropy on
    ``{"tokens": [B, S], "labels": [B, S]}`` batches.

    With a ``loss_fn`` (an RL/distillation ``LossFunction``), batches are ``BatchedDataDict``-style
    mappings (``input_ids``, ``input_lengths``, ``token_mask``, ``sample_mask`` + the loss's
    fields, all ``[B, ...]``) and each step runs ``lightning_mcore_rl.train``: global valid counts
    over DP, ``LossPostProcessor(loss_fn)`` and ``megatron_forward_backward``. The model config
    needs ``calculate_per_token_loss=True`` (:meth:`transformer_config` sets it).

    Args:
        loss_fn: the loss (``lightning_mcore_rl.losses``); ``None`` runs :meth:`forward_step`.
    """

    def __init__(self, loss_fn: Any | None = None) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.chunks: torch.nn.ModuleList | None = None

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

    def configure_model(self) -> None:
        """Build one chunk per virtual pipeline stage of this rank (idempotent: Lightning calls
        it again for every ``fit``/``validate``)."""
        if self.chunks is not None:
            return
        stages = self.mcore_strategy.vp_stages
        self.chunks = torch.nn.ModuleList([self.build_chunk(vp_stage) for vp_stage in stages])

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        """Build this rank's megatron model chunk for virtual pipeline stage ``vp_stage``.

        Megatron's parallel state is initialised; build stage-aware (``pre_process`` =
        ``is_pipeline_first_stage(vp_stage=...)``, ``post_process`` likewise) with a config
        from :meth:`transformer_config`.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement `build_chunk(vp_stage)` returning a megatron "
            "model chunk (e.g. a GPTModel built with `self.transformer_config(...)`)."
        )

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

    # ---------------------------------------------------------------- steps

    def forward_step(self, data_iterator: Any, model: torch.nn.Module) -> Any:
        """Megatron ``forward_step_func`` (default: LM cross entropy, see ``lm_forward_step``)."""
        return lm_forward_step(data_iterator, model)

    def forward_backward(self, batch: Mapping[str, Any], forward_only: bool = False) -> StepOutput:
        """Run megatron's schedule over this DP rank's share of one global batch.

        Returns:
            ``StepOutput(loss, metrics)``, identical on every rank.
        """
        if self.loss_fn is not None:
            return self._loss_fn_forward_backward(batch, forward_only)
        step: ForwardStepFunc = self.forward_step
        return self.mcore_strategy.forward_backward(batch, step, forward_only=forward_only)

    def policy_config(self) -> Any:
        """The ``PolicyConfig`` of the post-processors (default: packing from the strategy)."""
        from lightning_mcore_rl.train import PolicyConfig

        return PolicyConfig(sequence_packing=self.mcore_strategy.parallel.sequence_packing)

    def _run_post_processed(
        self, batch: Mapping[str, Any], make_post: Callable[[int], Any], forward_only: bool
    ) -> tuple[list[dict[str, Any]], Any]:
        """``process_global_batch`` (fixed-size or token-budget microbatches, from the strategy) +
        ``megatron_forward_backward`` with the post-processor ``make_post(num_microbatches)``;
        per-microbatch results on the last PP stage and the ``GlobalBatch`` (its
        ``restore_order`` puts per-sample outputs back in input order)."""
        from megatron.core import parallel_state as ps

        from lightning_mcore_rl.data import BatchedDataDict
        from lightning_mcore_rl.train import megatron_forward_backward, process_global_batch

        strategy = self.mcore_strategy
        for i, chunk in enumerate(strategy.model_chunks):
            if not cast("TransformerConfig", chunk.config).calculate_per_token_loss:
                raise ValueError(
                    f"Model chunk {i} needs `TransformerConfig.calculate_per_token_loss=True` "
                    "for the loss_fn path (build it with `self.transformer_config(...)`)."
                )
        data = batch if isinstance(batch, BatchedDataDict) else BatchedDataDict(batch)
        global_batch = process_global_batch(
            data,
            ps.get_data_parallel_group(),
            strategy.micro_batch_size,
            sequence_packing=strategy.parallel.sequence_packing,
            equal_shapes=strategy.parallel.pp > 1,
            max_tokens_per_microbatch=strategy.max_tokens_per_microbatch,
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=strategy.parallel.cp,
        )
        post = make_post(global_batch.num_microbatches)
        chunks = strategy.model_chunks
        iterators = [global_batch.iterator() for _ in chunks]
        outputs = megatron_forward_backward(
            chunks if len(chunks) > 1 else chunks[0],
            iterators if len(chunks) > 1 else iterators[0],
            global_batch.num_microbatches,
            global_batch.seq_length,
            global_batch.micro_batch_size,
            post,
            forward_only=forward_only,
            global_valid_seqs=global_batch.global_valid_seqs,
            global_valid_toks=global_batch.global_valid_toks,
        )
        return outputs, global_batch

    def training_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> torch.Tensor:
        """One optimizer step's forward and backward; logs ``train_loss`` (+ metrics) once."""
        out = self.forward_backward(batch)
        metrics = {f"train_{k}": v for k, v in out.metrics.items()}
        self.log_dict({"train_loss": out.loss, **metrics}, batch_size=1, prog_bar=False)
        return out.loss

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> torch.Tensor:
        """Forward-only schedule; logs ``val_loss`` and ``val_<metric>`` (means over validation
        batches; a ``loss_fn``'s ``MIN``/``MAX`` metrics by min/max, ``NONE`` counts summed)."""
        out = self.forward_backward(batch, forward_only=True)
        self.log("val_loss", out.loss, batch_size=1)
        norms: Mapping[str, MetricNormalizer] = getattr(self.loss_fn, "metric_normalizations", {})
        for name, value in out.metrics.items():
            reduce_fx = _VAL_REDUCE_FX.get(norms.get(name), "mean")
            self.log(f"val_{name}", value, batch_size=1, reduce_fx=reduce_fx)
        return out.loss

    # ---------------------------------------------------------------- loss_fn / forward-only paths

    def _loss_fn_forward_backward(self, batch: Mapping[str, Any], forward_only: bool) -> StepOutput:
        """The ``lightning_mcore_rl.train`` step: each microbatch's ``loss`` (and every other
        metric) is reduced by the loss's ``metric_normalizations`` over microbatches and DP
        ranks, which gives the global-batch value (``ValueError`` for an undeclared metric)."""
        from lightning_mcore_rl.train import LossPostProcessor

        loss_fn = self.loss_fn
        assert loss_fn is not None  # forward_backward takes this path only with a loss_fn

        def make_post(num_microbatches: int) -> Any:
            return LossPostProcessor(loss_fn, self.policy_config(), num_microbatches)

        outputs, _ = self._run_post_processed(batch, make_post, forward_only)
        return reduce_step_outputs(
            outputs,
            device=self.mcore_strategy.root_device,
            normalizations=loss_fn.metric_normalizations,
            source=type(loss_fn).__name__,
        )

    @torch.no_grad()
    def compute_logprobs(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Token logprobs ``[B, S]`` (stored convention: 0 at position 0) of this DP rank's batch,
        forward-only through ``LogprobsPostProcessor``, in the batch's sample order (also with
        token-budget microbatches), on every rank (broadcast from the last pipeline stage)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from lightning_mcore_rl.train import LogprobsPostProcessor

        def make_post(num_microbatches: int) -> Any:
            return LogprobsPostProcessor(self.policy_config())

        outputs, global_batch = self._run_post_processed(batch, make_post, forward_only=True)
        logprobs = [o["logprobs"] for o in outputs]
        holder = [global_batch.restore_order(logprobs).cpu() if outputs else None]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(
                holder,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
        assert holder[0] is not None
        return holder[0]
