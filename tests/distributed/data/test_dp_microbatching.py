"""Global valid counts and token-budget microbatching on two real gloo data-parallel ranks."""

from __future__ import annotations

import torch

from lightning_mcore_rl.testing import run_on_ranks

WORLD = 2
WIDTH = 16


def _global_batch() -> dict[str, torch.Tensor]:
    """8 samples with long-tailed lengths; sample 3 masked out; token_mask zero on prompts."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([16, 2, 3, 9, 1, 4, 12, 5])
    positions = torch.arange(WIDTH)[None, :]
    token_mask = ((positions >= 1) & (positions < lengths[:, None])).float()
    return {
        "input_ids": torch.randint(1, 100, (8, WIDTH), generator=generator),
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 1]),
    }


def _local_shard(rank: int, world: int) -> object:
    from lightning_mcore_rl.data import BatchedDataDict

    batch = BatchedDataDict(_global_batch())
    return batch.shard_by_batch_size(world, balance_lengths=True)[rank]


def _counts(rank: int, world: int) -> tuple[float, float, float, list[str]]:
    import torch.distributed as dist

    from lightning_mcore_rl.data import BatchedDataDict, compute_global_valid_counts

    calls: list[str] = []
    original = dist.all_reduce

    def counting_all_reduce(*args: object, **kwargs: object) -> object:
        calls.append(str(kwargs.get("op")))
        return original(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        counts = compute_global_valid_counts(_local_shard(rank, world), dist.group.WORLD)
        no_token_mask = BatchedDataDict(_local_shard(rank, world))
        del no_token_mask["token_mask"]
        counts_no_mask = compute_global_valid_counts(no_token_mask, dist.group.WORLD)
    finally:
        dist.all_reduce = original
    return (
        float(counts.global_valid_seqs),
        float(counts.global_valid_toks),
        float(counts_no_mask.global_valid_toks),
        calls,
    )


def test_global_valid_counts_sum_over_dp_with_one_collective() -> None:
    # kept samples (all but index 3) have lengths 16, 2, 3, 1, 4, 12, 5 -> 7 sequences;
    # token_mask[:, 1:] counts len - 1 per kept sample: 15 + 1 + 2 + 0 + 3 + 11 + 4 = 36
    expected_seqs, expected_toks = 7.0, 36.0
    results = run_on_ranks(_counts, WORLD, WORLD)
    for seqs, toks, toks_no_mask, calls in results:
        assert (seqs, toks) == (expected_seqs, expected_toks)
        assert toks_no_mask == expected_seqs * WIDTH
        assert len(calls) == 2  # one all-reduce per compute_global_valid_counts call


def _dynamic(rank: int, world: int, budget: int, packed: bool) -> dict[str, object]:
    import torch.distributed as dist

    from lightning_mcore_rl.data import (
        make_token_budget_microbatches,
        microbatch_cost,
        plan_token_budget_microbatches,
    )

    local = _local_shard(rank, world)
    result = make_token_budget_microbatches(local, budget, dist.group.WORLD, packed=packed)
    lengths = local["input_lengths"].tolist()
    costs = [
        microbatch_cost([lengths[i] for i in index], packed=packed) for index in result.plan.indices
    ]
    # a fake per-token output (input_ids as float, trimmed like the microbatch) must come back
    outputs = [mb["input_ids"].float() for mb in result.microbatches]
    restored = result.restore_order(outputs)
    trimmed = [mb["input_ids"].shape[1] for mb in result.microbatches]
    lengths_mb = [int(mb["input_lengths"].max()) for mb in result.microbatches]
    return {
        "local_num": plan_token_budget_microbatches(
            lengths, budget, packed=packed
        ).num_microbatches,
        "num": result.plan.num_microbatches,
        "costs": costs,
        "covered": sorted(i for index in result.plan.indices for i in index),
        "size": local.size,
        "restored_ok": bool(
            torch.equal(
                restored * (torch.arange(WIDTH) < local["input_lengths"][:, None]),
                local["input_ids"].float()
                * (torch.arange(WIDTH) < local["input_lengths"][:, None]),
            )
        ),
        "trimmed_ok": trimmed == lengths_mb,
    }


def test_token_budget_microbatches_equal_count_across_dp() -> None:
    # balanced shards: rank 0 lengths [16, 1, 4, 5], rank 1 [2, 3, 9, 12]. Packed, budget 16:
    # [16] [5,4,1] | [12,3] [9,2]. Padded, budget 20 (cost n * longest): [16] [5,4,1] |
    # [12] [9,3] [2] -> rank 0 must split a microbatch to reach 3.
    for budget, packed, local_counts in ((16, True, [2, 2]), (20, False, [2, 3])):
        results = run_on_ranks(_dynamic, WORLD, WORLD, budget, packed)
        assert [r["local_num"] for r in results] == local_counts
        assert len({r["num"] for r in results}) == 1, results  # Megatron needs equal counts
        for r in results:
            assert all(cost <= budget for cost in r["costs"]), r
            assert r["covered"] == list(range(r["size"]))  # every sample exactly once
            assert r["restored_ok"] and r["trimmed_ok"]


def _uneven(rank: int) -> str:
    import torch.distributed as dist

    from lightning_mcore_rl.data import BatchedDataDict, make_token_budget_microbatches

    count = 1 if rank == 0 else 4
    batch = BatchedDataDict(
        input_ids=torch.ones(count, 8, dtype=torch.long), input_lengths=torch.full((count,), 8)
    )
    try:
        make_token_budget_microbatches(batch, 8, dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "ok"


def test_uneven_dp_shards_are_rejected_after_agreeing_on_the_count() -> None:
    # rank 1 needs 4 microbatches (one 8-token sequence each); rank 0 holds only 1 sequence
    messages = run_on_ranks(_uneven, WORLD)
    assert "holds 1 sequences but another rank needs 4 microbatches" in messages[0]
    assert messages[1] == "ok"
