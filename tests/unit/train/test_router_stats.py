"""``extensions.moe.router_statistics`` host-side pieces: which router losses a config enables, the derived
metrics of the built-in statistics on hand-made tables, and the collector's errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_mcore_rl.extensions.moe.router_statistics import (
    DROPPED_TOKENS,
    ROUTER_MISMATCH,
    TOKENS_PER_EXPERT,
    RouterCall,
    RouterStatistics,
    StatsLayout,
    enabled_router_losses,
    router_loss_statistic,
)


def _config(types="aux_loss", coeffs=0.0, z=None):
    return SimpleNamespace(
        moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs, moe_z_loss_coeff=z
    )


def test_enabled_router_losses_follow_megatron_types_and_coefficients():
    assert enabled_router_losses(_config()) == ()
    assert enabled_router_losses(_config(coeffs=0.1)) == ("load_balancing_loss",)
    assert enabled_router_losses(_config(z=1e-3)) == ("z_loss",)
    both = _config(["seq_aux_loss", "global_aux_loss"], [0.0, 0.2], z=1e-3)
    assert enabled_router_losses(both) == ("global_load_balancing_loss", "z_loss")


def test_a_repeated_router_loss_type_takes_its_first_coefficient_as_megatron_does():
    # megatron's Router.get_aux_loss_coeff: routing_type.index("aux_loss") -> 0 -> coeffs[0]
    assert enabled_router_losses(_config(["aux_loss", "aux_loss"], [0.0, 0.1])) == ()
    first = _config(["aux_loss", "aux_loss"], [0.1, 0.0])
    assert enabled_router_losses(first) == ("load_balancing_loss",)


def test_statistic_metrics_on_hand_made_tables():
    layout = StatsLayout(tp_cp=2, topk=2)
    tokens = torch.tensor([[3.0, 5.0], [4.0, 4.0]], dtype=torch.float64)  # [layers, E]
    assert TOKENS_PER_EXPERT.metrics(tokens, layout) == {
        "moe/tokens_per_expert_max": 5.0,
        "moe/tokens_per_expert_mean": 4.0,
    }
    assert DROPPED_TOKENS.metrics(torch.tensor([[2.0], [1.0]]), layout) == {
        "moe/dropped_tokens": 3.0
    }
    # load balancing: per layer TP*CP * sum(n_mb * aux_r) / sum(n_mb): 2 * 3/6 = 1, 2 * 6/4 = 3
    table = torch.tensor([[3.0, 6.0], [6.0, 4.0]], dtype=torch.float64)
    lb = router_loss_statistic("load_balancing_loss").metrics(table, layout)
    assert lb == {"moe/load_balancing_loss": pytest.approx(2.0, abs=1e-12)}
    # z: token-weighted mean, no TP*CP factor: (0.5 + 1.5) / 2
    z = router_loss_statistic("z_loss").metrics(table, layout)
    assert z == {"moe/z_loss": pytest.approx(1.0, abs=1e-12)}


def test_router_statistics_errors():
    with pytest.raises(ValueError, match=r"`statistics` names must be unique"):
        RouterStatistics([], [TOKENS_PER_EXPERT, TOKENS_PER_EXPERT])
    dense = torch.nn.Linear(2, 2)
    dense.config = SimpleNamespace(num_moe_experts=None)  # what get_model_config reads
    with pytest.raises(ValueError, match="needs model chunks with MoE layers"):
        RouterStatistics([dense], [TOKENS_PER_EXPERT])


def test_router_mismatch_counts_slots_of_real_tokens_against_the_recorded_experts():
    # 3 tokens, 4 experts, top-2; token 2 is padding. Routed {0,1}, {2,3}, {0,1}; recorded
    # {1,0} (same set), {2,0} (one slot differs), {3,2} (padding: not counted)
    routing_map = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    call = RouterCall(
        layer=0, router=SimpleNamespace(topk=2), hidden_states=torch.zeros(3, 1, 4),
        padding_mask=torch.tensor([[False], [False], [True]]), probs=routing_map.double(),
        routing_map=routing_map, losses={}, recorded=torch.tensor([[1, 0], [2, 0], [3, 2]]),
    )  # fmt: skip
    counts = ROUTER_MISMATCH.count(call)
    assert counts.tolist() == [1.0, 4.0]  # 1 of the 2 x 2 real slots
    table = torch.stack([counts, torch.tensor([3.0, 4.0], dtype=torch.float64)])  # 2 layers
    metrics = ROUTER_MISMATCH.metrics(table, StatsLayout(tp_cp=1, topk=2))
    assert metrics == {"moe/router_mismatch_fraction": 0.5}  # (1 + 3) / (4 + 4)
