"""``rollout_batch`` carries a source's ``routed_experts [B, P+N, L, K]`` into the training
batch, moved with the tokens (left-padded prompts right-aligned), 0 past ``input_lengths``."""

from __future__ import annotations

import torch

from lightning_mcore_rl.recipes.grpo import rollout_batch
from lightning_mcore_rl.rollout import Rollout


def test_routed_experts_follow_the_tokens() -> None:
    tokens = torch.tensor([[0, 5, 6, 7, 8], [3, 4, 9, 1, 0]])  # row 0: 1 pad column; P = 2
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]])
    lengths = torch.tensor([1, 2])
    experts = tokens[:, :, None, None] * 10 + torch.arange(2 * 2).view(1, 1, 2, 2)  # id-coded
    out = Rollout(tokens, mask, mask.float(), lengths, experts)
    batch = rollout_batch(out)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 0], [3, 4, 9, 1, 0]]
    codes = batch["routed_experts"][..., 0, 0] // 10  # each position's experts: its token's
    assert codes.tolist() == [[5, 6, 7, 8, 0], [3, 4, 9, 1, 0]]
    assert batch["routed_experts"][0, 4].eq(0).all() and batch["routed_experts"][1, 4].eq(0).all()
    assert torch.equal(batch["routed_experts"][1, :4], experts[1, :4])


def test_dense_rollout_has_no_routed_experts() -> None:
    tokens = torch.tensor([[1, 2, 3]])
    mask = torch.tensor([[0, 1, 1]])
    assert "routed_experts" not in rollout_batch(
        Rollout(tokens, mask, mask.float(), torch.tensor([1]))
    )
