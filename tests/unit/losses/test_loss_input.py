"""prepare_loss_input / prepare_packed_loss_input / _pack_input_ids on one process.

A size-1 fake group stands for the TP and CP groups (the ops never communicate at size 1), so
every branch is checked against plain torch on full-vocab logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.unit import FakeGroup

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import (
    ClippedPGLossFn,
    DistillationLossFn,
    DraftCrossEntropyLossFn,
    MseValueLossFn,
    NLLLossFn,
    OPDFullLossFn,
    _prepare_opd_full_loss_input,
    prepare_loss_input,
    prepare_packed_loss_input,
)
from lightning_mcore_rl.losses.loss_input import _pack_input_ids
from lightning_mcore_rl.ops import TrainingSamplingParams

B, S, V = 2, 6, 11
G1 = FakeGroup()  # size 1: no collective is ever issued


def _data(seed: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    return BatchedDataDict(
        input_ids=torch.randint(0, V, (B, S), generator=g),
        input_lengths=torch.tensor([S, 4]),
        token_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]).float(),
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, S, generator=g),
        prev_logprobs=-2.4 + 0.1 * torch.randn(B, S, generator=g),
        generation_logprobs=-2.4 + 0.1 * torch.randn(B, S, generator=g),
        reference_policy_logprobs=-2.4 + 0.1 * torch.randn(B, S, generator=g),
    )


def _logits(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, S, V, generator=torch.Generator().manual_seed(seed))


def _hand_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_logit_input_is_passed_through_untouched() -> None:
    logits, data = _logits()[..., :1], _data()
    loss_input, out = prepare_loss_input(logits, data, MseValueLossFn())
    assert loss_input["logits"] is logits and out is data


@pytest.mark.parametrize(("group", "chunk"), [(None, None), (G1, None), (G1, 2)])
def test_logprob_input_equals_log_softmax_gather(
    group: FakeGroup | None, chunk: int | None
) -> None:
    logits, data = _logits(), _data()
    loss_input, _ = prepare_loss_input(logits, data, NLLLossFn(), 0, group, None, chunk_size=chunk)
    expected = _hand_logprobs(logits, data["input_ids"])
    assert torch.allclose(loss_input["next_token_logprobs"], expected, atol=1e-6)
    assert list(loss_input) == ["next_token_logprobs"]


def test_fused_linear_logprobs_are_taken_as_is() -> None:
    lp = torch.randn(B, S, dtype=torch.float64)
    loss_input, _ = prepare_loss_input(lp, _data(), NLLLossFn(use_fused_linear_logprobs=True))
    assert loss_input["next_token_logprobs"].dtype == torch.float32
    assert torch.equal(loss_input["next_token_logprobs"], lp.float()[:, : S - 1])


@pytest.mark.parametrize("group", [None, G1])
def test_top_k_masks_neg_inf_and_adds_unfiltered_logprobs_for_the_reference_kl(group) -> None:
    logits, data = _logits(), _data()
    params = TrainingSamplingParams(top_k=3)  # most targets are filtered out -> -inf -> 0
    with pytest.warns(UserWarning, match="removed by top-k/top-p"):
        loss_input, data = prepare_loss_input(
            logits, data, ClippedPGLossFn({"reference_policy_kl_penalty": 0.1}), 0, group,
            sampling_params=params,
        )  # fmt: skip
    lp = loss_input["next_token_logprobs"]
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    top3 = logits[:, :-1].topk(3, dim=-1)
    kept = (top3.indices == data["input_ids"][:, 1:, None]).any(-1)
    assert torch.equal(lp < 0, kept)  # kept: log-softmax over the top 3 (< 0); filtered: 0
    renormalised = F.log_softmax(top3.values, -1)
    expected = (renormalised * (top3.indices == data["input_ids"][:, 1:, None])).sum(-1)
    assert torch.allclose(lp, expected, atol=1e-6)
    unfiltered = _hand_logprobs(logits, data["input_ids"])
    assert torch.allclose(data["curr_logprobs_unfiltered"], unfiltered, atol=1e-6)


def test_no_unfiltered_logprobs_without_reference_kl_or_filtering() -> None:
    data = _data()
    with pytest.warns(UserWarning):
        prepare_loss_input(
            _logits(), data, ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}), 0, G1,
            sampling_params=TrainingSamplingParams(top_k=1),
        )  # fmt: skip
    prepare_loss_input(_logits(), data, ClippedPGLossFn(), 0, G1)
    assert "curr_logprobs_unfiltered" not in data


@pytest.mark.parametrize("group", [None, G1])
def test_entropy_bonus_gets_the_positive_entropy(group) -> None:
    logits = _logits()
    loss_fn = ClippedPGLossFn({"entropy_coef": 0.01})
    loss_input, _ = prepare_loss_input(logits, _data(), loss_fn, 0, group)
    logp = F.log_softmax(logits[:, :-1], -1)
    expected = -(logp.exp() * logp).sum(-1)
    assert (loss_input["entropy"] > 0).all()
    assert torch.allclose(loss_input["entropy"], expected, atol=1e-5)


@pytest.mark.parametrize("zero_outside_topk", [False, True])
def test_distillation_input(zero_outside_topk: bool) -> None:
    logits, data = _logits(), _data()
    g = torch.Generator().manual_seed(3)
    data["teacher_topk_logits"] = torch.randn(B, S, 3, generator=g)
    data["teacher_topk_indices"] = torch.stack(
        [torch.randperm(V, generator=g)[:3] for _ in range(B * S)]
    ).view(B, S, 3)
    loss_fn = DistillationLossFn({"kl_type": "reverse", "zero_outside_topk": zero_outside_topk})
    loss_input, _ = prepare_loss_input(logits, data, loss_fn, 0, G1, G1)
    idx = data["teacher_topk_indices"][:, :-1]
    if zero_outside_topk:
        student = F.log_softmax(logits[:, :-1], -1).gather(-1, idx)
        logp = F.log_softmax(logits[:, :-1], -1)
        assert torch.allclose(loss_input["H_all"], (logp.exp() * logp).sum(-1), atol=1e-5)
    else:
        student = F.log_softmax(logits[:, :-1].gather(-1, idx), -1)
        assert "H_all" not in loss_input
    assert torch.allclose(loss_input["student_topk_logprobs"], student, atol=1e-5)
    teacher = F.log_softmax(data["teacher_topk_logits"][:, :-1], -1)
    assert torch.allclose(loss_input["teacher_topk_logprobs"], teacher, atol=1e-6)


def test_distillation_plain_path_needs_cp1() -> None:
    with pytest.raises(ValueError, match="context parallelism needs `vocab_parallel_group`"):
        prepare_loss_input(
            _logits(), _data(), DistillationLossFn(), context_parallel_group=FakeGroup(0, 2)
        )


def test_draft_input_rolls_teacher_and_mask_and_maps_the_draft_vocab() -> None:
    logits, data = _logits(), _data()
    d2t = torch.tensor([0, 1, 1, 3])  # draft id j -> target id j + d2t[j] = [0, 2, 3, 6]
    data["student_logits"] = torch.randn(B, S, 4)
    loss_input, _ = prepare_loss_input(logits, data, DraftCrossEntropyLossFn(), 0, G1, d2t=d2t)
    # shifted left by one, the rolled-in last position zeroed (NeMo RL's roll_tensor)
    shifted, mask = logits.roll(-1, dims=1), data["token_mask"].roll(-1, dims=1)
    shifted[:, -1], mask[:, -1] = 0, 0
    assert torch.equal(loss_input["teacher_logits"], shifted[..., [0, 2, 3, 6]])
    assert not loss_input["teacher_logits"].requires_grad
    assert torch.equal(loss_input["token_mask"], mask)
    assert loss_input["student_logits"] is data["student_logits"]


def test_draft_input_needs_student_logits() -> None:
    with pytest.raises(ValueError, match="student_logits"):
        prepare_loss_input(_logits(), _data(), DraftCrossEntropyLossFn(), 0, G1)


def _reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    ls, lt = F.log_softmax(student, -1), F.log_softmax(teacher, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


def test_opd_full_logits_payload_gives_the_per_token_reverse_kl() -> None:
    logits, data = _logits(), _data()
    data["teacher_full_payload"] = torch.randn(B, S, V)
    loss_input = _prepare_opd_full_loss_input(
        logits, data, OPDFullLossFn(), vocab_parallel_rank=0, vocab_parallel_group=G1,
        context_parallel_group=None, sampling_params=None, chunk_size=2,
    )  # fmt: skip
    expected = _reverse_kl(logits, data["teacher_full_payload"])[:, :-1]
    assert torch.allclose(loss_input["opd_full_divergence"], expected, atol=1e-5)
    residual = (
        loss_input["opd_full_entropy"] + loss_input["opd_full_cross_entropy"]
        - loss_input["opd_full_divergence"]
    )  # fmt: skip
    assert float(residual.abs().max()) < 1e-5
    assert "next_token_logprobs" not in loss_input


def test_opd_full_hidden_state_payload_projects_with_the_rows_teacher_head() -> None:
    logits, data = _logits(), _data()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, S, 4, generator=g)
    heads = {7: torch.randn(V, 4, generator=g), 9: torch.randn(V, 4, generator=g)}
    data["teacher_full_payload"] = hidden
    data["teacher_index"] = torch.tensor([9, 7])
    with pytest.warns(UserWarning, match="second KL"):
        loss_fn = OPDFullLossFn({"reference_policy_kl_penalty": 0.1})
    loss_input, _ = prepare_loss_input(
        logits, data, loss_fn, 0, G1, teacher_output_layer_weight_by_index=heads
    )
    teacher = torch.stack([hidden[0] @ heads[9].t(), hidden[1] @ heads[7].t()])
    expected = _reverse_kl(logits, teacher)[:, :-1]
    assert torch.allclose(loss_input["opd_full_divergence"], expected, atol=1e-5)
    lp = _hand_logprobs(logits, data["input_ids"])
    assert torch.allclose(loss_input["next_token_logprobs"], lp, atol=1e-6)


def test_opd_full_errors() -> None:
    data = _data()
    kwargs = {"vocab_parallel_rank": 0, "context_parallel_group": None,
              "sampling_params": None, "chunk_size": None}  # fmt: skip
    with pytest.raises(NotImplementedError, match="vocab_parallel_group"):
        _prepare_opd_full_loss_input(_logits(), data, OPDFullLossFn(), vocab_parallel_group=None,
                                     **kwargs)  # fmt: skip
    with pytest.raises(ValueError, match="teacher_full_payload"):
        _prepare_opd_full_loss_input(_logits(), data, OPDFullLossFn(), vocab_parallel_group=G1,
                                     **kwargs)  # fmt: skip
    data["teacher_full_payload"] = torch.randn(B, S, V + 1)
    with pytest.raises(ValueError, match="V = V_l"):
        _prepare_opd_full_loss_input(_logits(), data, OPDFullLossFn(), vocab_parallel_group=G1,
                                     **kwargs)  # fmt: skip


def test_unknown_input_type_and_cp_sharder_raise() -> None:
    class Odd:
        input_type = "cross_tokenizer"

    with pytest.raises(ValueError, match="Unknown loss function input type"):
        prepare_loss_input(_logits(), _data(), Odd())
    with pytest.raises(NotImplementedError, match="cp_sharder"):
        prepare_loss_input(_logits(), _data(), NLLLossFn(), cp_sharder=object())


def test_pack_input_ids_rolls_within_each_span_and_shards_per_span() -> None:
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    # spans: seq 0 has 3 tokens padded to 4, seq 1 has 2 padded to 4 -> [1 2 3 0 | 4 5 0 0]
    cu_q, cu_qp = [0, 3, 5], [0, 4, 8]
    assert _pack_input_ids(ids, cu_q, cu_qp).tolist() == [[1, 2, 3, 0, 4, 5, 0, 0]]
    rolled = _pack_input_ids(ids, cu_q, cu_qp, roll_shift=-1)
    assert rolled.tolist() == [[2, 3, 0, 1, 5, 0, 0, 4]]  # never predicts the next span
    # CP=2: each span of 4 splits into chunks of 1; rank 0 keeps chunks 0 and 3 of every span
    assert _pack_input_ids(ids, cu_q, cu_qp, 0, 2, -1).tolist() == [[2, 1, 5, 4]]
    assert _pack_input_ids(ids, cu_q, cu_qp, 1, 2, -1).tolist() == [[3, 0, 0, 0]]


def test_pack_input_ids_caps_bin_fill_lengths_at_the_row_width() -> None:
    ids = torch.tensor([[1, 2], [3, 4]])
    # the last sequence absorbed bin padding: cu_q says 6 tokens, the row only has 2
    assert _pack_input_ids(ids, [0, 2, 8], [0, 2, 8]).tolist() == [[1, 2, 3, 4, 0, 0, 0, 0]]


def test_prepare_packed_loss_input_matches_the_unpacked_path() -> None:
    logits, data = _logits(), _data()
    lengths = data["input_lengths"].tolist()
    cu = [0, lengths[0], lengths[0] + lengths[1]]
    packed = torch.cat([logits[i, :n] for i, n in enumerate(lengths)])[None]  # [1, T, V]
    loss_fn = ClippedPGLossFn({"entropy_coef": 0.1})
    loss_input, _ = prepare_packed_loss_input(packed, data, loss_fn, cu, cu, 0, G1, chunk_size=3)
    dense, _ = prepare_loss_input(logits, data, loss_fn, 0, G1)
    valid = torch.arange(S - 1)[None, :] < torch.tensor(lengths)[:, None] - 1
    for key in ("next_token_logprobs", "entropy"):
        diff = (loss_input[key] - dense[key]).abs() * valid
        assert float(diff.max()) < 1e-5, key


def test_prepare_packed_loss_input_errors() -> None:
    packed = torch.randn(1, 10, V)
    with pytest.raises(ValueError, match="LOGPROB only"):
        prepare_packed_loss_input(packed, _data(), MseValueLossFn(), [0, 6, 10], [0, 6, 10], 0, G1)
    with pytest.raises(ValueError, match="vocab_parallel_group"):
        prepare_packed_loss_input(packed, _data(), NLLLossFn(), [0, 6, 10], [0, 6, 10])
