"""Every built-in loss's ``input_keys`` are exactly the batch keys it and its input preparation
read: the hand-written list per configuration; the loss runs on the data contract's keys plus
those; without any one of them it raises."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.unit import FakeGroup

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import (
    ClippedPGLossFn,
    DistillationLossFn,
    DPOLossFn,
    DraftCrossEntropyLossFn,
    MseValueLossFn,
    NLLLossFn,
    OPDFullLossFn,
    PreferenceLossFn,
    prepare_loss_input,
)
from lightning_mcore_rl.recipes.ppo import PPOLossFn

B, S, V, K = 2, 6, 11, 3
G1 = FakeGroup()  # size 1: no collective is ever issued
CONTRACT = ("input_ids", "input_lengths", "sample_mask")


def _batch() -> dict[str, torch.Tensor]:
    """Every key a built-in loss reads (a superset of each loss's)."""
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, V, (B, S), generator=g),
        "input_lengths": torch.tensor([S, 4]),
        "sample_mask": torch.ones(B),
        "token_mask": torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]).float(),
        "advantages": torch.randn(B, S, generator=g),
        "prev_logprobs": -2.4 + 0.1 * torch.randn(B, S, generator=g),
        "generation_logprobs": -2.4 + 0.1 * torch.randn(B, S, generator=g),
        "reference_policy_logprobs": -2.4 + 0.1 * torch.randn(B, S, generator=g),
        "rewards": torch.tensor([1.0, 0.0]),
        "returns": torch.randn(B, S, generator=g),
        "values": torch.randn(B, S, generator=g),
        "teacher_topk_logits": torch.randn(B, S, K, generator=g),
        "teacher_topk_indices": torch.stack(
            [torch.randperm(V, generator=g)[:K] for _ in range(B * S)]
        ).view(B, S, K),
        "teacher_full_payload": torch.randn(B, S, V, generator=g),
        "student_logits": torch.randn(B, S, V, generator=g),
    }


def _vocab_logits() -> torch.Tensor:
    return torch.randn(B, S, V, generator=torch.Generator().manual_seed(1))


def _values_logits() -> torch.Tensor:
    return torch.randn(B, S, 1, generator=torch.Generator().manual_seed(1))


def _policy_value_logits() -> torch.Tensor:
    return torch.cat([_vocab_logits(), _values_logits()], dim=-1)


def _scores() -> torch.Tensor:
    return torch.tensor([0.3, -0.2])


PG = ("token_mask", "advantages", "generation_logprobs")
CASES: list[tuple[str, Callable[[], Any], tuple[str, ...], Callable[[], torch.Tensor]]] = [
    ("nll", NLLLossFn, ("token_mask",), _vocab_logits),
    ("pg", ClippedPGLossFn, (*PG, "prev_logprobs", "reference_policy_logprobs"), _vocab_logits),
    (
        "pg_on_policy_no_kl",
        lambda: ClippedPGLossFn({"force_on_policy_ratio": True, "reference_policy_kl_penalty": 0}),
        PG,
        _vocab_logits,
    ),
    (
        "pg_kl_nll",
        lambda: ClippedPGLossFn(
            {"reference_policy_kl_penalty": 0.1, "positive_example_nll_weight": 0.5}
        ),
        (*PG, "prev_logprobs", "reference_policy_logprobs", "rewards"),
        _vocab_logits,
    ),
    ("dpo", DPOLossFn, ("token_mask", "reference_policy_logprobs"), _vocab_logits),
    ("preference", PreferenceLossFn, (), _scores),
    ("value", MseValueLossFn, ("token_mask", "returns"), _values_logits),
    (
        "value_clipped",
        lambda: MseValueLossFn({"cliprange": 0.2}),
        ("token_mask", "returns", "values"),
        _values_logits,
    ),
    (
        "distillation",
        DistillationLossFn,
        ("token_mask", "teacher_topk_logits", "teacher_topk_indices"),
        _vocab_logits,
    ),
    ("opd_full", OPDFullLossFn, ("token_mask", "teacher_full_payload"), _vocab_logits),
    ("draft", DraftCrossEntropyLossFn, ("token_mask", "student_logits"), _vocab_logits),
]


def _ppo() -> PPOLossFn:
    return PPOLossFn(ClippedPGLossFn(), MseValueLossFn({"cliprange": 0.2}))


def _run(loss_fn: Any, logits: torch.Tensor, data: dict[str, torch.Tensor]) -> torch.Tensor:
    if isinstance(loss_fn, PPOLossFn):
        from lightning_mcore_rl.recipes.ppo import prepare_policy_value_input

        loss_input, batch = prepare_policy_value_input(
            logits, BatchedDataDict(data), loss_fn, 0, G1, None
        )
    else:
        loss_input, batch = prepare_loss_input(logits, BatchedDataDict(data), loss_fn, 0, G1, G1)
    loss, _ = loss_fn(batch, float(B), 7.0, **loss_input)  # any positive global counts
    return loss


PPO_KEYS = (*PG, "prev_logprobs", "reference_policy_logprobs", "returns", "values")
ALL = [*CASES, ("ppo", _ppo, PPO_KEYS, _policy_value_logits)]


@pytest.mark.parametrize(("make", "keys", "logits"), [c[1:] for c in ALL], ids=[c[0] for c in ALL])
def test_input_keys_are_exactly_what_the_loss_reads(
    make: Callable[[], Any], keys: tuple[str, ...], logits: Callable[[], torch.Tensor]
) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # OPDFullLossFn warns about a reference KL only
        loss_fn = make()
    assert loss_fn.input_keys == keys
    full = _batch()
    needed = {k: full[k] for k in (*CONTRACT, *keys)}
    assert torch.isfinite(_run(loss_fn, logits(), needed))
    for key in keys:
        without = {k: v for k, v in needed.items() if k != key}
        with pytest.raises((KeyError, ValueError), match=key):
            _run(loss_fn, logits(), without)


def test_opd_full_reads_the_reference_logprobs_with_a_reference_kl() -> None:
    with pytest.warns(UserWarning, match="second KL"):
        loss_fn = OPDFullLossFn({"reference_policy_kl_penalty": 0.1})
    assert loss_fn.input_keys == ("token_mask", "teacher_full_payload", "reference_policy_logprobs")
