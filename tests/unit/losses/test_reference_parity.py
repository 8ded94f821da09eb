"""Five behaviours where this project used to differ from NeMo RL's own functions.

Each expected value follows from the reference's definition (NeMo RL
``nemo_rl/algorithms/loss/loss_functions.py``, ``.../loss/utils.py``, ``.../loss/wrapper.py``,
``nemo_rl/distributed/model_utils.py``, ``nemo_rl/models/megatron/data.py``) and is derived by
hand in the comments.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.unit import FakeGroup

from lightning_mcore_rl.data import BatchedDataDict, get_pack_sequence_parameters
from lightning_mcore_rl.losses import (
    DistillationLossFn,
    DPOLossFn,
    DraftCrossEntropyLossFn,
    DraftLossWrapper,
    NLLLossFn,
    PreferenceLossFn,
    prepare_loss_input,
    wrap_loss_fn_with_input_preparation,
)
from lightning_mcore_rl.train import LossPostProcessor, ParallelGroups

LN = math.log
G1 = FakeGroup()  # size 1: the TP path on one process, no collective is ever issued


# 1. DistillationLossFn reports num_valid_samples = data["input_ids"].shape[0].


def test_distillation_num_valid_samples_is_the_row_count_masked_rows_included() -> None:
    # 3 rows, row 1 masked out (sample_mask = [1, 0, 1]), one scored token per row (S = 2),
    # K = 2: student p = [0.5, 0.25], teacher renormalised q = [0.75, 0.25] on every row.
    data = {
        "input_ids": torch.zeros(3, 2, dtype=torch.long),
        "token_mask": torch.ones(3, 2),
        "sample_mask": torch.tensor([1.0, 0.0, 1.0]),
    }
    student = torch.tensor([[[LN(0.5), LN(0.25)]]]).expand(3, 1, 2)
    teacher = torch.tensor([[[LN(0.75), LN(0.25)]]]).expand(3, 1, 2)
    loss_fn = DistillationLossFn({"kl_type": "forward"})
    loss, metrics = loss_fn(
        data, 2.0, 2.0, student_topk_logprobs=student, teacher_topk_logprobs=teacher
    )
    # Forward KL per token: sum_k q (log q - log p) = 0.75 ln(0.75/0.5) + 0.25 ln(1) = 0.75 ln 1.5.
    # Two unmasked tokens over N_t = 2: loss = 0.75 ln 1.5.
    assert loss.item() == pytest.approx(0.75 * LN(1.5), rel=1e-6)
    # The reference's metric is `data["input_ids"].shape[0]` = 3, not sum(sample_mask) = 2.
    assert metrics["num_valid_samples"].item() == 3.0


# 2. prepare_loss_input(DISTILLATION) without a TP group: the reference's non-parallel branch.


def _plain_case() -> tuple[torch.Tensor, BatchedDataDict]:
    """B = 1, S = 2, V = 4: position 0 has student p = [0.5, 0.25, 0.125, 0.125], teacher top-2
    ids [1, 0] with logits log([0.25, 0.75]); position 1 (dropped) holds garbage."""
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]]]))
    data = BatchedDataDict(
        input_ids=torch.tensor([[0, 1]]),
        token_mask=torch.tensor([[0.0, 1.0]]),
        sample_mask=torch.tensor([1.0]),
        teacher_topk_logits=torch.log(torch.tensor([[[0.25, 0.75], [0.9, 0.1]]])),
        teacher_topk_indices=torch.tensor([[[1, 0], [3, 2]]]),
    )
    return logits, data


def test_plain_distillation_input_zero_outside_topk_hand_values() -> None:
    logits, data = _plain_case()
    loss_fn = DistillationLossFn({"kl_type": "reverse", "zero_outside_topk": True})
    loss_input, _ = prepare_loss_input(logits, data, loss_fn)
    # Full-vocab student logprobs at ids [1, 0]: [ln 0.25, ln 0.5]; position 1 dropped -> [1,1,2].
    expected_student = torch.tensor([[[LN(0.25), LN(0.5)]]])
    torch.testing.assert_close(loss_input["student_topk_logprobs"], expected_student)
    # Teacher: log_softmax over its 2 logits = [ln 0.25, ln 0.75] (already normalised).
    expected_teacher = torch.tensor([[[LN(0.25), LN(0.75)]]])
    torch.testing.assert_close(loss_input["teacher_topk_logprobs"], expected_teacher)
    # H_all = sum_v p log p = 0.5 ln 0.5 + 0.25 ln 0.25 + 2 * 0.125 ln 0.125.
    h_all = 0.5 * LN(0.5) + 0.25 * LN(0.25) + 0.25 * LN(0.125)
    torch.testing.assert_close(loss_input["H_all"], torch.tensor([[h_all]]))
    # The loss on it: reverse sum_k p (ln p - ln q) = 0.25 ln(0.25/0.25) + 0.5 ln(0.5/0.75);
    # tail H_rest + 100 P_rest with H_rest = H_all - (0.25 ln 0.25 + 0.5 ln 0.5), P_rest = 0.25.
    loss, _ = loss_fn(data, 1.0, 1.0, **loss_input)
    expected = 0.5 * LN(0.5 / 0.75) + (0.25 * LN(0.125) + 100 * 0.25)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_plain_distillation_input_renormalised_topk_hand_values() -> None:
    logits, data = _plain_case()
    loss_input, _ = prepare_loss_input(logits, data, DistillationLossFn({"kl_type": "forward"}))
    # zero_outside_topk=False: log_softmax of the student's logits at ids [1, 0], i.e. of
    # [ln 0.25, ln 0.5] -> [ln(1/3), ln(2/3)]; no H_all.
    expected = torch.tensor([[[LN(1 / 3), LN(2 / 3)]]])
    torch.testing.assert_close(loss_input["student_topk_logprobs"], expected)
    assert "H_all" not in loss_input


@pytest.mark.parametrize("zero_outside_topk", [False, True])
def test_plain_distillation_input_equals_the_tp_path_at_tp1(zero_outside_topk: bool) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    data = BatchedDataDict(
        teacher_topk_logits=torch.randn(2, 5, 3, generator=g, dtype=torch.float64),
        teacher_topk_indices=torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(10)])
        .view(2, 5, 3),
    )  # fmt: skip
    cfg = {"kl_type": "mixed", "zero_outside_topk": zero_outside_topk}
    plain, _ = prepare_loss_input(logits, data, DistillationLossFn(cfg))
    tp1, _ = prepare_loss_input(logits, data, DistillationLossFn(cfg), 0, G1)
    assert sorted(plain) == sorted(tp1)
    for key in plain:
        torch.testing.assert_close(plain[key], tp1[key], rtol=0, atol=1e-12)
    (grad_plain,) = torch.autograd.grad(plain["student_topk_logprobs"].sum(), logits)
    (grad_tp1,) = torch.autograd.grad(tp1["student_topk_logprobs"].sum(), logits)
    torch.testing.assert_close(grad_plain, grad_tp1, rtol=0, atol=1e-12)


def test_plain_distillation_input_errors() -> None:
    logits, data = _plain_case()
    loss_fn = DistillationLossFn()
    with pytest.raises(ValueError, match=r"context parallelism needs `vocab_parallel_group`"):
        prepare_loss_input(logits, data, loss_fn, context_parallel_group=FakeGroup(0, 2))
    with pytest.raises(ValueError, match=r"full \[B, S, V\].*got logits \(1, 1, 4\)"):
        prepare_loss_input(logits[:, :1], data, loss_fn)
    data["teacher_topk_indices"] = torch.tensor([[[1, 4], [3, 2]]])
    with pytest.raises(ValueError, match=r"must lie in \[0, V=4\).*\[1, 4\]"):
        prepare_loss_input(logits, data, loss_fn)


# 3. The packing divisor for MoE HybridEP (flex dispatcher with the "hybridep" backend) is 128.


def _pack_params(**options: object) -> tuple[int, int, int | None]:
    layout = {
        "tensor_model_parallel_size": 1,
        "sequence_parallel": False,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "pad_individual": 1,
        "max_seq_len_in_batch": 100,
    }
    return get_pack_sequence_parameters(**{**layout, **options})  # type: ignore[arg-type]


HYBRIDEP = {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep"}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # divisor 128, no CP/SP factor: pad_packed_multiple = 128
        (HYBRIDEP, (1, 128, None)),
        # x 2*CP = 4 (pad_individual must be a multiple of 4): 512
        ({**HYBRIDEP, "context_parallel_size": 2, "pad_individual": 4}, (4, 512, None)),
        # x TP with SP = 2: 256
        ({**HYBRIDEP, "tensor_model_parallel_size": 2, "sequence_parallel": True,
          "pad_individual": 2}, (2, 256, None)),
        # FP8 tensorwise (16) and HybridEP (128): the maximum, 128
        ({**HYBRIDEP, "fp8": "tensorwise"}, (1, 128, None)),
        # FP8 blockwise alone is already 128: unchanged by HybridEP
        ({**HYBRIDEP, "fp8": "blockwise"}, (1, 128, None)),
        # PP > 1: pad_packed_to = round_up(100, 128) = 128
        ({**HYBRIDEP, "pipeline_model_parallel_size": 2}, (1, 128, 128)),
        # the reference needs the flex dispatcher: hybridep with alltoall adds nothing
        ({"moe_token_dispatcher_type": "alltoall", "moe_flex_dispatcher_backend": "hybridep"},
         (1, 1, None)),
        # flex with megatron's default deepep backend adds nothing either
        ({"moe_token_dispatcher_type": "flex"}, (1, 1, None)),
    ],
)  # fmt: skip
def test_hybridep_packing_divisor(options: dict[str, object], expected: tuple) -> None:
    assert _pack_params(**options) == expected


def test_moe_dispatcher_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"`moe_flex_dispatcher_backend` must be one of .*'nccl'"):
        _pack_params(moe_flex_dispatcher_backend="nccl")
    with pytest.raises(ValueError, match=r"`moe_token_dispatcher_type` must be one of .*'a2a'"):
        _pack_params(moe_token_dispatcher_type="a2a")


# 4. DraftLossWrapper takes the reference's arguments, `data_dict=` included, by keyword.


def _draft_case() -> tuple[torch.Tensor, BatchedDataDict]:
    """B = 1, S = 2, V = 2, ids [0, 1], token_mask [0, 1]: one scored token (N_t = 1). Policy
    logits: position 0 = log([0.25, 0.75]) scores token 1, position 1 = [0, 0]; the draft's
    student logits: position 0 = log([0.75, 0.25])."""
    policy_logits = torch.stack([torch.log(torch.tensor([0.25, 0.75])), torch.zeros(2)])[None]
    data = BatchedDataDict(
        input_ids=torch.tensor([[0, 1]]),
        token_mask=torch.tensor([[0.0, 1.0]]),
        sample_mask=torch.tensor([1.0]),
        student_logits=torch.stack([torch.log(torch.tensor([0.75, 0.25])), torch.zeros(2)])[None],
    )
    return policy_logits, data


# Policy NLL: -ln 0.75. Draft: teacher = policy logits rolled left (position 0 <- [0, 0], softmax
# [0.5, 0.5]), mask rolled to [1, 0]; soft CE at position 0 against the student's
# [ln 0.75, ln 0.25]: -(0.5 ln 0.75 + 0.5 ln 0.25) = 0.5 ln(16/3).
DRAFT_CE = 0.5 * LN(16 / 3)


def test_draft_wrapper_accepts_the_reference_keywords() -> None:
    policy_logits, data = _draft_case()
    wrapper = DraftLossWrapper(
        loss_fn=wrap_loss_fn_with_input_preparation,
        prepare_fn=prepare_loss_input,
        data_dict=data,
        loss_weight=0.5,
        vocab_parallel_rank=None,
        vocab_parallel_group=None,
        context_parallel_group=None,
    )
    assert wrapper.data_dict is data
    # Extra keywords go to the policy loss, as in the reference.
    loss, metrics = wrapper(
        next_token_logits=policy_logits,
        data=data,
        global_valid_seqs=1.0,
        global_valid_toks=1.0,
        loss_fn=NLLLossFn(),
        prepare_fn=prepare_loss_input,
    )
    assert metrics["draft_loss"].item() == pytest.approx(DRAFT_CE, rel=1e-6)
    assert loss.item() == pytest.approx(-LN(0.75) + 0.5 * DRAFT_CE, rel=1e-6)


def test_draft_shift_zeroes_the_rolled_in_last_position() -> None:
    # B = 1, S = 3, V = 2, token_mask all ones. Policy logits p0 = ln[.25, .75], p1 = [0, 0],
    # p2 = ln[.25, .75]; the teacher is shifted left: position 0 <- p1 (softmax [.5, .5]),
    # position 1 <- p2 ([.25, .75]), position 2 <- 0 with mask 0 (NeMo RL's roll_tensor; a
    # plain roll brought p0 and mask 1 there). Student: ln[.75, .25], ln[.5, .5], ln[.9, .1].
    # CE_0 = -(.5 ln .75 + .5 ln .25) = .5 ln(16/3); CE_1 = -(.25 ln .5 + .75 ln .5) = ln 2;
    # draft_loss = (CE_0 + CE_1) / N_t with N_t = 2.
    log = torch.log
    policy = torch.stack([log(torch.tensor([0.25, 0.75])), torch.zeros(2)])
    policy = torch.cat([policy, log(torch.tensor([[0.25, 0.75]]))])[None]
    student = log(torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]]))[None]
    data = BatchedDataDict(
        input_ids=torch.tensor([[0, 1, 1]]),
        token_mask=torch.ones(1, 3),
        sample_mask=torch.tensor([1.0]),
        student_logits=student,
    )
    prepared = prepare_loss_input(policy, data, DraftCrossEntropyLossFn())[0]
    assert prepared["token_mask"].tolist() == [[1.0, 1.0, 0.0]]
    assert torch.equal(prepared["teacher_logits"][0, 2], torch.zeros(2))
    _, metrics = DraftCrossEntropyLossFn()(data, 1.0, 2.0, **prepared)
    expected = (0.5 * LN(16 / 3) + LN(2)) / 2
    assert metrics["loss"].item() == pytest.approx(expected, rel=1e-6)
    assert policy[0, 0].tolist() == pytest.approx([LN(0.25), LN(0.75)])  # input not modified


def test_loss_post_processor_wraps_draft_batches_with_the_reference_arguments() -> None:
    # A batch with `student_logits` gets DraftLossWrapper(..., data_dict=batch,
    # loss_weight=cfg.draft.loss_weight, TP/CP groups) around the policy loss (reference:
    # nemo_rl/models/megatron/train.py). M = 1, CP = 1: the returned loss is unscaled.
    policy_logits, data = _draft_case()
    g = FakeGroup()
    groups = ParallelGroups(
        tp_group=g, tp_rank=0, tp_size=1, pp_group=g, pp_rank=0, pp_size=1, pp_last_rank=0,
        dp_group=g, dp_rank=0, dp_size=1, cp_group=g, cp_rank=0, cp_size=1,
    )  # fmt: skip
    post = LossPostProcessor(NLLLossFn(), {"draft": {"loss_weight": 0.5}})
    bound = post(
        data, None, torch.tensor(1.0), torch.tensor(1.0), groups=groups, num_microbatches=1
    )
    loss, metrics = bound(policy_logits)
    assert metrics["draft_loss"].item() == pytest.approx(DRAFT_CE, rel=1e-6)
    assert loss.item() == pytest.approx(-LN(0.75) + 0.5 * DRAFT_CE, rel=1e-6)


def test_draft_wrapper_positional_order_is_the_references() -> None:
    # (loss_fn, prepare_fn, data_dict, loss_weight, vocab_parallel_rank, vocab_parallel_group,
    # context_parallel_group)
    data = BatchedDataDict(sample_mask=torch.ones(1))
    policy = functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=NLLLossFn())
    wrapper = DraftLossWrapper(policy, prepare_loss_input, data, 0.25, 0, G1, None)
    assert (wrapper.data_dict, wrapper.loss_weight, wrapper.vocab_parallel_rank) == (data, 0.25, 0)
    assert wrapper.vocab_parallel_group is G1 and wrapper.context_parallel_group is None


# 5. PreferenceLossFn.split_output_tensor: (tensor[::2], tensor[1::2]).


def test_split_output_tensor_splits_interleaved_pairs() -> None:
    # Rows alternate chosen/rejected: [c0, r0, c1, r1] -> ([c0, c1], [r0, r1]).
    chosen, rejected = PreferenceLossFn().split_output_tensor(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert chosen.tolist() == [1.0, 3.0] and rejected.tolist() == [2.0, 4.0]
    # Any trailing shape, along dim 0: [4, 2] -> two [2, 2].
    rows = torch.arange(8.0).view(4, 2)
    chosen, rejected = PreferenceLossFn.split_output_tensor(rows)
    assert chosen.tolist() == [[0.0, 1.0], [4.0, 5.0]]
    assert rejected.tolist() == [[2.0, 3.0], [6.0, 7.0]]
    # The reference's DPO inherits the method.
    assert DPOLossFn().split_output_tensor(rows)[1].tolist() == rejected.tolist()


def test_split_output_tensor_feeds_the_bradley_terry_loss() -> None:
    # Rewards [c0, r0, c1, r1] = [2, 0, 0, 1], N_s = 4 (2 pairs):
    # loss = (-ln sigmoid(2 - 0) - ln sigmoid(0 - 1)) / 2, accuracy = (1 + 0) / 2.
    logits = torch.tensor([2.0, 0.0, 0.0, 1.0])
    loss, metrics = PreferenceLossFn()({"sample_mask": torch.ones(4)}, 4.0, None, logits=logits)
    expected = -(F.logsigmoid(torch.tensor(2.0)) + F.logsigmoid(torch.tensor(-1.0))).item() / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["accuracy"].item() == 0.5


def test_split_output_tensor_rejects_unpaired_rows() -> None:
    with pytest.raises(ValueError, match=r"batch size must be even; got 3 samples"):
        PreferenceLossFn.split_output_tensor(torch.zeros(3))
    with pytest.raises(ValueError, match=r"leading sample dimension"):
        PreferenceLossFn.split_output_tensor(torch.tensor(1.0))
