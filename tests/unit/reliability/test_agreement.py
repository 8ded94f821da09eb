"""Host-side pieces of the agreement and update checks: the agreement table's verdicts and
messages, the batch fingerprint, the position-table check, the update snapshot/restore and
failure rule, the collapse counter, the rewards mask, and the config fields' validation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_mcore_rl.algorithms.advantages import nonfinite_reward_groups
from lightning_mcore_rl.losses import ClippedPGLossConfig
from lightning_mcore_rl.reliability.agreement import (
    INVALID,
    NONFINITE,
    OK,
    BatchMismatchError,
    agreed_verdict,
    check_replica_agreement,
)
from lightning_mcore_rl.reliability.nonfinite import CollapseWarning, NonFiniteGuard
from lightning_mcore_rl.reliability.update_check import (
    UpdateSnapshot,
    _difference_norms,
    update_failure,
    update_measures,
)
from lightning_mcore_rl.strategy import ReliabilityConfig
from lightning_mcore_rl.train.validation import (
    BatchSpec,
    batch_fingerprint,
    batch_summary,
    validate_batch,
)


def _table(*rows: tuple[int, int, int, int, int]) -> torch.Tensor:
    """``[world, 7]``: each row's signal and step-time columns 0 (no training step's first pass)."""
    return torch.tensor([(*row, 0, 0) for row in rows], dtype=torch.int64)


def test_the_agreement_table_gives_the_max_verdict_or_names_what_differs():
    # TP=2 x DP=2: ranks 0, 1 are replica 0, ranks 2, 3 replica 1 (other data: fine)
    good = _table((OK, 0, 4, 12, 7), (NONFINITE, 0, 4, 12, 7), (OK, 1, 4, 10, 9), (OK, 1, 4, 10, 9))
    assert agreed_verdict(good) == NONFINITE
    rejected = _table((INVALID, 0, 0, 0, 0), (OK, 0, 4, 12, 7))
    assert agreed_verdict(rejected) == INVALID  # no comparison: that rank raises its own error
    rows = _table((OK, 0, 4, 12, 7), (OK, 1, 2, 12, 7))
    with pytest.raises(BatchMismatchError, match=r"different numbers of rows \(rank 0: 4, rank "
                       r"1: 2\).*equal share of the global batch"):  # fmt: skip
        agreed_verdict(rows)
    data = _table((OK, 0, 4, 12, 7), (OK, 1, 4, 12, 8), (OK, 0, 4, 12, 7), (OK, 1, 4, 12, 9))
    with pytest.raises(BatchMismatchError, match=r"The ranks \[1, 3\] of model replica 1 .* "
                       r"different contents \(fingerprints\) \(rank 1: 0x8, rank 3: 0x9\)"):  # fmt: skip
        agreed_verdict(data)
    width = _table((OK, 0, 4, 12, 7), (OK, 0, 4, 11, 7))
    with pytest.raises(BatchMismatchError, match=r"different widths S \(rank 0: 12, rank 1: 11\)"):
        agreed_verdict(width)


def test_the_rollout_agreement_compares_rows_within_a_replica_only():
    # TP=2 x DP=2: the replicas may sample different numbers of prompts, one replica's ranks not
    check_replica_agreement(_table((OK, 0, 8, 5, 7), (OK, 0, 8, 5, 7), (OK, 1, 4, 6, 3),
                                   (OK, 1, 4, 6, 3)))  # fmt: skip
    rows = _table((OK, 0, 8, 5, 7), (OK, 0, 4, 5, 7))
    with pytest.raises(BatchMismatchError, match=r"^Before the rollout: The ranks \[0, 1\] of "
                       r"model replica 0 .* different numbers of rows \(rank 0: 8, rank 1: 4\); "
                       r"they must hold the same batch"):  # fmt: skip
        check_replica_agreement(rows, "Before the rollout: ")
    data = _table((OK, 0, 8, 5, 7), (OK, 0, 8, 5, 9))
    with pytest.raises(BatchMismatchError, match=r"different contents \(fingerprints\)"):
        check_replica_agreement(data)


def _batch(seed: int = 0, rows: int = 4, width: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 50, (rows, width), generator=g),
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, width, generator=g),
        "teacher_topk_logits": torch.randn(rows, width, 3, generator=g),
    }


def test_the_fingerprint_sees_content_order_and_float_bits_but_not_wide_payloads():
    base = _batch()
    assert batch_fingerprint(base) == batch_fingerprint({k: v.clone() for k, v in base.items()})
    assert 0 <= batch_fingerprint(base) < 2**62
    assert batch_fingerprint(_batch(1)) != batch_fingerprint(base)
    swapped = dict(base, input_ids=base["input_ids"][[1, 0, 2, 3]])
    assert batch_fingerprint(swapped) != batch_fingerprint(base)  # rows moved
    one_bit = base["advantages"].clone()
    one_bit.view(torch.int32)[2, 3] ^= 1  # the last mantissa bit of one float
    assert batch_fingerprint(dict(base, advantages=one_bit)) != batch_fingerprint(base)
    nan = base["advantages"].clone()
    nan[0, 0] = float("nan")
    assert batch_fingerprint(dict(base, advantages=nan)) == batch_fingerprint(
        dict(base, advantages=nan.clone())
    )
    wide = dict(base, teacher_topk_logits=torch.zeros(4, 6, 3))
    assert batch_fingerprint(wide) == batch_fingerprint(base)  # [B, S, K] left out
    # hand-computed: one key, ids [[1, 2], [3, 4]] -> 1*1 + 2*2 + 3*3 + 4*4 = 30
    assert batch_fingerprint({"input_ids": torch.tensor([[1, 2], [3, 4]])}) == 30
    summary = batch_summary(base, BatchSpec())
    assert (summary.rows, summary.width) == (4, 6)


def test_rows_longer_than_the_position_table_are_rejected_on_the_host():
    spec = BatchSpec(max_positions=5)
    with pytest.raises(ValueError, match=r"`input_ids` has S=6 positions \(shape \[4, 6\]\) but "
                       r"the model's learned position table holds max_sequence_length=5"):  # fmt: skip
        validate_batch(_batch(), spec)
    assert validate_batch(_batch(width=5), spec) is None
    assert validate_batch(_batch(), BatchSpec(max_positions=None)) is None


def _adam() -> tuple[SimpleNamespace, list[torch.Tensor]]:
    """A megatron-like member (``.optimizer``: a torch optimizer) over two parameters."""
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    return SimpleNamespace(optimizer=torch.optim.Adam(params, lr=0.1)), params


def _step(member: SimpleNamespace, params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    member.optimizer.step()


def test_a_snapshot_restores_parameters_and_adam_state_bitwise():
    member, params = _adam()
    # before the first step (no Adam state yet): restore removes the state the step created
    snap = UpdateSnapshot.take(member, params)
    first = [p.detach().clone() for p in params]
    _step(member, params)
    snap.restore()
    assert all(torch.equal(p, f) for p, f in zip(params, first, strict=True))
    assert len(member.optimizer.state) == 0
    _step(member, params)
    after_one = [p.detach().clone() for p in params]
    moments = {k: v.clone() for k, v in member.optimizer.state[params[0]].items()}
    snap = UpdateSnapshot.take(member, params)
    _step(member, params)
    snap.restore()
    assert all(torch.equal(p, a) for p, a in zip(params, after_one, strict=True))
    state = member.optimizer.state[params[0]]
    assert all(torch.equal(state[k], v) for k, v in moments.items())  # step, exp_avg, exp_avg_sq


def test_update_measures_equal_plain_torch_and_count_non_finite_tensors():
    """One rank, no process group: the non-finite count, ||update|| and ||parameters before||
    against plain torch (fp64), the difference norms also in pieces smaller than a tensor."""
    member, params = _adam()
    _step(member, params)
    snap = UpdateSnapshot.take(member, params)
    before = [p.detach().double().clone() for p in params]
    _step(member, params)
    count, delta, norm = update_measures(snap, "cpu", None)
    after = [p.detach().double() for p in params]
    expected_delta = math.sqrt(
        sum(float((a - b).square().sum()) for a, b in zip(after, before, strict=True))
    )
    expected_norm = math.sqrt(sum(float(b.square().sum()) for b in before))
    assert count == 0.0
    assert delta == pytest.approx(expected_delta, rel=1e-6)
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    pieces = _difference_norms(params, snap.copies[: len(params)], chunk=5)  # 6 and 4 elements
    whole = _difference_norms(params, snap.copies[: len(params)])
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=0.0)
    with torch.no_grad():
        params[1][2] = math.inf
    member.optimizer.state[params[0]]["exp_avg"][0, 1] = math.nan
    count, delta, _ = update_measures(snap, "cpu", None)
    assert count == 2.0 and math.isinf(delta)


def test_the_update_failure_rule():
    assert update_failure((0.0, 1.0, 1.0), 1e3) is None
    assert "non-finite weights or optimizer state" in update_failure((2.0, 1.0, 1.0), 1e3)
    assert "non-finite" in update_failure((0.0, math.nan, 1.0), None)
    big = update_failure((0.0, 2e3, 1.0), 1e3)
    assert "an update of norm 2e+03, 2e+03 times the parameters' norm 1" in big
    assert "max_update_ratio=1000): the learning rate overflows" in big
    assert update_failure((0.0, 2e3, 1.0), None) is None
    assert update_failure((0.0, 5.0, 0.0), 1e3) is None  # all-zero parameters: no ratio


def test_the_collapse_warning_counts_consecutive_exact_zeros():
    guard = NonFiniteGuard(collapse_warning_steps=3)

    def step(guard: NonFiniteGuard, norm: float) -> None:
        guard.check_update(lambda _: SimpleNamespace(update_successful=True, grad_norm=norm))

    for norm in (0.0, 0.0, 1e-12, 0.0, 0.0):  # a non-zero norm restarts the count
        step(guard, norm)
    with pytest.warns(CollapseWarning, match="exactly 0 for 3 consecutive steps"):
        step(guard, 0.0)
    assert guard.zero_grad_steps == 3
    silent = NonFiniteGuard(collapse_warning_steps=None)
    for _ in range(10):
        step(silent, 0.0)


def test_non_finite_rewards_mark_their_whole_group():
    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0, 0.5, float("inf")])
    assert nonfinite_reward_groups(rewards, 2).tolist() == [False, False, True, True, True, True]
    with pytest.raises(ValueError, match=r"`rewards` must be 1-D \[B\*G\] with G=4"):
        nonfinite_reward_groups(rewards, 4)


def test_the_new_fields_are_typed_and_range_checked():
    with pytest.raises(TypeError, match="`verify_updates` must be a bool"):
        ReliabilityConfig(verify_updates=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`max_update_ratio` must be a finite number > 0"):
        ReliabilityConfig(max_update_ratio=float("nan"))
    with pytest.raises(ValueError, match=r"`max_update_ratio` must be a finite number > 0"):
        ReliabilityConfig(max_update_ratio=0.0)
    with pytest.raises(TypeError, match="`max_update_ratio` must be a number or None"):
        ReliabilityConfig(max_update_ratio="big")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`collapse_warning_steps` must be >= 1 or None"):
        ReliabilityConfig(collapse_warning_steps=0)
    with pytest.raises(TypeError, match="`collapse_warning_steps` must be an int or None"):
        ReliabilityConfig(collapse_warning_steps=2.0)  # type: ignore[arg-type]
    config = ReliabilityConfig(max_update_ratio=None, collapse_warning_steps=None)
    guard = NonFiniteGuard.from_config(config)
    assert (guard.max_update_ratio, guard.collapse_warning_steps) == (None, None)


def test_loss_config_floats_reject_nan_and_inf():
    with pytest.raises(ValueError, match=r"`ClippedPGLossConfig.ratio_clip_max` must be a finite "
                       r"number, got nan"):  # fmt: skip
        ClippedPGLossConfig(ratio_clip_max=float("nan"))
    with pytest.raises(ValueError, match=r"`ClippedPGLossConfig.kl_input_clamp_value` must be a "
                       r"finite number, got inf"):  # fmt: skip
        ClippedPGLossConfig(kl_input_clamp_value=float("inf"))
