"""The model builders take the layout as an argument (``ParallelGroups``): the single-rank
layout, the stage flags, the config sizes it implies, and the refusal of a config made for
another layout (e.g. a TP=2 config with ``groups`` omitted), before any model is built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mcore_rl.models import load_deterministic_weights, tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.parallel import ParallelGroups

SINGLE = ParallelGroups.single()
TP2 = dataclasses.replace(SINGLE, tp_size=2, tp_rank=1)
PP2_VPP2 = dataclasses.replace(SINGLE, pp_size=2, pp_last_rank=1, vpp_size=2)


def _stage(rank: int, vpp: int | None) -> ParallelGroups:
    return dataclasses.replace(PP2_VPP2, pp_rank=rank, vpp_size=vpp)


def test_single_is_one_rank_without_parallelism() -> None:
    fields = dataclasses.asdict(SINGLE)
    assert {k: v for k, v in fields.items() if k.endswith("_rank")} == dict.fromkeys(
        ("tp_rank", "pp_rank", "pp_last_rank", "dp_rank", "cp_rank", "ep_rank", "etp_rank"), 0
    )
    assert {k: v for k, v in fields.items() if k.endswith("_size")} == {
        "tp_size": 1, "pp_size": 1, "dp_size": 1, "cp_size": 1, "vpp_size": None,
        "ep_size": 1, "etp_size": 1,
    }  # fmt: skip
    assert [v for k, v in fields.items() if k.endswith("_group")] == [None] * 7


def test_expert_tp_defaults_to_the_tp_group() -> None:
    groups = ParallelGroups(
        tp_group="tp", tp_rank=1, tp_size=2, pp_group=None, pp_rank=0, pp_size=1,
        pp_last_rank=0, dp_group=None, dp_rank=0, dp_size=1, cp_group=None, cp_rank=0,
        cp_size=1,
    )  # fmt: skip
    assert (groups.etp_group, groups.etp_rank, groups.etp_size) == ("tp", 1, 2)
    assert (groups.ep_group, groups.ep_rank, groups.ep_size) == (None, 0, 1)
    assert SINGLE.is_first_stage(None) and SINGLE.is_last_stage(None)
    assert SINGLE.is_pipeline_last_stage


@pytest.mark.parametrize(
    ("rank", "vpp", "expected"),
    [  # (first, last) for vp_stage 0 and 1; without VPP megatron ignores vp_stage
        (0, 2, [(True, False), (False, False)]),
        (1, 2, [(False, False), (False, True)]),
        (0, None, [(True, False), (True, False)]),
        (1, None, [(False, True), (False, True)]),
    ],
)
def test_stage_flags(rank: int, vpp: int | None, expected: list[tuple[bool, bool]]) -> None:
    groups = _stage(rank, vpp)
    assert [(groups.is_first_stage(s), groups.is_last_stage(s)) for s in (0, 1)] == expected


def test_a_missing_vp_stage_under_vpp_is_refused() -> None:
    for flag in (PP2_VPP2.is_first_stage, PP2_VPP2.is_last_stage):
        with pytest.raises(ValueError, match=r"`vp_stage` must be a chunk index in \[0, 2\).*None"):
            flag(None)


def test_tiny_gpt_config_takes_its_sizes_from_groups() -> None:
    groups = dataclasses.replace(PP2_VPP2, tp_size=2, cp_size=2)
    config = tiny_gpt_config(groups, num_layers=4)
    sizes = (
        config.tensor_model_parallel_size,
        config.pipeline_model_parallel_size,
        config.virtual_pipeline_model_parallel_size,
        config.context_parallel_size,
    )
    assert sizes == (2, 2, 2, 2)
    assert (config.overlap_p2p_comm, config.batch_p2p_comm) == (True, False)  # interleaved
    single = tiny_gpt_config()  # None: the single-rank layout, whatever megatron holds
    assert (single.tensor_model_parallel_size, single.pipeline_model_parallel_size) == (1, 1)
    assert single.virtual_pipeline_model_parallel_size is None


def test_a_config_of_another_layout_is_refused_before_building() -> None:
    config = tiny_gpt_config(TP2)
    message = (
        r"The model config has tensor_model_parallel_size=2 but `groups` has tp_size=1: pass "
        r"this rank's `groups`"
    )
    with pytest.raises(ValueError, match=message):
        tiny_gpt(config)  # groups omitted: megatron's state is never read (none exists here)
    with pytest.raises(
        ValueError, match="pipeline_model_parallel_size=1 but `groups` has pp_size=2"
    ):
        tiny_gpt(tiny_gpt_config(), groups=PP2_VPP2)
    model = torch.nn.Linear(2, 2)
    model.config = config  # type: ignore[assignment]  # what a megatron module carries
    with pytest.raises(ValueError, match=message):
        load_deterministic_weights(model, 0)
