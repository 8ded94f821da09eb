"""Checkpoints through ``ModelCheckpoint`` + ``fit(ckpt_path=...)``: exact mid-epoch resume
(model, megatron optimizer, LR scheduler, loops, resumable loader), cross-layout validation and
atomic saves."""

from __future__ import annotations

from dataclasses import replace

from _strategy_runs import ResumeResult, atomic_save_rank, resume_rank, validate_rank
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks

SPEC = RunSpec(steps=6, rows=48, global_batch=4)


def _assert_resume_exact(result: ResumeResult) -> None:
    full, resumed = result.full, result.resumed
    # Bitwise: the resumed steps 4-6 equal the uninterrupted run's.
    assert resumed.microbatch_losses == full.microbatch_losses[3:]
    assert resumed.grad_norms == full.grad_norms[3:]
    assert resumed.lrs == full.lrs[3:]  # LambdaLR restored
    assert result.global_step == 6


def test_tp2_mid_epoch_resume_is_exact_and_checkpoint_validates_under_tp1(tmp_path):
    ckpt_dir = str(tmp_path / "ckpts")
    results = run_on_ranks(resume_rank, 2, replace(SPEC, tp=2), ckpt_dir, timeout=120)
    for result in results:
        _assert_resume_exact(result)
    assert results[0].files == ["step=3.ckpt", "step=6.ckpt"]  # no temporary directories left
    assert results[0].val_loss == results[1].val_loss
    tp1 = run_on_ranks(validate_rank, 1, replace(SPEC, tp=1), f"{ckpt_dir}/step=6.ckpt")
    assert abs(tp1[0] - results[0].val_loss) <= 1e-6


def test_dp2_distributed_optimizer_resume_is_exact(tmp_path):
    spec = replace(SPEC, distributed_optimizer=True, clip=1.0)
    results = run_on_ranks(resume_rank, 2, spec, str(tmp_path / "ckpts"), timeout=120)
    for result in results:
        _assert_resume_exact(result)
    assert results[0].full.train_loss == results[1].full.train_loss


def test_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    (result,) = run_on_ranks(atomic_save_rank, 1, str(tmp_path / "step=1.ckpt"))
    assert result.error  # the second save failed (unpicklable common state)
    assert result.loaded == {"value": 1}
