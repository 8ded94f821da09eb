"""Synthetic training batches shared by rank functions (pure objects, no process group)."""

from __future__ import annotations

import torch

from lightning_mcore_rl.data import BatchedDataDict


def prompted_batch(
    lengths: list[int], seq: int, vocab: int, prompt: int, seed: int
) -> BatchedDataDict:
    """Right-padded rows of ``lengths`` real tokens ``[B, seq]`` (ids in ``[1, vocab)``): the
    first ``prompt`` tokens a prompt (``token_mask`` 0), the third sample masked out
    (``sample_mask`` 0), random advantages and near-uniform logprobs."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    positions = torch.arange(seq)[None, :]
    real = positions < torch.tensor(lengths)[:, None]
    logprobs = -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(rows, seq, generator=g)
    sample_mask = torch.ones(rows)
    sample_mask[2] = 0.0
    return BatchedDataDict(
        input_ids=torch.randint(1, vocab, (rows, seq), generator=g) * real,
        input_lengths=torch.tensor(lengths),
        token_mask=(real & (positions >= prompt)).float(),
        sample_mask=sample_mask,
        advantages=torch.randn(rows, seq, generator=g),
        prev_logprobs=logprobs,
        generation_logprobs=logprobs,
    )
