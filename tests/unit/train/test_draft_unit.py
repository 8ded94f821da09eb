"""The draft path's host-side pieces: the top-1 agreement metric and the deferred count of
``DraftLossWrapper`` on a hand-derived case, the next-token shift that never crosses a packed
sequence, unpacking a packed row, and the argument errors."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.extensions.eagle_draft import next_token_ids, unpack_rows
from lightning_mcore_rl.losses import (
    DraftLossWrapper,
    NLLLossFn,
    prepare_loss_input,
    wrap_loss_fn_with_input_preparation,
)
from lightning_mcore_rl.models.draft_model import eagle_draft
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt_config
from lightning_mcore_rl.train import ParallelGroups, StepContext


def _case() -> tuple[torch.Tensor, BatchedDataDict]:
    """B = 1, S = 3, V = 2, token_mask [0, 1, 1]: N_t = 2 (tokens 1 and 2).

    Policy logits z: argmax 1, 0, 1 at positions 0, 1, 2. The teacher is z rolled left: position
    0 <- z_1 (argmax 0), position 1 <- z_2 (argmax 1); the rolled mask [1, 1, 0] scores those two.
    Student argmax: 0, 0, 1 -> agrees at position 0 only: agreement 1 / N_t = 0.5.
    """
    z = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]])
    data = BatchedDataDict(
        input_ids=torch.tensor([[0, 1, 1]]),
        token_mask=torch.tensor([[0.0, 1.0, 1.0]]),
        sample_mask=torch.tensor([1.0]),
        student_logits=torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 5.0]]]),
    )
    return z, data


def _wrapper(data: BatchedDataDict, draft_valid_toks: float | None) -> DraftLossWrapper:
    policy = functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=NLLLossFn())
    return DraftLossWrapper(
        policy, prepare_loss_input, data, 1.0, draft_valid_toks=draft_valid_toks
    )


def test_top1_agreement_is_the_token_mean_of_matching_argmaxes() -> None:
    z, data = _case()
    _, metrics = _wrapper(data, None)(z, data, 1.0, 2.0)
    assert float(metrics["draft_top1_agreement"]) == 0.5


def test_expected_acceptance_is_the_token_mean_of_the_overlap() -> None:
    # two classes: softmax([a, b]) = [sig(a - b), sig(b - a)]. Position 0: p = softmax([2, 0]),
    # q = softmax([1, 0]): sum min = sig(1) + (1 - sig(2)). Position 1: p = softmax([0, 3]),
    # q = softmax([1, 0]): sum min = sig(-3) + sig(-1). Mean over N_t = 2.
    z, data = _case()
    _, metrics = _wrapper(data, None)(z, data, 1.0, 2.0)
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    expected = (sig(1) + 1 - sig(2) + sig(-3) + sig(-1)) / 2
    assert float(metrics["draft_expected_acceptance"]) == pytest.approx(expected, rel=1e-6)


def test_deferred_count_returns_raw_sums() -> None:
    z, data = _case()
    _, normalised = _wrapper(data, None)(z, data, 1.0, 2.0)
    _, raw = _wrapper(data, 1.0)(z, data, 1.0, 2.0)
    # raw = the sum over the 2 scored positions = N_t x the normalised mean (masked_mean's 1e-8)
    assert float(raw["draft_top1_agreement"]) == 1.0
    assert float(raw["draft_loss"]) == pytest.approx(2 * float(normalised["draft_loss"]), rel=1e-7)


def test_next_token_ids_never_cross_a_packed_sequence() -> None:
    assert torch.equal(next_token_ids(torch.tensor([[1, 2, 3]]), None), torch.tensor([[2, 3, 0]]))
    packed = torch.tensor([[1, 2, 3, 4, 5, 6]])
    cu = torch.tensor([0, 3, 6])
    assert torch.equal(next_token_ids(packed, cu), torch.tensor([[2, 3, 0, 5, 6, 0]]))


def test_unpack_rows_restores_the_padded_layout() -> None:
    packed = torch.arange(12.0).view(1, 6, 2)  # spans [0, 4), [4, 6)
    rows = unpack_rows(packed, torch.tensor([0, 4, 6]), width=3)
    expected = torch.tensor(
        [[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], [[8.0, 9.0], [10.0, 11.0], [0.0, 0.0]]]
    )
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("aux", [(), (1, 1), (2,), (-1,)])
def test_draft_rejects_bad_aux_layers(aux: tuple[int, ...]) -> None:
    message = (
        f"`aux_layers` must be distinct decoder-layer indices in [0, 2) of the policy, got {aux!r}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        eagle_draft(tiny_gpt_config(num_layers=2), vocab_size=16, aux_layers=aux)


def test_step_context_rejects_a_draft_without_train_draft_or_with_fused_logprobs() -> None:
    with pytest.raises(ValueError, match="a `draft_model` needs `train_draft=True`"):
        StepContext(groups=ParallelGroups.single(), draft_model=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="`use_fused_linear_logprobs=True` never forms"):
        StepContext(
            groups=ParallelGroups.single(), train_draft=True, use_fused_linear_logprobs=True
        )
