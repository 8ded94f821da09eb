"""Loss wrappers: per-sequence and fused packed losses equal the unpacked loss; draft wrapper."""

from __future__ import annotations

import functools

import pytest
import torch
from test_loss_input import G1, B, S, V, _data, _logits

from lightning_mcore_rl.losses import (
    ClippedPGLossFn,
    DraftCrossEntropyLossFn,
    DraftLossWrapper,
    NLLLossFn,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    prepare_loss_input,
    prepare_packed_loss_input,
    wrap_loss_fn_with_input_preparation,
)

PAD = 4  # every span padded to a multiple of 4 (bin padding would be garbage logits)


def _packed(logits: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``[1, T, V]`` with span ``i`` = ``logits[i, :len_i]`` then random padding logits."""
    spans = [-(-n // PAD) * PAD for n in lengths]
    cu = [0]
    for span in spans:
        cu.append(cu[-1] + span)
    packed = torch.randn(1, cu[-1], V, generator=torch.Generator().manual_seed(9))
    for i, n in enumerate(lengths):
        packed[0, cu[i] : cu[i] + n] = logits[i, :n]
    return packed, cu


def _run(wrapper, logits: torch.Tensor, data, gvs, gvt):
    leaf = logits.clone().requires_grad_(True)
    loss, metrics = wrapper(leaf, data, gvs, gvt)
    loss.backward()
    return loss.detach(), metrics, leaf.grad


@pytest.mark.parametrize("loss_fn", [ClippedPGLossFn({"reference_policy_kl_penalty": 0.1}),
                                     NLLLossFn()])  # fmt: skip
def test_per_sequence_and_fused_wrappers_equal_the_unpacked_loss(loss_fn) -> None:
    logits, data = _logits(), _data()
    lengths = data["input_lengths"].tolist()
    gvs = data["sample_mask"].sum()
    gvt = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    dense = functools.partial(
        wrap_loss_fn_with_input_preparation, loss_fn=loss_fn, vocab_parallel_rank=0,
        vocab_parallel_group=G1,
    )  # fmt: skip
    ref_loss, ref_metrics, ref_grad = _run(dense, logits, data, gvs, gvt)
    packed, cu = _packed(logits, lengths)
    # the standard path puts the padded boundaries in cu_seqlens_q too
    # (docs/behaviour-reference.md trap 11)
    per_seq = SequencePackingLossWrapper(loss_fn, prepare_loss_input, cu, cu, 0, G1, None)
    fused = SequencePackingFusionLossWrapper(loss_fn, prepare_packed_loss_input, cu, cu, 0, G1)
    for wrapper in (per_seq, fused):
        loss, metrics, grad = _run(wrapper, packed, data, gvs, gvt)
        assert float(loss) == pytest.approx(float(ref_loss), abs=1e-6)
        assert sorted(metrics) == sorted(ref_metrics)
        for key, value in ref_metrics.items():
            assert float(metrics[key]) == pytest.approx(float(value), abs=1e-5), key
        expected = torch.zeros_like(packed)
        for i, n in enumerate(lengths):
            expected[0, cu[i] : cu[i] + n] = ref_grad[i, :n]
        assert float((grad - expected).abs().max()) < 1e-6


def test_per_sequence_wrapper_combines_extrema_with_min_and_max() -> None:
    loss_fn = ClippedPGLossFn()
    logits, data = _logits(), _data()
    packed, cu = _packed(logits, data["input_lengths"].tolist())
    wrapper = SequencePackingLossWrapper(loss_fn, prepare_loss_input, cu, cu, 0, G1)
    _, metrics, _ = _run(wrapper, packed, data, 2.0, 10.0)
    dense_input, _ = prepare_loss_input(logits, data, loss_fn, 0, G1)
    _, dense = loss_fn(data, 2.0, 10.0, **dense_input)
    assert float(metrics["probs_ratio_min"]) == pytest.approx(float(dense["probs_ratio_min"]))
    assert float(metrics["probs_ratio_max"]) == pytest.approx(float(dense["probs_ratio_max"]))
    assert float(metrics["num_valid_samples"]) == B


def test_packed_wrappers_reject_mismatched_boundaries() -> None:
    with pytest.raises(ValueError, match="B\\+1 entries"):
        SequencePackingLossWrapper(NLLLossFn(), prepare_loss_input, [0, 4], [0, 4, 8])


def test_draft_wrapper_adds_the_weighted_draft_loss() -> None:
    logits, data = _logits(), _data()
    data["student_logits"] = torch.randn(B, S, V, requires_grad=True)
    policy = functools.partial(
        wrap_loss_fn_with_input_preparation, loss_fn=NLLLossFn(), vocab_parallel_rank=0,
        vocab_parallel_group=G1,
    )  # fmt: skip
    wrapper = DraftLossWrapper(policy, prepare_loss_input, data, 0.25, 0, G1)
    total, metrics = wrapper(logits, data, 2.0, 7.0)
    policy_loss, _ = policy(logits, data, 2.0, 7.0)
    draft_input, _ = prepare_loss_input(logits, data, DraftCrossEntropyLossFn(), 0, G1)
    draft, _ = DraftCrossEntropyLossFn()(data, 2.0, 7.0, **draft_input)
    expected = float((policy_loss + 0.25 * draft).detach())
    assert float(total.detach()) == pytest.approx(expected, abs=1e-6)
    assert float(metrics["draft_loss"]) == pytest.approx(float(draft.detach()), abs=1e-6)
    with pytest.raises(ValueError, match="global_valid_toks"):
        wrapper(logits, data, 2.0, None)
