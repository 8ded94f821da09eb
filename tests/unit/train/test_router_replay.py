"""Router replay's token order against hand-built layouts (no process groups, no model).

Every expectation below is derived by hand from megatron's rule that a router sees its layer
input ``[s, b, H]`` flattened sequence-first (``n = s * B + b``), and from the packer's THD row
(spans of ``round_up(len, pad_individual)``, CP zigzag: rank ``r`` holds chunks ``r`` and
``2CP-1-r`` of every span).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.extensions.moe.router_replay import (
    check_routed_experts,
    moe_layer_numbers,
    routed_experts_in_model_order,
    routed_token_index,
    sequence_parallel_slice,
)
from lightning_mcore_rl.train.model_inputs import process_microbatch

L, K, E = 2, 2, 4


def _experts(batch: int, width: int) -> torch.Tensor:
    """``[B, S, L, K]`` with a distinct code per slot: ``((b*S + s) * L + l) * K + k``."""
    return torch.arange(batch * width * L * K).view(batch, width, L, K)


def _batch(lengths: list[int], width: int) -> BatchedDataDict:
    batch = len(lengths)
    return BatchedDataDict(
        input_ids=torch.arange(1, batch * width + 1).view(batch, width),
        input_lengths=torch.tensor(lengths),
        routed_experts=_experts(batch, width),
    )


def test_padded_layout_is_sequence_first_with_padding_marked() -> None:
    # B=2, S=3, lengths [3, 2], model width 4 (e.g. SP over TP=2 pads to a multiple of 2):
    # s=0: tokens (0,0)=0, (1,0)=3; s=1: 1, 4; s=2: 2, pad (len 2); s=3: width padding.
    index = routed_token_index(2, 3, torch.tensor([3, 2]), model_width=4)
    assert index.tolist() == [0, 3, 1, 4, 2, -1, -1, -1]
    mb = process_microbatch(_batch([3, 2], 3), pad_width_multiple=4, routing=True)
    assert mb.padding_mask is not None and mb.routed_experts_cp_sharded is not None
    assert mb.padding_mask.tolist() == [[False, False, False, True], [False, False, True, True]]
    flat = _experts(2, 3).reshape(6, L, K)
    expected = torch.stack([flat[i] if i >= 0 else torch.arange(K).expand(L, K) for i in index])
    assert torch.equal(mb.routed_experts_cp_sharded, expected)
    assert mb.routed_experts_cp_sharded.dtype == torch.int64
    assert mb.routed_experts_cp_sharded.shape == (8, L, K)


@pytest.mark.parametrize(
    ("cp_rank", "expected"),
    # spans of 4 (len 3 -> 4, len 2 -> 4), each cut into 2*CP=4 chunks of 1 token:
    # rank 0 holds chunks 0 and 3 of each span, rank 1 chunks 1 and 2.
    [(0, [0, -1, 4, -1]), (1, [1, 2, 5, -1])],
)
def test_packed_layout_follows_the_cp_zigzag(cp_rank: int, expected: list[int]) -> None:
    mb = process_microbatch(
        _batch([3, 2], 4),
        sequence_packing=True,
        pad_individual=4,
        cp_rank=cp_rank,
        cp_size=2,
        routing=True,
    )
    assert mb.padding_mask is not None and mb.routed_experts_cp_sharded is not None
    assert mb.padding_mask.tolist() == [[i < 0 for i in expected]]
    flat = _experts(2, 4).reshape(8, L, K)
    for n, source in enumerate(expected):
        want = flat[source] if source >= 0 else torch.arange(K).expand(L, K)
        assert torch.equal(mb.routed_experts_cp_sharded[n], want), (n, source)
    # the batch's ids are b*S + s + 1 (0 never occurs), so the packed ids minus 1 are the index
    assert [i - 1 for i in mb.input_ids_cp_sharded[0].tolist()] == expected


def test_packed_bin_padding_is_padding() -> None:
    # lengths [2, 1], no per-span padding, T padded to 5: spans [0,2) and [2,5) hold 2 + 1 real.
    mb = process_microbatch(_batch([2, 1], 3), sequence_packing=True, pad_packed_to=5, routing=True)
    assert mb.padding_mask is not None
    assert mb.padding_mask.tolist() == [[False, False, False, True, True]]
    index = routed_token_index(2, 3, None, packed_index=torch.tensor([[1, 2, 4, 0, 0]]))
    assert index.tolist() == [0, 1, 3, -1, -1]


def test_no_routed_experts_key_gives_none() -> None:
    data = _batch([3, 2], 3)
    del data["routed_experts"]
    mb = process_microbatch(data, routing=True)
    assert mb.routed_experts_cp_sharded is None
    assert mb.padding_mask is not None and mb.padding_mask.tolist()[1] == [False, False, True]


@pytest.mark.parametrize("packing", [False, True])
def test_a_dense_model_gets_neither_mask_nor_routing(packing: bool) -> None:
    # routing=False (no MoE routers): the second pack and the token index are skipped
    mb = process_microbatch(_batch([3, 2], 3), sequence_packing=packing)
    assert mb.padding_mask is None and mb.routed_experts_cp_sharded is None


def test_sequence_parallel_slice_is_contiguous() -> None:
    tokens = torch.arange(8)[:, None, None].expand(8, L, K)
    assert sequence_parallel_slice(tokens, 1, 2)[:, 0, 0].tolist() == [4, 5, 6, 7]
    assert sequence_parallel_slice(tokens, 0, 1) is tokens
    with pytest.raises(ValueError, match="do not split over TP=3"):
        sequence_parallel_slice(tokens, 0, 3)


def test_gather_fills_padding_with_the_first_k_experts() -> None:
    experts = _experts(1, 2)
    got = routed_experts_in_model_order(experts, torch.tensor([1, -1, 0]))
    assert torch.equal(got[0], experts[0, 1]) and torch.equal(got[2], experts[0, 0])
    assert got[1].tolist() == [[0, 1], [0, 1]]


def test_moe_layer_numbers() -> None:
    cfg = SimpleNamespace(num_moe_experts=E, moe_layer_freq=2, num_layers=4)
    assert moe_layer_numbers(cfg) == [1, 3]
    cfg.moe_layer_freq = [0, 1, 1, 0]
    assert moe_layer_numbers(cfg) == [2, 3]
    assert moe_layer_numbers(SimpleNamespace(num_moe_experts=None)) == []


def test_check_routed_experts() -> None:
    cfg = SimpleNamespace(
        num_moe_experts=E, moe_layer_freq=1, num_layers=L, moe_router_topk=K,
        moe_enable_routing_replay=True,
    )  # fmt: skip
    good = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "routed_experts": _experts(2, 3) % E}
    assert check_routed_experts(good, cfg) is True
    cfg.moe_enable_routing_replay = False
    assert check_routed_experts(good, cfg) is False  # recorded, not replayed (mismatch metric)
    assert check_routed_experts({"input_ids": good["input_ids"]}, cfg) is False
    cfg.moe_enable_routing_replay = True
    with pytest.raises(ValueError, match="has no `routed_experts`"):
        check_routed_experts({"input_ids": good["input_ids"]}, cfg)
    with pytest.raises(TypeError, match="integer tensor"):
        check_routed_experts({**good, "routed_experts": good["routed_experts"].float()}, cfg)
    with pytest.raises(ValueError, match=r"\[B, S, L, K\] = \[2, 3, 2, 2\]"):
        check_routed_experts({**good, "routed_experts": good["routed_experts"][:, :, :1]}, cfg)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\), got min 1, max 4"):
        check_routed_experts({**good, "routed_experts": good["routed_experts"] + 1}, cfg)


def test_routed_experts_are_checked_per_token() -> None:
    """A repeated expert in one token's top-K (the token would reach fewer experts, silently) or
    an id out of range is named with its sample, token and MoE layer; padding (past
    ``input_lengths``, zeros from the recipes) is not checked for repeats."""
    cfg = SimpleNamespace(
        num_moe_experts=E, moe_layer_freq=1, num_layers=L, moe_router_topk=K,
        moe_enable_routing_replay=True,
    )  # fmt: skip
    experts = _experts(2, 3) % E  # K=2 consecutive codes: distinct within every token
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "routed_experts": experts}
    repeated = experts.clone()
    repeated[1, 2, 0] = torch.tensor([3, 3])
    with pytest.raises(
        ValueError,
        match=r"^`routed_experts` must name 2 distinct experts per token and MoE layer \(the "
        r"router's top-k\), got \[3, 3\] at sample 1, token 2, MoE layer 0",
    ):
        check_routed_experts({**batch, "routed_experts": repeated}, cfg)
    # the same row with length 2: token 2 is padding, its repeated filler is not a routing
    padded = {**batch, "routed_experts": repeated, "input_lengths": torch.tensor([3, 2])}
    assert check_routed_experts(padded, cfg) is True
    with pytest.raises(ValueError, match=r"got \[3, 3\] at sample 1, token 2, MoE layer 0"):
        check_routed_experts({**padded, "input_lengths": torch.tensor([3, 3])}, cfg)
    outside = experts.clone()
    outside[0, 1, 1, 1] = -1
    with pytest.raises(
        ValueError,
        match=r"ids must lie in \[0, 4\), got min -1, max 3; first at sample 0, token 1, MoE "
        r"layer 1: \[\d, -1\]",
    ):
        check_routed_experts({**batch, "routed_experts": outside}, cfg)
    with pytest.raises(ValueError, match=r"\[B, S, L, K\] = \[2, 3, 2, 2\] .*got \[2, 3, 2, 3\]"):
        check_routed_experts(
            {**batch, "routed_experts": torch.zeros(2, 3, L, 3, dtype=torch.long)}, cfg
        )
