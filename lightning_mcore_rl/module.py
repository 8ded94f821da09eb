"""``MCoreRLModule``: the LightningModule users subclass to train megatron-core models.

The user supplies ``build_chunk(vp_stage)`` (one megatron model chunk per virtual pipeline stage)
and ``configure_optimizers`` (a megatron ``OptimizerConfig``). Training and validation steps run
megatron's schedule through :meth:`MCoreRLModule.forward_backward`; logged values are identical on
every rank and logged once per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule

from lightning_mcore_rl.strategy.schedule import ForwardStepFunc, StepOutput, lm_forward_step

if TYPE_CHECKING:
    from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy


class MCoreRLModule(LightningModule):
    """Base LightningModule for :class:`~lightning_mcore_rl.MCoreRLStrategy`.

    Override :meth:`build_chunk` and ``configure_optimizers``; optionally :meth:`forward_step`
    (megatron's ``forward_step_func``) for a loss other than the default LM cross entropy on
    ``{"tokens": [B, S], "labels": [B, S]}`` batches.

    Args:
        loss_fn: an RL/distillation ``LossFunction`` (``lightning_mcore_rl.losses``), reserved for
            the ``lightning_mcore_rl.train`` step path; ``None`` runs :meth:`forward_step`.
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

    def forward_backward(
        self, batch: Mapping[str, torch.Tensor], forward_only: bool = False
    ) -> StepOutput:
        """Run megatron's schedule over this DP rank's share of one global batch.

        Returns:
            ``StepOutput(loss, metrics)``, identical on every rank.
        """
        step: ForwardStepFunc = self.forward_step
        return self.mcore_strategy.forward_backward(batch, step, forward_only=forward_only)

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int = 0) -> torch.Tensor:
        """One optimizer step's forward and backward; logs ``train_loss`` (+ metrics) once."""
        out = self.forward_backward(batch)
        metrics = {f"train_{k}": v for k, v in out.metrics.items()}
        self.log_dict({"train_loss": out.loss, **metrics}, batch_size=1, prog_bar=False)
        return out.loss

    def validation_step(
        self, batch: Mapping[str, torch.Tensor], batch_idx: int = 0
    ) -> torch.Tensor:
        """Forward-only schedule; logs ``val_loss`` (mean over validation batches)."""
        out = self.forward_backward(batch, forward_only=True)
        self.log("val_loss", out.loss, batch_size=1)
        return out.loss
