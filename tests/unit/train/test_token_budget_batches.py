"""Token-budget ``process_global_batch`` and
``MCoreRLStrategy(microbatching=MicrobatchConfig(max_tokens_per_microbatch=...))``: argument
errors raised before any collective (no process group needed) and the fixed-size
``GlobalBatch.restore_order``."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.train import GlobalBatch, process_global_batch, split_lm_batch


def _batch(lengths: list[int], width: int = 12) -> BatchedDataDict:
    lens = torch.tensor(lengths)
    return BatchedDataDict(
        input_ids=torch.ones(len(lengths), width, dtype=torch.long),
        input_lengths=lens,
        token_mask=torch.ones(len(lengths), width),
        sample_mask=torch.ones(len(lengths)),
    )


@pytest.mark.parametrize("packing", [True, False])
def test_budget_below_longest_sequence_raises_before_any_collective(packing: bool) -> None:
    # dp_group=None: reaching a collective would fail differently
    with pytest.raises(ValueError, match=r"`max_tokens_per_microbatch`=8 .*longest sequence \(11"):
        process_global_batch(
            _batch([3, 11, 5]), None, 1, max_tokens_per_microbatch=8, sequence_packing=packing
        )


@pytest.mark.parametrize("budget", [0, -4, 2.5, True])
def test_budget_must_be_a_positive_int(budget: object) -> None:
    with pytest.raises(ValueError, match="positive int"):
        process_global_batch(_batch([3, 4]), None, 1, max_tokens_per_microbatch=budget)


def test_padded_budget_microbatches_cannot_give_pipeline_equal_shapes() -> None:
    with pytest.raises(ValueError, match="needs `sequence_packing=True`"):
        process_global_batch(
            _batch([3, 4]), None, 1, equal_shapes=True, max_tokens_per_microbatch=8
        )


def test_fixed_size_restore_order_concatenates() -> None:
    gb = GlobalBatch([], torch.tensor(0.0), torch.tensor(0.0), 4, 2)
    parts = [torch.arange(6.0).view(2, 3), torch.arange(6.0, 9.0).view(1, 3)]
    assert torch.equal(gb.restore_order(parts), torch.arange(9.0).view(3, 3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"microbatching": MicrobatchConfig(max_tokens_per_microbatch=0)}, "positive int"),
        ({"microbatching": MicrobatchConfig(max_tokens_per_microbatch="64")}, "positive int"),
        (
            {"microbatching": MicrobatchConfig(micro_batch_size=2, max_tokens_per_microbatch=64)},
            "contradicts",
        ),
        (
            {
                "microbatching": MicrobatchConfig(max_tokens_per_microbatch=64),
                "pipeline_model_parallel_size": 2,
            },
            "needs `sequence_packing=True`",
        ),
    ],
)
def test_strategy_rejects_contradictory_budget_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MCoreRLStrategy(**kwargs)


def test_strategy_accepts_a_budget() -> None:
    strategy = MCoreRLStrategy(
        pipeline_model_parallel_size=2,
        microbatching=MicrobatchConfig(max_tokens_per_microbatch=64, sequence_packing=True),
    )
    assert strategy.microbatching.max_tokens_per_microbatch == 64
    assert MCoreRLStrategy().microbatching.max_tokens_per_microbatch is None


def test_forward_step_path_rejects_a_budget() -> None:
    strategy = MCoreRLStrategy(microbatching=MicrobatchConfig(max_tokens_per_microbatch=64))
    batch = {"tokens": torch.ones(2, 4), "labels": torch.ones(2, 4)}
    with pytest.raises(ValueError, match="loss_fn"):
        split_lm_batch(batch, strategy.microbatching)
