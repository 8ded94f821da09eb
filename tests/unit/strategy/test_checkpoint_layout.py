"""``checkpoint.check_layout`` on the layout records of ``StrategyCheckpoints.layout``: the rows
of docs/strategy.md's resume table that the multi-rank tests do not reach (CP, the reverse
directions, older records). The end-to-end resumes: tests/distributed/strategy/
test_strategy_resume_layouts.py."""

from __future__ import annotations

import pytest

from lightning_mcore_rl.strategy import checkpoint as ckpt
from lightning_mcore_rl.strategy.config import CheckpointConfig

RUN = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
       "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
       "data_parallel_size": 2, "use_distributed_optimizer": True, "precision": "32-true",
       "world_size": 2, "micro_batch_size": 1, "expert_model_parallel_size": 1}  # fmt: skip


def _layout(sharding: str = "dp_reshardable", **run: object) -> dict:
    config = CheckpointConfig(optimizer_sharding=sharding)  # type: ignore[arg-type]
    return ckpt.StrategyCheckpoints([], None, config, {**RUN, **run}).layout


def test_the_layout_record_holds_the_sizes_optimizer_and_precision():
    assert _layout() == {**{k: RUN[k] for k in ckpt.LAYOUT_FIELDS},
                         "optimizer_sharding": "dp_reshardable"}  # fmt: skip


@pytest.mark.parametrize(
    ("saved", "current"),
    [
        (_layout(), _layout(context_parallel_size=2, data_parallel_size=1)),
        (_layout(), _layout(virtual_pipeline_model_parallel_size=2,
                            pipeline_model_parallel_size=2, data_parallel_size=1)),
    ],
)  # fmt: skip
def test_dp_reshardable_refuses_a_cp_or_vpp_change(saved: dict, current: dict):
    with pytest.raises(ValueError, match=r"'dp_reshardable' format .*fully_reshardable"):
        ckpt.check_layout(saved, current)


def test_dp_reshardable_follows_dp_and_fully_reshardable_follows_any_size():
    ckpt.check_layout(_layout(), _layout(data_parallel_size=1))
    fully = _layout("fully_reshardable")
    ckpt.check_layout(fully, _layout(context_parallel_size=2, tensor_model_parallel_size=2))
    regular = _layout(use_distributed_optimizer=False)  # megatron's regular optimizer
    ckpt.check_layout(regular, {**regular, "context_parallel_size": 2, "data_parallel_size": 1})


@pytest.mark.parametrize(
    ("key", "saved", "current"),
    [
        ("use_distributed_optimizer", False, True),
        ("precision", "bf16-mixed", "32-true"),
        ("precision", "bf16-mixed", "bf16-true"),
    ],
)
def test_optimizer_and_precision_changes_raise_in_both_directions(key, saved, current):
    with pytest.raises(ValueError, match=rf"another `{key}` \({key}: {saved} -> {current}\)"):
        ckpt.check_layout(_layout(**{key: saved}), _layout(**{key: current}))


@pytest.mark.parametrize(("saved", "current"), [(1, 2), (2, 1)])
def test_an_ep_change_is_followed_by_the_regular_optimizer_only(saved, current):
    key = "expert_model_parallel_size"
    with pytest.raises(ValueError, match=rf"distributed-optimizer state was saved under another "
                       rf"`{key}` \({key}: {saved} -> {current}\); the distributed optimizer "
                       "shards"):  # fmt: skip
        ckpt.check_layout(_layout(**{key: saved}), _layout(**{key: current}))
    regular = {"use_distributed_optimizer": False}
    old, new = _layout(**regular, **{key: saved}), _layout(**regular, **{key: current})
    ckpt.check_layout(old, new)  # regrouped on load (strategy/optimizer_regroup.py)
    assert ckpt.expert_layout_changed(old, new)
    assert not ckpt.expert_layout_changed(new, new)
    assert not ckpt.expert_layout_changed({k: v for k, v in old.items() if k != key}, new)


def test_records_without_a_field_skip_its_comparison():
    ckpt.check_layout(None, _layout())
    older = {k: v for k, v in _layout().items() if k not in ("precision", "context_parallel_size")}
    ckpt.check_layout(older, _layout(precision="bf16-mixed", context_parallel_size=2))
