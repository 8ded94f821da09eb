"""Rank functions for
``MCoreRLStrategy(logprobs=LogprobKernelConfig(use_fused_linear_logprobs=...))``: the packed
ClippedPG GRPO run of ``_strategy_packing_runs`` under a Trainer, once on logits and once fused (hidden
states out of the last stage, logprobs from hidden x output weight), in one rank process (same
weights, same sampler order), at temperature 2."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from _strategy_packing_runs import PackedGRPOModule, RecordedRun, fit_recorded, max_run_diffs
from _strategy_rl_runs import PG_CFG, RolloutRows
from _strategy_runs import make_trainer, strategy_kwargs
from helpers.distributed import RunSpec
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.ops import TrainingSamplingParams, fused_linear
from lightning_mcore_rl.strategy import LogprobKernelConfig, MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state

TEMPERATURE = 2.0


@dataclass(frozen=True)
class FusedCase:
    """One fused-vs-logits comparison: the layout and the model/loss options.

    Attributes:
        spec: the megatron layout and loop sizes.
        tied: tie the output layer to the word embedding.
        entropy_coef: ClippedPG entropy bonus (> 0 exercises the fused entropy).
        packing: sequence packing (``False``: padded rows).
        gspo: GSPO's sequence-level ratio (not token-local: recomputing backward).
        gradient_in_forward: the fused run with ``fused_gradient_in_forward=True``.
    """

    spec: RunSpec
    tied: bool = False
    entropy_coef: float = 0.0
    packing: bool = True
    gspo: bool = False
    gradient_in_forward: bool = False

    @property
    def expects_forward_gradients(self) -> bool:
        """Whether the fused run's head computes its gradients in the forward (ClippedPG is
        token-local)."""
        local = not self.gspo and self.entropy_coef == 0 and self.spec.cp == 1
        return self.gradient_in_forward and local


class FusedGRPOModule(PackedGRPOModule):
    """The packed GRPO module with tied/untied embeddings, an entropy bonus and temperature 2;
    records whether its output layer ran as the fused pass-through or computed logits."""

    def __init__(self, case: FusedCase) -> None:
        super().__init__(tied=case.tied)
        self.loss_fn = ClippedPGLossFn(
            {
                **PG_CFG,
                "entropy_coef": case.entropy_coef,
                "sequence_level_importance_ratios": case.gspo,
                "token_level_loss": not case.gspo,  # GSPO needs a sequence-level loss
            }
        )
        self._sampling_params = TrainingSamplingParams(temperature=TEMPERATURE)
        self.head_modes: set[str] = set()

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        chunk = super().build_chunk(vp_stage)
        if chunk.post_process:
            chunk.output_layer.register_forward_pre_hook(self._record_head)
        return chunk

    def _record_head(self, layer: torch.nn.Module, args: tuple[Any, ...]) -> None:
        # the fused path's instance forward is the pass-through; the logits path runs the class
        # forward or, batch-first (train/fused.py:lm_head_batch_first), an instance forward
        forward = vars(layer).get("forward")
        self.head_modes.add(
            "fused" if getattr(forward, "__name__", "") == "passthrough" else "logits"
        )


def _fit(case: FusedCase, world_size: int, fused: bool) -> tuple[RecordedRun, list[str], int]:
    """The fit, how its output layer ran, and how many backwards of the fused head used the
    gradients it computed in the forward (counted around ``_ForwardGradients.finish``)."""
    module = FusedGRPOModule(case)
    finish = fused_linear._ForwardGradients.finish
    used: list[bool] = []

    def counted(forward_gradients: Any, *args: Any) -> Any:
        grads = finish(forward_gradients, *args)
        used.append(grads is not None)
        return grads

    with mock.patch.object(fused_linear._ForwardGradients, "finish", counted):
        run = fit_recorded(
            case.spec, world_size, module, RolloutRows(case.spec.rows), packing=case.packing,
            logprobs=LogprobKernelConfig(
                use_fused_linear_logprobs=fused,
                fused_gradient_in_forward=fused and case.gradient_in_forward,
            ),
        )  # fmt: skip
    assert all(used), "a backward fell back to recomputing"
    return run, sorted(module.head_modes), len(used)


@dataclass(frozen=True)
class FusedResult:
    """One rank, one case: max |fused - logits| (:func:`max_run_diffs`), the fused run's
    per-step losses and logged names, and how each run's output layer ran (``[]`` off the
    last pipeline stage)."""

    diffs: dict[str, float]
    losses: list[float]
    metric_names: list[str]
    head_modes: dict[str, list[str]]
    forward_gradients: int


def fused_vs_logits_rank(rank: int, cases: tuple[FusedCase, ...]) -> list[FusedResult]:
    """Per case: the logits fit, then the fused fit (megatron's parallel state is reused by the
    second; a case with another layout starts from a clean one)."""
    world_size = int(os.environ["WORLD_SIZE"])
    results = []
    for case in cases:
        destroy_megatron_state()
        plain, plain_modes, _ = _fit(case, world_size, fused=False)
        fused, fused_modes, forward_gradients = _fit(case, world_size, fused=True)
        results.append(
            FusedResult(
                diffs=max_run_diffs(fused, plain),
                losses=[m["train_loss"] for m in fused.metrics],
                metric_names=sorted(fused.metrics[0]),
                head_modes={"logits": plain_modes, "fused": fused_modes},
                forward_gradients=forward_gradients,
            )
        )
    return results


class _TopkModule(FusedGRPOModule):
    """Asks for exact top-k logits (forward-only) before every step."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.compute_topk_logits(batch, 4)


def fused_error_rank(rank: int, spec: RunSpec) -> dict[str, str]:
    """The errors fused fits raise for top-k/top-p sampling and a top-k logits pass."""
    world_size = int(os.environ["WORLD_SIZE"])
    filtered = FusedGRPOModule(FusedCase(spec))
    filtered._sampling_params = TrainingSamplingParams(temperature=TEMPERATURE, top_k=8)
    errors = {}
    for name, module in {"top_k": filtered, "topk_logits": _TopkModule(FusedCase(spec))}.items():
        strategy = MCoreRLStrategy(
            **{
                **strategy_kwargs(spec),
                "microbatching": MicrobatchConfig(micro_batch_size=spec.mbs, sequence_packing=True),
            },
            logprobs=LogprobKernelConfig(use_fused_linear_logprobs=True),
        )
        trainer = make_trainer(spec, world_size, strategy=strategy)
        loader = DataLoader(RolloutRows(spec.rows), batch_size=spec.local_batch(world_size))
        try:
            trainer.fit(module, loader)
            errors[name] = ""
        except ValueError as err:
            errors[name] = str(err)
    return errors
