"""Exact mid-epoch resume of the GRPO recipe: a new Trainer resumed from the step-3 checkpoint of
an uninterrupted 6-step run repeats steps 4-6 bitwise (sampled tokens, reward, loss, grad norm),
because the prompt loader is a ``ResumableLoader`` and the sampler seed / reference policy are
functions of ``global_step`` / the weight seed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.losses import ClippedPGLossConfig
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule
from lightning_mcore_rl.strategy import MicrobatchConfig, resumable_dataloader
from lightning_mcore_rl.testing import run_on_ranks

STEPS_PER_EPOCH = 4  # steps 1-4 are epoch 0, steps 5-6 epoch 1 (re-permuted)


class _Record(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


@dataclass(frozen=True)
class RecordedFit:
    """Per step: logged metrics, prompts and sampled tokens."""

    rows: list[dict[str, float]]
    prompts: list[torch.Tensor]
    samples: list[torch.Tensor]
    global_step: int


@dataclass(frozen=True)
class ResumeRun:
    """One rank of :func:`_resume`: the uninterrupted fit, the resumed fit, the checkpoints."""

    full: RecordedFit
    resumed: RecordedFit
    files: list[str]


def _fit(tp: int, ckpt_dir: str, ckpt_path: str | None) -> RecordedFit:
    record = _Record()
    callbacks: list[Callback] = [record]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1
            )
        )
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=tp, microbatching=MicrobatchConfig(micro_batch_size=16)
        ),
        max_steps=6,
        gradient_clip_val=1.0,
        enable_checkpointing=ckpt_path is None,
        callbacks=callbacks,
    )
    # reference KL on: the reference policy (regenerated from the seed) must survive the resume
    module = GRPOModule(loss=ClippedPGLossConfig(reference_policy_kl_penalty=0.05))
    prompts: list[torch.Tensor] = []
    samples: list[torch.Tensor] = []
    original = module.make_rollout

    def make_rollout(batch: torch.Tensor) -> Any:
        data, rewards = original(batch)
        prompts.append(batch.clone())
        samples.append(data["input_ids"].clone())
        return data, rewards

    module.make_rollout = make_rollout  # type: ignore[method-assign]
    datamodule = PromptDataModule(num_steps=STEPS_PER_EPOCH)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return RecordedFit(record.rows, prompts, samples, trainer.global_step)


def _resume(rank: int, tp: int, ckpt_dir: str) -> ResumeRun:
    full = _fit(tp, ckpt_dir, None)
    resumed = _fit(tp, ckpt_dir, f"{ckpt_dir}/step=3.ckpt")
    return ResumeRun(full, resumed, sorted(os.listdir(ckpt_dir)))


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_grpo_mid_epoch_resume_is_exact(tp: int, tmp_path):
    results = run_on_ranks(_resume, 2, tp, str(tmp_path / "ckpts"), timeout=180)
    assert results[0].files == ["step=3.ckpt", "step=6.ckpt"]
    for result in results:
        full, resumed = result.full, result.resumed
        assert resumed.global_step == 6 and len(resumed.rows) == 3
        for step in range(3):
            got, want = resumed.rows[step], full.rows[step + 3]
            for key in ("reward", "train_loss", "grad_norm", "train_kl_penalty"):
                assert got[key] == want[key], (step + 4, key, got[key], want[key])
            assert torch.equal(resumed.prompts[step], full.prompts[step + 3])
            assert torch.equal(resumed.samples[step], full.samples[step + 3])
        # no replay: the first resumed step reads other prompts than steps 1-3
        assert not any(torch.equal(resumed.prompts[0], p) for p in full.prompts[:3])
        # epoch 1 (steps 5-6) is a new permutation, not epoch 0's order again
        assert not torch.equal(full.prompts[4], full.prompts[0])
    if tp == 1:  # each DP rank trains on its own prompts
        assert not torch.equal(results[0].full.prompts[0], results[1].full.prompts[0])
    else:  # both TP ranks of the replica read the same prompts
        assert torch.equal(results[0].full.prompts[0], results[1].full.prompts[0])


class _Positions(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.tolist())
        return self.weight * batch.float().sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return resumable_dataloader(torch.arange(8), self.trainer, batch_size=2)


def _positions(ckpt_dir: str, ckpt_path: str | None = None) -> list[list[int]]:
    callbacks = [
        ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    ]
    module = _Positions()
    trainer = cpu_trainer(
        max_steps=10,
        default_root_dir=ckpt_dir,
        enable_checkpointing=ckpt_path is None,
        callbacks=[] if ckpt_path else callbacks,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module.seen


def test_resumable_loader_resumes_mid_epoch_and_at_epoch_ends(tmp_path):
    # 4 batches per epoch: steps 4 and 8 are the last batch of an epoch
    ckpt_dir = str(tmp_path / "ckpts")
    full = _positions(ckpt_dir)
    assert sorted(sum(full[:4], [])) == list(range(8))
    assert full[:4] != full[4:8]  # set_epoch: every epoch is a new permutation
    for step in (2, 4, 5, 8):
        resumed = _positions(str(tmp_path / f"resumed{step}"), f"{ckpt_dir}/step={step}.ckpt")
        assert resumed == full[step:], step


def _grow(
    rank: int, root: str, max_steps: int, ckpt_path: str | None, max_epochs: int | None = None
) -> tuple[int, str]:
    from lightning_mcore_rl.callbacks import MetricsHistory

    history = MetricsHistory(f"{root}/history", plot_keys=("reward",))
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=16)),
        max_steps=max_steps,
        max_epochs=max_epochs,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=f"{root}/ckpts", save_last=True), history],
    )
    trainer.fit(GRPOModule(), datamodule=PromptDataModule(num_steps=2), ckpt_path=ckpt_path)
    with open(f"{root}/history/metrics.csv") as handle:
        return trainer.global_step, handle.read()


def test_resume_with_a_larger_max_steps_continues_and_keeps_the_metrics_history(tmp_path):
    # The first fit ends with its epoch (2 steps, an end-of-epoch checkpoint); resumed with
    # max_steps=4 and no max_epochs, Lightning's semantics train 2 more steps (a new epoch).
    # MetricsHistory's rows travel in the checkpoint: the CSV holds steps 0-3, not 2-3 only.
    root = str(tmp_path)
    (first_step, first_csv), *_ = run_on_ranks(_grow, 1, root, 2, None, timeout=120)
    last = f"{root}/ckpts/last.ckpt"
    (steps, csv), *_ = run_on_ranks(_grow, 1, root, 4, last, timeout=120)
    assert (first_step, steps) == (2, 4)
    first_rows, rows = first_csv.splitlines(), csv.splitlines()
    assert [row.split(",")[0] for row in rows[1:]] == ["0", "1", "2", "3"]
    assert rows[:3] == first_rows  # the first run's rows (and header), unchanged


def test_a_resumed_fit_that_an_epoch_bound_ends_untrained_raises(tmp_path):
    # max_epochs=2 after an end-of-epoch checkpoint: Lightning stops the resumed fit at once (the
    # restored epoch counts as done); exiting 0 would look like a finished run.
    root = str(tmp_path)
    run_on_ranks(_grow, 1, root, 2, None, 1, timeout=120)
    with pytest.raises(RuntimeError, match=r"resumed at global step 2 .* without training a step"):
        run_on_ranks(_grow, 1, root, 4, f"{root}/ckpts/last.ckpt", 2, timeout=120)
