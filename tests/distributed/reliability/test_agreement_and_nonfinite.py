"""Cross-rank agreement (row counts, batch fingerprints, the position table) and the non-finite
policy for rewards, weights, optimizer state and an overflowing learning rate, on 2 gloo ranks
under real ``Trainer.fit`` runs (the GRPO recipe for the rewards and the learning rate)."""

from __future__ import annotations

import math
import re

from _agreement_runs import (
    bf16_huge_lr_rank,
    collapse_rank,
    corrupt_adam_rank,
    dp_rows_rank,
    huge_lr_rank,
    mismatch_rank,
    nan_reward_rank,
)

from lightning_mcore_rl.testing import run_on_ranks


def test_tp_ranks_with_different_batches_raise_on_both_before_the_step():
    results = run_on_ranks(mismatch_rank, 2, timeout=150)
    for rank, out in enumerate(results):
        assert out["same"][0] == "", out["same"]  # equal batches train
        for case in ("data", "rows", "width", "positions"):
            message, collectives, _ = out[case]
            assert collectives == 1, (rank, case, out[case])  # the agreement collective only
        message = out["data"][0]
        assert message.startswith("BatchMismatchError: The ranks [0, 1] of model replica 0"), (
            message
        )
        assert "different contents (fingerprints)" in message
        assert "different numbers of rows (rank 0: 2, rank 1: 4)" in out["rows"][0], out["rows"]
        assert "different widths S (rank 0: 12, rank 1: 11)" in out["width"][0], out["width"][0]
        assert re.search(r"ValueError: `input_ids` has S=65 positions .* learned position table "
                         r"holds max_sequence_length=64", out["positions"][0]), out["positions"]  # fmt: skip
    for case in ("data", "rows", "width"):
        assert results[0][case][0] == results[1][case][0]  # the same message on both ranks
    # only rank 1's rows are too wide: rank 0 (whose traceback the others point to) names the
    # cause, and rank 1's own error is rank-local (its traceback printed, not a pointer)
    message0, local0, collectives0 = results[0]["positions_rank1"]
    message1, local1, collectives1 = results[1]["positions_rank1"]
    assert message0.startswith("BatchRejectedError: Another rank rejected its batch (rank 1: "
                               "ValueError: `input_ids` has S=65 positions"), message0  # fmt: skip
    assert "learned position table holds max_sequence_length=64" in message0, message0
    assert message1.startswith("ValueError: `input_ids` has S=65 positions"), message1
    assert (local0, local1) == (False, True)
    assert collectives0 == collectives1 == 2  # the agreement, then (mixed verdicts) the reasons


def test_dp_ranks_with_different_row_counts_raise_on_both_at_once():
    results = run_on_ranks(dp_rows_rank, 2, timeout=150)
    for out in results:
        assert "BatchMismatchError: The ranks hold different numbers of rows (rank 0: 4, " \
               "rank 1: 2)" in out["error"], out["error"]  # fmt: skip
        # the strategy's timeout is 120 s; 5 s of load margin over the fit's set-up (~1-3 s)
        assert out["seconds"] < 30, out
    print("seconds to the error:", [round(o["seconds"], 1) for o in results])


def test_a_nan_reward_on_one_rank_skips_the_step_on_both():
    results = run_on_ranks(nan_reward_rank, 2, timeout=240)
    for rank, out in enumerate(results):
        assert out["error"] == "" and out["global_step"] == 3, out["error"]
        assert [s[0] for s in out["steps"]] == [False, True, False], rank
        assert out["unchanged"] == [False, True, False], rank  # bitwise: params + Adam state
        assert out["skipped_logged"] == [None, 1.0, 1.0], rank
        assert out["steps"][1][1] is None and math.isfinite(out["steps"][2][1])
    assert any("Non-finite rewards on this rank: completions [2] = [nan]; the advantages of "
               "their groups (completions [0, 1, 2, 3]) are NaN" in w
               for w in results[1]["warnings"]), results[1]["warnings"]  # fmt: skip
    assert any("non-finite input `advantages`[0, 0] = nan on this rank" in w
               for w in results[1]["warnings"]), results[1]["warnings"]  # fmt: skip
    assert any("another data-parallel rank" in w for w in results[0]["warnings"])


def test_an_overflowing_lr_is_rejected_and_stops_after_the_limit():
    """lr=1e8 leaves finite weights (|w| ~ 1e8) whose next forward is NaN (the issue's
    `torch.multinomial` crash): the update is rejected by its size, before it runs."""
    results = run_on_ranks(huge_lr_rank, 2, timeout=240)
    for rank, out in enumerate(results):
        assert re.search(r"NonFiniteError: 3 consecutive training steps skipped .*"
                         r"max_consecutive_skips=2.* times the parameters' norm .*"
                         r"max_update_ratio=1000\): the learning rate overflows", out["error"]), \
            out["error"]  # fmt: skip
        assert [s[0] for s in out["steps"]] == [True, True], rank  # the 3rd raised
        assert all(math.isfinite(s[1]) for s in out["steps"])  # finite grads: the lr is the cause
        # at each step's end (where ModelCheckpoint saves) parameters + Adam state bitwise the
        # initial ones: nothing of the update is kept, saved or seen by the next rollout
        assert out["unchanged"] == [True, True] and out["first_is_last"], rank
        assert out["skipped_logged"] == [1.0, 2.0], rank
    assert results[0]["error"] == results[1]["error"]


def test_non_finite_weights_from_a_corrupt_adam_state_on_one_rank_are_rejected_on_both():
    results = run_on_ranks(corrupt_adam_rank, 2, timeout=240)
    for rank, out in enumerate(results):
        assert [s[0] for s in out["steps"]] == [False, True], rank
        assert out["unchanged"][1], rank  # bitwise: the update not run, the corrupt moment kept
        assert re.search(r"NonFiniteError: 2 consecutive training steps skipped .*non-finite "
                         r"weights or optimizer state after the update \(\d+ tensors with "
                         r"NaN/inf over all ranks\); the update was not applied", out["error"]), \
            out["error"]  # fmt: skip


def test_bf16_updates_are_rejected_before_they_run_or_undone_after():
    """bf16-mixed, lr=1e8 at DP=2: with torch's AdamW (ZeRO shards and plain DDP) the update is
    previewed and never run; with an inner optimizer the preview does not know, it runs and is
    undone. Either way the bf16 weights, fp32 main weights and Adam state end each step bitwise
    as they began, and the fit, shorter than `max_consecutive_skips`, fails at its end."""
    results = run_on_ranks(bf16_huge_lr_rank, 2, timeout=240)
    for rank, out in enumerate(results):
        for name, how in (("zero", "not applied"), ("ddp", "not applied"),
                          ("snapshot", "undone")):  # fmt: skip
            assert out[name]["steps"] == [(True, True), (True, True)], (rank, name, out[name])
            warnings = out[name]["warnings"]
            assert len(warnings) == 2 and all("the learning rate overflows" in w and
                                              f"the update was {how}" in w for w in warnings), \
                (rank, name, warnings)  # fmt: skip
            # the fit ended before max_consecutive_skips=3, every step skipped: not exit 0
            assert out[name]["error"].startswith(
                "NonFiniteError: Every training step of this fit was skipped (2 of 2; the last: "
            ), (rank, name, out[name]["error"])
            assert "the learning rate overflows" in out[name]["error"]


def test_a_zero_gradient_norm_for_n_steps_warns_once():
    steps, after = 4, 3  # ReliabilityConfig(collapse_warning_steps=3)
    results = run_on_ranks(collapse_rank, 2, steps, after, timeout=150)
    for out in results:
        assert out["grad_norms"] == [0.0] * steps
        assert len(out["warnings"]) == 1, out["warnings"]  # once per streak, at step 3
        assert out["warnings"][0].startswith(
            "The gradient norm has been exactly 0 for 3 consecutive steps"
        )
