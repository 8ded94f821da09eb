"""Rank functions for ``MCoreRLStrategy(microbatching=MicrobatchConfig(sequence_packing=...))`` on
the ``loss_fn`` path: the same ClippedPG GRPO run under a Trainer, padded then packed, in one rank
process (same weights, same sampler order), on the local packed attention (it runs padded batches
too)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from _strategy_rl_runs import PG_CFG, RolloutRows
from _strategy_runs import VOCAB, make_trainer, strategy_kwargs
from helpers.distributed import RunSpec
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.callbacks import TIMING_METRICS
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.layers import PackedDotProductAttention, get_packed_local_layer_spec
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.strategy import MicrobatchConfig


class PackedGRPOModule(MCoreRLModule):
    """The base ``training_step`` (logs ``train_loss`` and every loss metric); the strategy's
    sequence parallelism, learned absolute positions or RoPE."""

    def __init__(
        self, position_embedding_type: str = "learned_absolute", *, tied: bool = False
    ) -> None:
        super().__init__(loss_fn=ClippedPGLossFn(PG_CFG))
        self.position_embedding_type = position_embedding_type
        self.tied = tied
        self.attention_layouts: set[str] = set()  # "thd" / "sbhd": what the attention received

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        strategy = self.mcore_strategy
        config = tiny_gpt_config(
            self.parallel_groups,
            calculate_per_token_loss=True,
            sequence_parallel=strategy.parallel.sequence_parallel,
            bf16=strategy.precision_plugin.bf16,
        )
        chunk = tiny_gpt(
            config,
            groups=self.parallel_groups,
            vocab_size=VOCAB,
            seed=0,
            vp_stage=vp_stage,
            transformer_layer_spec=get_packed_local_layer_spec(),
            position_embedding_type=self.position_embedding_type,
            share_embeddings_and_output_weights=self.tied,
        )
        for sub in chunk.modules():
            if isinstance(sub, PackedDotProductAttention):
                sub.register_forward_pre_hook(self._record_layout)
        return chunk

    def _record_layout(self, attention: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.attention_layouts.add("thd" if args[0].dim() == 3 else "sbhd")

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, adam_eps=1e-4, weight_decay=0.0)


class StepRecorder(Callback):
    """Per step: ``compute_logprobs`` of the batch before the update (+ its lengths), then every
    logged metric and megatron's grad norm after it."""

    def __init__(self) -> None:
        self.logprobs: list[torch.Tensor] = []
        self.lengths: list[torch.Tensor] = []
        self.metrics: list[dict[str, float]] = []
        self.grad_norms: list[float] = []

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, idx: int) -> None:
        self.logprobs.append(module.compute_logprobs(batch))
        self.lengths.append(batch["input_lengths"].cpu())

    def on_train_batch_end(self, trainer: Trainer, module: Any, *args: Any) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.grad_norms.append(trainer.strategy.optimizers[0].last_step.grad_norm)


@dataclass(frozen=True)
class RecordedRun:
    """What :class:`StepRecorder` and the module recorded over one Trainer fit."""

    attention_layouts: list[str]
    logprobs: list[torch.Tensor]
    lengths: list[torch.Tensor]
    metrics: list[dict[str, float]]
    grad_norms: list[float]
    global_step: int
    num_microbatches: list[int] = field(default_factory=list)  # per step (token-budget runs)


@dataclass(frozen=True)
class PackingResult:
    """One rank of :func:`packing_rank`: the padded fit and the packed fit."""

    padded: RecordedRun
    packed: RecordedRun


def fit_recorded(
    spec: RunSpec,
    world_size: int,
    module: PackedGRPOModule,
    rows: Any,
    *,
    packing: bool,
    budget: int | None = None,
    **strategy_options: Any,
) -> RecordedRun:
    """Fit ``module`` on ``rows`` (this rank's DP share per step) and return what was recorded.
    With a token ``budget`` the fixed ``micro_batch_size`` is 1 (the strategy requires it);
    ``strategy_options`` go to ``MCoreRLStrategy``."""
    recorder = StepRecorder()
    kwargs = {**strategy_kwargs(spec), **strategy_options}
    kwargs["microbatching"] = MicrobatchConfig(
        micro_batch_size=spec.mbs if budget is None else 1,
        max_tokens_per_microbatch=budget,
        sequence_packing=packing,
    )
    strategy = MCoreRLStrategy(**kwargs)
    trainer = make_trainer(spec, world_size, callbacks=[recorder], strategy=strategy)
    trainer.fit(module, DataLoader(rows, batch_size=spec.local_batch(world_size)))
    return RecordedRun(
        attention_layouts=sorted(module.attention_layouts),
        logprobs=recorder.logprobs,
        lengths=recorder.lengths,
        metrics=recorder.metrics,
        grad_norms=recorder.grad_norms,
        global_step=trainer.global_step,
    )


def _fit(spec: RunSpec, world_size: int, packing: bool) -> RecordedRun:
    module = PackedGRPOModule()
    return fit_recorded(spec, world_size, module, RolloutRows(spec.rows), packing=packing)


def packing_rank(rank: int, spec: RunSpec) -> PackingResult:
    """Padded fit, then packed fit (megatron's parallel state is reused by the second Trainer)."""
    world_size = int(os.environ["WORLD_SIZE"])
    return PackingResult(padded=_fit(spec, world_size, False), packed=_fit(spec, world_size, True))


def packing_error_rank(rank: int, spec: RunSpec) -> str:
    """The error a packed fit raises (``""`` when none)."""
    try:
        _fit(spec, int(os.environ["WORLD_SIZE"]), packing=True)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return ""


def max_run_diffs(candidate: RecordedRun, reference: RecordedRun) -> dict[str, float]:
    """Max abs differences between two recorded Trainer runs of the same steps: every logged
    metric (same keys, incl. ``train_loss`` and ``grad_norm``), megatron's grad norms, and
    ``compute_logprobs`` on real tokens (positions ``< length``)."""
    for run in (candidate, reference):
        assert run.global_step == len(run.metrics) == len(reference.metrics)
    metric_diff = 0.0
    for mine, ref in zip(candidate.metrics, reference.metrics, strict=True):
        assert sorted(mine) == sorted(ref)
        assert "train_loss" in ref and "grad_norm" in ref and len(ref) > 3
        timed = set(TIMING_METRICS)  # wall-clock throughput differs between any two runs
        metric_diff = max(metric_diff, max(abs(mine[k] - ref[k]) for k in ref if k not in timed))
    norm_diff = max(
        abs(a - b) for a, b in zip(candidate.grad_norms, reference.grad_norms, strict=True)
    )
    logprob_diff = 0.0
    for mine, ref, lengths in zip(
        candidate.logprobs, reference.logprobs, reference.lengths, strict=True
    ):
        assert mine.shape == ref.shape
        real = torch.arange(ref.shape[1])[None, :] < lengths[:, None]
        logprob_diff = max(logprob_diff, float(((mine - ref).abs() * real).max()))
    return {"metrics": metric_diff, "grad_norms": norm_diff, "logprobs": logprob_diff}
