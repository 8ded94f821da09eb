"""``process_global_batch(equal_shapes=True)``: packed microbatches share one length (as
megatron's pipeline p2p needs) and the extra padding leaves every real token where it was."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.testing import run_on_ranks
from lightning_mcore_rl.train import process_global_batch


def _shapes(rank: int) -> dict[str, list]:
    lengths = torch.tensor([3, 5, 12, 9])  # microbatches of 2: packed 8 vs 21 tokens
    ids = torch.arange(1, 4 * 12 + 1).view(4, 12) * (torch.arange(12) < lengths[:, None])
    batch = BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=torch.ones(4, 12),
        sample_mask=torch.ones(4),
    )
    out = {}
    for equal in (False, True):
        gb = process_global_batch(
            batch, dist.group.WORLD, 2, equal_shapes=equal, sequence_packing=True
        )
        out[str(equal)] = [
            (
                mb.input_ids.shape[1],
                mb.packed_seq_params.cu_seqlens_q.tolist(),
                mb.packed_seq_params.cu_seqlens_q_padded.tolist(),
                mb.input_ids[0].tolist(),
            )
            for mb in gb.microbatches
        ]
    return out


def test_equal_shapes_pads_only_the_tail_of_shorter_packed_microbatches():
    (out,) = run_on_ranks(_shapes, 1)
    plain, equal = out["False"], out["True"]
    assert [m[0] for m in plain] == [8, 21]
    assert [m[0] for m in equal] == [21, 21]
    for (_, _, cu_pad, ids), (_, _, cu_pad_eq, ids_eq) in zip(plain, equal, strict=True):
        # every span but the last keeps its boundaries; the last absorbs the extra padding
        # (spec 6.2: padding is part of the last sequence, causal attention keeps real tokens exact)
        assert cu_pad_eq[:-1] == cu_pad[:-1] and cu_pad_eq[-1] == 21
        assert ids_eq[: len(ids)] == ids and set(ids_eq[len(ids) :]) <= {0}
