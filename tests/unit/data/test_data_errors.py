"""Clear errors raised before any collective (no process group is needed to reach them)."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.data import (
    BatchedDataDict,
    compute_global_valid_counts,
    make_token_budget_microbatches,
)
from lightning_mcore_rl.models.layers import PackedDotProductAttention


def _batch() -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.ones(2, 4, dtype=torch.long),
        input_lengths=torch.tensor([4, 2]),
        token_mask=torch.ones(2, 4),
        sample_mask=torch.ones(2),
    )


def test_global_counts_errors() -> None:
    batch = _batch()
    del batch["sample_mask"]
    with pytest.raises(ValueError, match=r"`sample_mask` must be present in the data"):
        compute_global_valid_counts(batch, dp_group=None)  # type: ignore[arg-type]
    batch = _batch()
    batch["sample_mask"] = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"`sample_mask` must be \[B\], got shape \(2, 1\)"):
        compute_global_valid_counts(batch, dp_group=None)  # type: ignore[arg-type]
    batch = _batch()
    batch["token_mask"] = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"`token_mask` must be \[B, S\] with B=2, got shape"):
        compute_global_valid_counts(batch, dp_group=None)  # type: ignore[arg-type]


def test_token_budget_errors() -> None:
    batch = _batch()
    del batch["input_lengths"]
    with pytest.raises(ValueError, match=r"missing required keys \['input_lengths'\]"):
        make_token_budget_microbatches(batch, 8, dp_group=None)  # type: ignore[arg-type]
    batch = _batch()
    batch["input_lengths"] = torch.tensor([5, 2])
    with pytest.raises(
        ValueError, match=r"`input_lengths` must lie in \[0, S=4\], got min 2, max 5"
    ):
        make_token_budget_microbatches(batch, 8, dp_group=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`max_tokens_per_microbatch`=3 is smaller than"):
        make_token_budget_microbatches(_batch(), 3, dp_group=None)  # type: ignore[arg-type]


def test_packed_attention_cp_group_must_match_the_config() -> None:
    from types import SimpleNamespace

    from helpers.unit import FakeGroup
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, context_parallel_size=2
    )
    groups = SimpleNamespace(tp=FakeGroup(), cp=FakeGroup())  # a CP group of 1 rank
    with pytest.raises(
        ValueError, match=r"CP group has 1 ranks but `config.context_parallel_size` is 2"
    ):
        PackedDotProductAttention(config, 1, AttnMaskType.causal, "self", pg_collection=groups)
