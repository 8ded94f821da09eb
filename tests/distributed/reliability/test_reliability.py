"""Reliability under real ``Trainer.fit`` runs on 2 gloo ranks: the non-finite policy, bounded
failure, ``last.ckpt`` across an interrupted replacement, rejected batches (fuzzed)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import shutil
from pathlib import Path

from _reliability_runs import (
    BAD_CASES,
    full_run_rank,
    fuzz_rank,
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
