"""Reliability under real ``Trainer.fit`` runs on 2 gloo ranks: the non-finite policy, bounded
failure, ``last.ckpt`` across an interrupted replacement, rejected batches (fuzzed)."""

from __future__ import annotations

import errno
import math
import multiprocessing as mp
import os
import re
import shutil
from pathlib import Path

from _reliability_runs import (
    BAD_CASES,
    CONTINUE_CASES,
    CONTINUE_STEPS,
    bitwise_equal,
    full_disk_rank,
    full_run_rank,
    fuzz_rank,
    nonfinite_continue_rank,
    nonfinite_rank,
    resume_last_rank,
    timeout_rank,
)

from lightning_mcore_rl.strategy import checkpoint as ckpt
from lightning_mcore_rl.testing import run_on_ranks


def test_nonfinite_steps_are_skipped_on_every_rank_without_any_change():
    results = run_on_ranks(nonfinite_rank, 2, timeout=150)
    for rank, out in enumerate(results):
        # step 1 (+inf advantages on rank 1 only) skipped on both ranks, bitwise unchanged.
        assert out["skip_unchanged"] == [False, True, False], rank
        assert out["skipped_logged"] == [None, 1.0, 1.0], rank
        assert out["global_step"] == 3 and out["finite_after"]
        # a NaN weight: skipped by the gradient check, bitwise unchanged, error after 2 in a row
        assert out["weight_unchanged"] == [False, True, True], rank
        assert re.search(r"NonFiniteError: 3 consecutive training steps skipped by "
                         r"`nonfinite='skip'` \(max_consecutive_skips=2\).*non-finite loss",
                         out["weight_error"]), out["weight_error"]  # fmt: skip
        assert re.search(r"NonFiniteError: Training step stopped by `nonfinite='raise'`",
                         out["raise_error"]), out["raise_error"]  # fmt: skip
    assert results[0]["loss_logged"] == results[1]["loss_logged"]
    assert re.search(r"non-finite input `advantages`\[1, 5\] = inf on this rank",
                     " ".join(results[1]["warnings"]))  # fmt: skip
    assert "another data-parallel rank" in " ".join(results[0]["warnings"])
    assert "`prev_logprobs`[0, 5] = -inf" in results[1]["raise_error"]


def test_training_continues_after_skipped_steps_exactly_as_without_the_bad_batches():
    """Per input case (+inf `advantages`, NaN and -inf `prev_logprobs`, each on ONE rank) the
    step is skipped on both ranks with no parameter/Adam-state change, `skipped_steps` counts it,
    and every later step equals, bitwise, the run that never saw the bad batches."""
    results = run_on_ranks(nonfinite_continue_rank, 2, timeout=150)
    bad_steps = [step for step, *_ in CONTINUE_CASES]
    good_steps = [k for k in range(CONTINUE_STEPS) if k not in bad_steps]  # 0, 2, 4, 6
    for rank, out in enumerate(results):
        bad, ref = out["bad"], out["reference"]
        assert bad["global_step"] == CONTINUE_STEPS and ref["global_step"] == len(good_steps)
        assert [s[0] for s in bad["steps"]] == [k in bad_steps for k in range(CONTINUE_STEPS)]
        assert not any(s[0] for s in ref["steps"])
        # a skipped step: parameters and Adam moments bitwise unchanged, no loss/grad norm
        assert bad["unchanged"] == [k in bad_steps for k in range(CONTINUE_STEPS)], rank
        assert all(bad["steps"][k][1:] == (None, None) for k in bad_steps)
        # skipped_steps logged from the first skip on, counting each case once
        assert bad["skipped_logged"] == [None, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0], rank
        assert all(m is None for m in ref["skipped_logged"])
        # the step after each bad one (and every good step) == the reference's, bitwise:
        # (skipped, loss, grad norm) as Python floats, then parameters + Adam state after it
        for ref_step, k in enumerate(good_steps):
            assert bad["steps"][k] == ref["steps"][ref_step], (rank, k, ref_step)
            assert bitwise_equal(bad["after"][k], ref["after"][ref_step]), (rank, k)
            assert math.isfinite(bad["steps"][k][1]) and math.isfinite(bad["steps"][k][2])
    for step, row, key, value in CONTINUE_CASES:
        holder, index = row % 2, (row % 4) // 2
        told = [w for w in results[holder]["bad"]["warnings"]
                if f"`{key}`[{index}, 5] = {value} on this rank" in w]  # fmt: skip
        assert len(told) == 1, (step, key, results[holder]["bad"]["warnings"])
    assert len(results[0]["bad"]["warnings"]) == len(results[1]["bad"]["warnings"]) == 3
    assert results[0]["bad"]["steps"] == results[1]["bad"]["steps"]
    print("steps (skipped, loss, grad norm):", results[0]["bad"]["steps"])


def test_a_full_disk_is_reported_with_the_free_space_and_keeps_the_previous_checkpoint(tmp_path):
    """A full disk cannot be produced here: the OSError(ENOSPC) is injected where the bytes are
    written (``torch.save`` of ``common.pt``; megatron's shard writer in its forked workers)."""
    [out] = run_on_ranks(full_disk_rank, 1, str(tmp_path), timeout=120)
    message = r"The disk is full: saving checkpoint .*{} failed \([0-9.]+ MiB free on the file"
    assert out["listing_before"] == ["last.ckpt", "step=1.ckpt"]
    # (a) trainer.save_checkpoint over last.ckpt, common.pt's torch.save fails
    assert out["save_error"] is not None and out["save_error"][0] == errno.ENOSPC
    assert re.search(message.format("last.ckpt"), out["save_error"][1]), out["save_error"]
    assert out["listing_after_save"] == out["listing_before"]  # no .last.ckpt.tmp left
    assert out["after_save"] == out["before"]  # last.ckpt and step=1.ckpt byte for byte
    # (b) ModelCheckpoint's step-2 save, the shard files fail after part of their bytes
    name, code, text = out["fit_error"]
    assert (name, code) == ("OSError", errno.ENOSPC), out["fit_error"]
    assert re.search(message.format("step=2.ckpt"), text), text
    assert out["listing_after_fit"] == out["listing_before"]  # no .step=2.ckpt.tmp, no step=2
    assert out["after_fit"] == out["before"]
    assert ckpt.is_complete(tmp_path / "last.ckpt")
    assert out["resumed_steps"] == [2], "resumed from the intact step-1 last.ckpt"
    print(out["save_error"][1], "|", text, sep="\n")


def test_a_failed_rank_bounds_the_others_by_the_strategy_timeout():
    seconds = 5.0
    results = run_on_ranks(timeout_rank, 2, seconds, timeout=90)
    assert "injected failure" in results[1]["error"]
    assert results[0]["error"], "rank 0 must fail, not hang"
    assert results[0]["elapsed"] < seconds + 10, results[0]
    print(f"rank 0 failed after {results[0]['elapsed']:.1f} s with timeout {seconds} s")


def _kill_between_renames(target: str, path: str) -> None:
    """A real process killed (os._exit) between the two renames of the fallback replacement."""
    calls = {"n": 0}
    real = os.replace

    def replace(a, b):  # noqa: ANN001
        calls["n"] += 1
        real(a, b)
        if calls["n"] == 1:
            os._exit(9)

    ckpt._exchange = lambda a, b: False  # the platform without renameat2
    ckpt.os.replace = replace  # type: ignore[attr-defined]
    ckpt.replace_directory(Path(target), Path(path))


def test_a_kill_between_the_renames_keeps_last_and_resume_is_bitwise(tmp_path):
    full_dir = str(tmp_path / "full")
    full = run_on_ranks(full_run_rank, 2, full_dir, timeout=150)
    # the state of a kill while `last.ckpt` (step 2) was replaced by the step-4 save:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    shutil.copytree(f"{full_dir}/step=2.ckpt", crash_dir / "last.ckpt")
    shutil.copytree(f"{full_dir}/step=4.ckpt", crash_dir / ".last.ckpt.tmp")
    shutil.copytree(f"{full_dir}/step=2.ckpt", crash_dir / "step=2.ckpt")
    child = mp.get_context("fork").Process(
        target=_kill_between_renames,
        args=(str(crash_dir / ".last.ckpt.tmp"), str(crash_dir / "last.ckpt")),
    )
    child.start()
    child.join(60)
    assert child.exitcode == 9
    assert not (crash_dir / "last.ckpt").exists()
    assert ckpt.is_complete(crash_dir / ".last.ckpt.old")
    resumed = run_on_ranks(resume_last_rank, 2, str(crash_dir), timeout=150)
    for rank in range(2):
        assert [s[0] for s in resumed[rank]] == [5, 6], "resumed from the newest (step 4)"
        assert resumed[rank] == full[rank][4:], "bitwise equal to the uninterrupted run"


def test_bad_batches_raise_on_every_rank_before_any_collective():
    results = run_on_ranks(fuzz_rank, 2, timeout=240)
    assert results[0]["results"] == results[1]["results"]
    cases = results[0]["results"]
    assert len(cases) >= BAD_CASES * 0.9
    for key, message, collectives in cases:
        assert message.startswith(("ValueError", "TypeError")), (key, message)
        assert key == "empty" or f"`{key}`" in message, (key, message)
        assert collectives == 1, (key, message, collectives)  # the agreement flag only
    assert math.isfinite(results[0]["good_loss"])  # a good batch still trains after them
