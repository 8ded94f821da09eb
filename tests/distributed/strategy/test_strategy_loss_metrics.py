"""Every metric of ``MCoreRLModule(loss_fn=ClippedPGLossFn)`` is logged (``train_<name>``,
``val_<name>``), identical on all ranks and equal to the metrics of ONE loss call on the whole
global batch (full-batch logprobs from a plain forward), whatever the microbatch split, DP or PP
layout; an undeclared metric raises on every rank."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

import pytest
import torch
from _strategy_rl_runs import PG_CFG, RolloutRows, S
from _strategy_runs import VOCAB, make_trainer
from helpers.distributed import RunSpec
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLModule
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state, run_on_ranks

GLOBAL_BATCH = 8  # = rows: one step reads every row once, whatever the sampler's shuffle
ONE_STEP = RunSpec(steps=1, global_batch=GLOBAL_BATCH)
LAYOUTS = {"dp2": ONE_STEP, "pp2": replace(ONE_STEP, pp=2), "tp2": replace(ONE_STEP, tp=2)}


class UndeclaredMetricLoss(ClippedPGLossFn):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loss, metrics = super().__call__(*args, **kwargs)
        return loss, {**metrics, "mystery": loss.detach()}


class MetricsModule(MCoreRLModule):
    """The base ``training_step``/``validation_step`` (they log every metric)."""

    def __init__(self, loss_fn: Any = None) -> None:
        super().__init__(loss_fn=loss_fn or ClippedPGLossFn(PG_CFG))

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(self.parallel_groups, calculate_per_token_loss=True)
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, adam_eps=1e-4, weight_decay=0.0)


def _reference() -> dict[str, float]:
    """ONE ``ClippedPGLossFn`` call on the whole global batch: logprobs of a plain TP=PP=1
    forward (log_softmax + gather in torch), global counts summed directly."""
    init_megatron_state()
    model = tiny_gpt(tiny_gpt_config(calculate_per_token_loss=True), vocab_size=VOCAB, seed=0)
    rows = RolloutRows(GLOBAL_BATCH)
    data = {k: torch.stack([rows[i][k] for i in range(GLOBAL_BATCH)]) for k in rows[0]}
    ids = data["input_ids"]
    positions = torch.arange(S).expand_as(ids)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        logits = model(ids, positions, causal).float()  # [B, S, V]
    logprobs = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    sm = data["sample_mask"]
    seqs, toks = sm.sum(), (data["token_mask"][:, 1:] * sm[:, None]).sum()
    _, metrics = ClippedPGLossFn(PG_CFG)(data, seqs, toks, next_token_logprobs=logprobs)
    destroy_megatron_state()
    return {k: float(v) for k, v in metrics.items()}


def _run(spec: RunSpec, world_size: int, validate: bool, loss: Any = None) -> dict[str, float]:
    trainer = make_trainer(spec, world_size)
    loader = DataLoader(RolloutRows(GLOBAL_BATCH), batch_size=spec.local_batch(world_size))
    module = MetricsModule(loss)
    if validate:
        trainer.validate(module, loader, verbose=False)
    else:
        trainer.fit(module, loader)
    destroy_megatron_state()
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def metrics_rank(rank: int) -> dict[str, dict[str, float]]:
    """The reference metrics and every layout's logged metrics (keyed by run name)."""
    world_size = int(os.environ["WORLD_SIZE"])
    out = {"reference": _reference()}
    for name, spec in LAYOUTS.items():
        out[name] = _run(spec, world_size, False)
    out["val_pp2"] = _run(LAYOUTS["pp2"], world_size, True)
    return out


def undeclared_rank(rank: int, spec: RunSpec) -> None:
    _run(spec, 2, False, loss=UndeclaredMetricLoss(PG_CFG))


def _logged(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)}


def test_all_loss_metrics_are_logged_exactly_under_dp_pp_tp():
    results = run_on_ranks(metrics_rank, 2, timeout=120)
    reference = results[0]["reference"]
    # The reference exercises the metrics: some tokens clipped, a ratio spread, a KL term.
    assert 0 < reference["clip_fraction"] < 1
    assert reference["probs_ratio_min"] < 1 < reference["probs_ratio_max"]
    assert reference["num_valid_samples"] == GLOBAL_BATCH
    for run, prefix in [*[(name, "train_") for name in LAYOUTS], ("val_pp2", "val_")]:
        logged = _logged(results[0][run], prefix)
        assert logged == _logged(results[1][run], prefix), run  # identical on every rank
        assert set(logged) == set(reference), run  # every metric, `loss` included
        for key, expected in reference.items():
            assert math.isclose(logged[key], expected, rel_tol=1e-6, abs_tol=1e-6), (
                run,
                key,
                logged[key],
                expected,
            )


def test_undeclared_metric_raises_naming_metric_and_loss():
    with pytest.raises(
        RuntimeError, match=r"UndeclaredMetricLoss returned metric\(s\) \['mystery'\]"
    ):
        run_on_ranks(undeclared_rank, 2, LAYOUTS["pp2"], timeout=120)
