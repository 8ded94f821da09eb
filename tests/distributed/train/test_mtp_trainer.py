"""Multi-token prediction through the Trainer: ``SFTModule(model=TinyGPTSpec(mtp_num_layers=1))``
logs ``train_mtp_loss`` every step (declared ``TOKENS``: the global token mean), the MTP term
falls as it trains, the first step's policy loss is the one of the same model without MTP
layers (bitwise: the same decoder, head and batch), and TP=2 logs the TP=1 values."""

from __future__ import annotations

import math

import pytest
from _mtp_trainer_runs import tensor_parallel, with_and_without

from lightning_mcore_rl.testing import run_on_ranks

STEPS = 6


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_on_ranks(with_and_without, 1, STEPS, timeout=240)[0]


def test_mtp_loss_is_logged_and_falls(runs: dict) -> None:
    mtp = [row["train_mtp_loss"] for row in runs["mtp"]]
    assert len(mtp) == STEPS
    print("mtp_loss", mtp)
    assert abs(mtp[0] - math.log(16)) < 0.5  # random weights, V = 16
    assert mtp[-1] < mtp[0] - 0.3


def test_first_policy_loss_is_unchanged_by_mtp(runs: dict) -> None:
    assert runs["mtp"][0]["train_loss"] == runs["plain"][0]["train_loss"]
    assert "train_mtp_loss" not in runs["plain"][0]


def test_tensor_parallel_logs_the_single_rank_values(runs: dict) -> None:
    results = run_on_ranks(tensor_parallel, 2, 4, timeout=240)
    assert results[0] == results[1]
    for key in ("train_loss", "train_mtp_loss"):
        got = [row[key] for row in results[0]]
        want = [row[key] for row in runs["mtp"][:4]]
        print(key, max(abs(a - b) for a, b in zip(got, want, strict=True)))
        assert got == pytest.approx(want, abs=1e-5), key
