"""Bad input raises a clear ValueError before any collective.

The groups here are fakes exposing only ``rank()``/``size()``: if a check were skipped, the kernel
would reach a collective and fail with a different error (no process group is initialised).
"""

from __future__ import annotations

import pytest
import torch
from helpers.unit import FakeGroup

from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    allgather_cp_sharded_tensor,
    distributed_logprob,
    distributed_logprob_with_sampling,
    distributed_vocab_topk,
    from_hidden_to_logprobs,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
    fused_linear_logprobs,
    gather_logits_at_global_indices,
    get_distillation_topk_logprobs_from_logits,
    get_tokens_on_this_cp_rank,
    vocab_parallel_entropy,
    vocab_parallel_reverse_kl,
    vocab_range_for_rank,
)

TP2_RANK0 = FakeGroup(0, 2)
CP2 = FakeGroup(0, 2)
B, S, VL = 2, 8, 16  # local vocab shard; global V = 32 at TP=2


def _logits(seq: int = S) -> torch.Tensor:
    return torch.randn(B, seq, VL)


def test_vocab_not_divisible_by_tp() -> None:
    with pytest.raises(ValueError, match=r"vocab size 65 is not divisible by TP = 2"):
        vocab_range_for_rank(65, 0, 2)
    assert vocab_range_for_rank(64, 1, 2) == (32, 64)


def test_vocab_range_must_match_shard() -> None:
    with pytest.raises(ValueError, match=r"vocab range \[0, 8\) has 8 ids but `logits` has"):
        distributed_logprob(_logits(), torch.zeros(B, S, dtype=torch.long), 0, 8, TP2_RANK0)
    with pytest.raises(ValueError, match=r"`vocab_start_index` must be tp_rank \* V_l = 1 \* 16"):
        distributed_logprob(_logits(), torch.zeros(B, S, dtype=torch.long), 0, 16, FakeGroup(1, 2))


def test_target_ids_outside_vocab() -> None:
    target = torch.zeros(B, S, dtype=torch.long)
    target[1, 3] = 2 * VL  # == V
    with pytest.raises(ValueError, match=r"`target` holds ids in \[0, 32\] but the vocab has 32"):
        distributed_logprob(_logits(), target, 0, VL, TP2_RANK0)
    with pytest.raises(ValueError, match=r"but the vocab has 32 ids"):
        from_parallel_logits_to_logprobs(_logits(), target, 0, VL, TP2_RANK0)
    target[1, 3] = -1
    with pytest.raises(ValueError, match=r"every id must lie in \[0, 32\)"):
        distributed_logprob(_logits(), target, 0, VL, TP2_RANK0, chunk_size=2)


def test_dtype_mismatches() -> None:
    with pytest.raises(ValueError, match=r"`target` must be an integer tensor"):
        distributed_logprob(_logits(), torch.zeros(B, S), 0, VL, TP2_RANK0)
    hidden, weight = torch.randn(S, 4), torch.randn(VL, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype mismatch: `hidden` is torch.float32 but `weight`"):
        fused_linear_logprobs(hidden, weight, torch.zeros(S, dtype=torch.long), 0, VL, TP2_RANK0)
    with pytest.raises(ValueError, match=r"dtype mismatch: `student_logits` is torch.float32"):
        vocab_parallel_reverse_kl(_logits(), _logits().bfloat16(), TP2_RANK0)


def test_sequence_not_divisible_by_2cp() -> None:
    with pytest.raises(ValueError, match=r"must be divisible by 2\*CP = 4"):
        get_tokens_on_this_cp_rank(torch.zeros(1, 6), 0, 2)
    target = torch.zeros(B, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"S_local = 3 must be even"):
        from_parallel_logits_to_logprobs(_logits(3), target, 0, VL, TP2_RANK0, cp_group=CP2)
    with pytest.raises(ValueError, match=r"packed sequence 1 has padded length 6, not divisible"):
        from_parallel_logits_to_logprobs_packed_sequences(
            torch.randn(1, 5, VL), torch.zeros(1, 10, dtype=torch.long), [0, 4, 10], 6, 0, VL,
            TP2_RANK0, cp_group=CP2,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"its length along dim 1 must be even, got 3"):
        allgather_cp_sharded_tensor(torch.zeros(2, 3), CP2)


def test_dense_target_longer_than_padded_sequence() -> None:
    with pytest.raises(ValueError, match=r"S <= S_local \* CP = 8 \* 1 = 8"):
        from_parallel_logits_to_logprobs(
            _logits(), torch.zeros(B, 9, dtype=torch.long), 0, VL, TP2_RANK0
        )


def test_k_not_positive() -> None:
    with pytest.raises(ValueError, match=r"topk must be positive, got k = 0"):
        distributed_vocab_topk(_logits(), 0, TP2_RANK0, 0, VL)
    with pytest.raises(ValueError, match=r"`top_k` must be a positive int or None, got -1"):
        TrainingSamplingParams(top_k=-1)
    empty = torch.zeros(B, S, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"topk must be positive"):
        get_distillation_topk_logprobs_from_logits(
            _logits(), empty.float(), empty, True, True, 0, VL, TP2_RANK0
        )
    with pytest.raises(ValueError, match=r"topk must be positive, got K = 0"):
        gather_logits_at_global_indices(_logits(), empty, 0, VL, TP2_RANK0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, r"`temperature` must be > 0, got 0.0"),
        ({"top_p": 0.0}, r"`top_p` must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"`top_p` must be in \(0, 1\], got 1.5"),
    ],
)
def test_sampling_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainingSamplingParams(**kwargs)


def test_top_k_needs_rows_divisible_by_tp() -> None:
    params = TrainingSamplingParams(top_k=3)
    target = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"need B\*S = 5 divisible by TP = 2"):
        distributed_logprob_with_sampling_call(torch.randn(1, 5, VL), target, params, None)
    target = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"need B\*chunk \(chunk \[0, 3\)\) = 3 divisible by TP"):
        distributed_logprob_with_sampling_call(torch.randn(1, 6, VL), target, params, 3)


def distributed_logprob_with_sampling_call(
    logits: torch.Tensor, target: torch.Tensor, params: TrainingSamplingParams, chunk: int | None
) -> torch.Tensor:
    return distributed_logprob_with_sampling(logits, target, 0, VL, TP2_RANK0, params, False, chunk)


def test_fused_rejects_top_k_with_a_pointer_to_the_logits_path() -> None:
    with pytest.raises(ValueError, match=r"do not support top-k/top-p .* from_parallel_logits"):
        from_hidden_to_logprobs(
            torch.randn(B, S, 4), torch.randn(VL, 4), torch.zeros(B, S, dtype=torch.long), 0, VL,
            TP2_RANK0, sampling_params=TrainingSamplingParams(top_p=0.9),
        )  # fmt: skip


def test_group_and_chunk_arguments() -> None:
    target = torch.zeros(B, S, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`tp_group` is required"):
        distributed_logprob(_logits(), target, 0, VL, None)
    with pytest.raises(ValueError, match=r"`chunk_size` must be a positive int or None, got 0"):
        distributed_logprob(_logits(), target, 0, VL, TP2_RANK0, chunk_size=0)
    with pytest.raises(ValueError, match=r"`logits` must be a floating-point"):
        vocab_parallel_entropy(torch.zeros(B, S, VL, dtype=torch.long), TP2_RANK0)
