"""``optimizer_regroup`` on hand-made megatron optimizer states: EP=2's two chained members
(dense, expert) <-> EP=1's one member, the LR scheduler's per-group lists and the refusals. The
end-to-end resumes: tests/distributed/strategy/test_strategy_moe_resume.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mcore_rl.strategy import optimizer_regroup as regroup


def group(wd_mult: float, expert: bool = False, **hyper: Any) -> dict[str, Any]:
    return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False,
            "is_expert_parallel": expert, "lr": 1e-3, **hyper}  # fmt: skip


def optimizer(*members: list[dict[str, Any]]) -> Any:
    """A ``ChainedOptimizer`` stand-in: members with their torch param groups."""
    return SimpleNamespace(chained_optimizers=[
        SimpleNamespace(optimizer=SimpleNamespace(param_groups=groups)) for groups in members
    ])  # fmt: skip


def loaded(saved: Any, *members: int) -> dict[Any, Any]:
    """What ``dist_checkpointing.load`` returns: the saved common part and, per member of this
    run, its tensors and its groups' local parameter ids (``members`` groups each)."""
    regrouped = {
        i: {"state": {0: {"exp_avg": torch.full((2,), float(i))}},
            "param_groups": [{"params": [k]} for k in range(n)]}
        for i, n in enumerate(members)
    }  # fmt: skip
    return {**saved, regroup.REGROUPED: regrouped}


STEP = torch.tensor(2.0)
EP1_SAVED = {"state": {"common_step": STEP}, "param_groups": [group(1.0, lr=6e-4), group(0.0)]}
EP2_SAVED = {
    0: {"state": {"common_step": STEP}, "param_groups": [group(1.0, lr=6e-4), group(0.0)]},
    1: {"state": {"common_step": STEP}, "param_groups": [group(1.0, True, lr=6e-4)]},
}


def test_ep2_state_merges_into_ep1s_one_optimizer():
    state, group_map = regroup.current_state(
        loaded(EP2_SAVED, 2), optimizer([group(1.0), group(0.0)])
    )
    assert group_map == [0, 1]  # the dense groups; the expert group agrees with group 0
    assert state["state"]["common_step"] is STEP
    assert [g["lr"] for g in state["param_groups"]] == [6e-4, 1e-3]  # saved, not this run's
    assert [g["params"] for g in state["param_groups"]] == [[0], [1]]
    assert not any(g["is_expert_parallel"] for g in state["param_groups"])


def test_ep1_state_splits_into_ep2s_dense_and_expert_optimizers():
    current = optimizer([group(1.0), group(0.0)], [group(1.0, True)])
    state, group_map = regroup.current_state(loaded(EP1_SAVED, 2, 1), current)
    assert sorted(state) == [0, 1] and group_map == [0, 1, 0]
    expert = state[1]["param_groups"][0]
    assert expert["is_expert_parallel"] and expert["lr"] == 6e-4
    assert state[1]["state"]["common_step"] is STEP
    assert float(state[1]["state"][0]["exp_avg"][0]) == 1.0  # member 1's loaded tensors


def test_scheduler_lists_follow_the_group_map():
    saved = {"base_lrs": [1.0, 2.0], "_last_lr": [0.1, 0.2], "lr_lambdas": [None, {"k": 1}],
             "last_epoch": 2, "_schedulers": [{"base_lrs": [3.0, 4.0]}]}  # fmt: skip
    state = regroup.scheduler_state(saved, [0, 1, 0])
    assert state["base_lrs"] == [1.0, 2.0, 1.0] and state["_last_lr"] == [0.1, 0.2, 0.1]
    assert state["lr_lambdas"] == [None, {"k": 1}, None] and state["last_epoch"] == 2
    assert state["_schedulers"] == [{"base_lrs": [3.0, 4.0, 3.0]}]


def test_merging_groups_with_other_hyperparameters_raises():
    saved = {**EP2_SAVED, 1: {"state": {}, "param_groups": [group(1.0, True, lr=5e-4)]}}
    match = (
        r"expert and dense optimizer parameter groups with \{'wd_mult': 1.0, .*\} have different "
        r"hyper-parameters \(lr: 0.0006 vs 0.0005\); .* Resume with the saved "
        r"`expert_model_parallel_size`"
    )
    with pytest.raises(ValueError, match=match):
        regroup.current_state(loaded(saved, 2), optimizer([group(1.0), group(0.0)]))


def test_a_group_missing_from_the_checkpoint_raises():
    with pytest.raises(ValueError, match=r"no optimizer parameter group with \{'wd_mult': 0.5, "):
        regroup.current_state(loaded(EP2_SAVED, 1), optimizer([group(0.5)]))


def test_members_saved_at_different_steps_raise():
    saved = {**EP2_SAVED, 1: {**EP2_SAVED[1], "state": {"common_step": torch.tensor(3.0)}}}
    with pytest.raises(ValueError, match=r"saved at different steps"):
        regroup.current_state(loaded(saved, 2), optimizer([group(1.0), group(0.0)]))


def _glu_build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
    """Like megatron's GLU factory: the weight is stored as two tensors ``_w``, ``_v``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    halves = zip((f"{key}_w", f"{key}_v"), torch.chunk(t, 2), strict=True)
    return {k: ShardedTensor.from_rank_offsets(k, half) for k, half in halves}


class _Member:
    """A chained member whose template holds one tensor and one GLU factory."""

    def sharded_state_dict(self, model_state: Any, is_loading: bool) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        a = ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.a", torch.zeros(2))
        fc1 = ShardedTensorFactory(
            "optimizer.state.exp_avg.fc1", torch.zeros(4), _glu_build, lambda sub: sub
        )
        return {"state": {0: {"exp_avg": a}, 1: {"exp_avg": fc1}}}


CHAIN = SimpleNamespace(chained_optimizers=[_Member()])


def test_template_keys_take_the_saved_chain_prefix():
    saved = {"chained_0.optimizer.state.exp_avg.a", "chained_1.optimizer.state.exp_avg.fc1_w",
             "chained_1.optimizer.state.exp_avg.fc1_v"}  # fmt: skip
    template = regroup.load_template(CHAIN, {}, saved)
    state = template[regroup.REGROUPED][0]["state"]
    assert state[0]["exp_avg"].key == "chained_0.optimizer.state.exp_avg.a"
    assert state[1]["exp_avg"].key == "chained_1.optimizer.state.exp_avg.fc1"
    flat = {k.removeprefix("chained_0.").removeprefix("chained_1.") for k in saved}
    unprefixed = regroup.load_template(CHAIN, {}, flat)[regroup.REGROUPED][0]["state"]
    assert unprefixed[0]["exp_avg"].key == "optimizer.state.exp_avg.a"


@pytest.mark.parametrize(
    ("saved", "found"),
    [({"optimizer.state.exp_avg.b"}, "no"),
     ({"chained_0.optimizer.state.exp_avg.a", "chained_1.optimizer.state.exp_avg.a"},
      "more than one")],
)  # fmt: skip
def test_a_tensor_the_checkpoint_does_not_store_once_raises(saved, found):
    with pytest.raises(KeyError, match=rf"'optimizer.state.exp_avg.a' under {found} chained"):
        regroup.load_template(CHAIN, {}, saved)
