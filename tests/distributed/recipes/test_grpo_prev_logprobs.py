"""GRPO's forward-only ``prev_logprobs`` pass: skipped where the batch is trained once by the
weights that sampled it, with every logged number identical to the run that pays for it; kept
where it matters (asynchronous rollouts)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.losses import ClippedPGLossConfig
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule, RolloutSpec
from lightning_mcore_rl.reliability import nonfinite
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state, run_on_ranks

STEPS = 3


class _Record(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(prev_pass: str, kl: float, staleness: int) -> tuple[list[dict[str, float]], int, list]:
    """Every step's logged metrics, how many forward-only policy passes ran, and the update
    certificate's verdicts (megatron's real Adam under the update check)."""
    record = _Record()
    verdicts: list[bool] = []
    certify = nonfinite.certify_update

    def recorded(*args: Any) -> bool:
        verdicts.append(certify(*args))
        return verdicts[-1]

    nonfinite.certify_update = recorded  # type: ignore[assignment]  # a spy: the real one runs
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=16)),
        max_steps=STEPS,
        gradient_clip_val=1.0,
        callbacks=[record],
    )
    module = GRPOModule(
        loss=ClippedPGLossConfig(reference_policy_kl_penalty=kl),
        rollout=RolloutSpec(max_staleness=staleness),
        prev_logprobs_pass=prev_pass,  # type: ignore[arg-type]
    )
    passes = [0]
    compute = module.compute_logprobs

    def counted(batch: Any, *, teacher: bool = False) -> Any:
        passes[0] += 1
        return compute(batch, teacher=teacher)

    module.compute_logprobs = counted  # type: ignore[method-assign]
    try:
        trainer.fit(module, datamodule=PromptDataModule(num_steps=STEPS))
    finally:
        nonfinite.certify_update = certify  # type: ignore[assignment]
    destroy_megatron_state()
    return record.rows, passes[0], verdicts


def _runs(rank: int) -> dict[str, tuple[list[dict[str, float]], int, list]]:
    return {
        "auto": _fit("auto", 0.05, 0),
        "always": _fit("always", 0.05, 0),
        "async": _fit("auto", 0.0, 1),
    }


@pytest.mark.timeout(240)
def test_prev_logprobs_pass_skipped_exactly_and_kept_async() -> None:
    (runs,) = run_on_ranks(_runs, 1, timeout=220)
    (auto, auto_passes, certified), (always, always_passes, _) = runs["auto"], runs["always"]
    # every ordinary update of megatron's Adam is certified without the exact preview
    assert certified == [True] * STEPS
    # the reference KL's recompute pass runs in both; the prev_logprobs pass in "always" only
    assert (auto_passes, always_passes) == (STEPS, 2 * STEPS)
    assert len(auto) == len(always) == STEPS
    for step, (got, want) in enumerate(zip(auto, always, strict=True)):
        # the same keys: the skipped run logs the mismatch extremes from its training forward
        assert got.keys() == want.keys(), step
        # bitwise: the pass computes the training forward's logprobs, so its ratio is 1 exactly
        assert got == want, step
        assert got["train_probs_ratio"] == 1.0 and got["train_clip_fraction"] == 0.0
    assert min(row["train_kl_penalty"] for row in auto[1:]) > 0.0
    # asynchronous rollouts keep the pass (the batch is trained by newer weights than sampled it)
    rows, passes, _ = runs["async"]
    assert passes == STEPS and len(rows) == STEPS
    assert all("gen_train_ratio_max" in row for row in rows)
