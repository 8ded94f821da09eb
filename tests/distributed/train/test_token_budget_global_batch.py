"""``process_global_batch(max_tokens_per_microbatch=...)`` at DP=2: the same number of
microbatches on both ranks (rank 0's short rows alone would need fewer), global valid counts of
the whole local batch (equal to the fixed-size split's), every microbatch within the budget,
``restore_order`` back to the input order, and equal packed lengths with ``equal_shapes``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.testing import run_on_ranks
from lightning_mcore_rl.train import process_global_batch

BUDGET = 24


def _batch(rank: int) -> BatchedDataDict:
    lengths = torch.tensor([3, 5, 2, 4] if rank == 0 else [9, 12, 7, 10])
    width = 12
    positions = torch.arange(width)[None, :]
    ids = (torch.arange(4)[:, None] * 100 + positions + 1) * (positions < lengths[:, None])
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=(positions < lengths[:, None]).float(),
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
    )


def _run(rank: int) -> dict:
    batch = _batch(rank)
    out: dict = {}
    fixed = process_global_batch(batch, dist.group.WORLD, 2)
    out["fixed_counts"] = (float(fixed.global_valid_seqs), float(fixed.global_valid_toks))
    for packing in (False, True):
        for equal in (False, True) if packing else (False,):
            gb = process_global_batch(
                batch, dist.group.WORLD, 3, equal_shapes=equal,
                max_tokens_per_microbatch=BUDGET, sequence_packing=packing,
            )  # fmt: skip
            key = f"packed={packing},equal={equal}"
            restored = gb.restore_order([mb.data_dict["input_ids"] for mb in gb.microbatches])
            out[key] = {
                "num": gb.num_microbatches,
                "counts": (float(gb.global_valid_seqs), float(gb.global_valid_toks)),
                "costs": list(gb.token_budget.plan.costs),
                "restored": torch.equal(restored, batch["input_ids"]),
                "reordered": [i for idx in gb.token_budget.plan.indices for i in idx]
                != list(range(4)),
                "model_lengths": [mb.input_ids.shape[1] for mb in gb.microbatches],
                "rows": [mb.data_dict.size for mb in gb.microbatches],
            }
    return out


def test_token_budget_global_batch_dp2():
    results = run_on_ranks(_run, 2)
    keys = ["packed=False,equal=False", "packed=True,equal=False", "packed=True,equal=True"]
    for key in keys:
        nums = [r[key]["num"] for r in results]
        assert nums[0] == nums[1] >= 2, nums  # rank 0 alone fits in 1 microbatch
        for r in results:
            assert r[key]["counts"] == r["fixed_counts"]  # once over DP, whole local batch
            assert max(r[key]["costs"]) <= BUDGET
            assert r[key]["restored"]
            assert sum(r[key]["rows"]) == 4
    assert results[1]["packed=True,equal=False"]["reordered"]  # restore_order is not a no-op
    for r in results:
        equal = r["packed=True,equal=True"]["model_lengths"]
        assert len(set(equal)) == 1
        assert equal[0] == max(r["packed=True,equal=False"]["model_lengths"])
