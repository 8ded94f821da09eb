"""MoE layouts that would fail inside megatron are refused with the project's own error, in one
process, before any collective: expert TP 2 with EP 2 on gloo (megatron's token dispatchers
gather unequal token counts over the expert-TP group, which gloo's allgather refuses with
"invalid tensor size" in the first MoE forward: measured on 4 CPU ranks at TP=2 x EP=2), from
the strategy's ``setup_environment``, ``tiny_gpt_config`` and ``HFBridge.build_chunk``; and MoE
layers with biases under expert TP 2 (megatron's bare "Bias in Moe is only supported when
ETP==1")."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.trainer import cpu_trainer
from helpers.unit import TINY_HF_FIELDS

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.models import tiny_gpt_config
from lightning_mcore_rl.models.layout import check_expert_collectives
from lightning_mcore_rl.strategy import ParallelSizes, ReliabilityConfig
from lightning_mcore_rl.strategy.model import build_stage_chunks
from lightning_mcore_rl.train import ParallelGroups

GLOO_REFUSAL = (
    r"expert tensor parallelism with expert parallelism \(tp=2, ep=2, expert_tp=2\) cannot run "
    r"on gloo \(cpu\).*`expert_tensor_parallel_size=1`.*`expert_model_parallel_size=1`.*GPUs "
    r"\(NCCL\)"
)
MOE: dict[str, Any] = {"num_moe_experts": 4, "moe_router_topk": 2, "add_bias_linear": False}


def test_strategy_refuses_tp2_ep2_expert_tp2_on_cpu_before_any_process_group() -> None:
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        sequence_parallel=True,
        reliability=ReliabilityConfig(
            timedelta(seconds=5), rendezvous_timeout=timedelta(seconds=5)
        ),
    )  # expert TP unset: megatron's default, the TP size; the short rendezvous bounds a miss
    cpu_trainer(strategy=strategy, devices=4)  # connects accelerator, devices, environment
    with pytest.raises(ValueError, match=rf"^MCoreRLStrategy: {GLOO_REFUSAL}"):
        strategy.setup_environment()  # this process is rank 0 of 4; no rank was launched
    assert not dist.is_initialized()  # refused before the rendezvous


def test_the_layouts_the_refusal_names_pass() -> None:
    for sizes in (ParallelSizes(tp=2, ep=2, etp=1), ParallelSizes(tp=2), ParallelSizes(ep=2)):
        sizes.check_backend("gloo", "cpu")
    ParallelSizes(tp=2, ep=2).check_backend("nccl", "cuda")  # megatron's NCCL path
    ParallelSizes(tp=2, ep=2).check_backend("cpu:gloo,cuda:nccl", "cuda")
    with pytest.raises(ValueError, match=GLOO_REFUSAL):
        ParallelSizes(tp=2, ep=2).check_backend("cpu:gloo,cuda:nccl", "cpu")
    with pytest.raises(ValueError, match=r"^tiny: .*\(tp=1, ep=2, expert_tp=2\)"):
        check_expert_collectives(1, 2, 2, "gloo", "cpu", "tiny")


@pytest.fixture
def gloo_groups() -> Iterator[ParallelGroups]:
    """A real one-rank gloo world standing in for every group of rank 0 of a TP=2 x EP=2 layout
    (expert TP 2): the builders read sizes and the groups' backend only."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        yield ParallelGroups(
            tp_group=world, tp_rank=0, tp_size=2, pp_group=world, pp_rank=0, pp_size=1,
            pp_last_rank=0, dp_group=world, dp_rank=0, dp_size=2, cp_group=world, cp_rank=0,
            cp_size=1, ep_group=world, ep_rank=0, ep_size=2,
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_tiny_gpt_config_refuses_expert_tp2_with_ep2_on_gloo(gloo_groups: ParallelGroups) -> None:
    assert gloo_groups.etp_size == 2  # megatron's default: the TP group
    with pytest.raises(ValueError, match=rf"^tiny_gpt_config: {GLOO_REFUSAL}"):
        tiny_gpt_config(gloo_groups, sequence_parallel=True, **MOE)
    etp1 = dataclasses.replace(gloo_groups, etp_rank=0, etp_size=1)
    assert tiny_gpt_config(etp1, sequence_parallel=True, **MOE).expert_tensor_parallel_size == 1


def test_hf_bridge_build_chunk_refuses_expert_tp2_with_ep2_on_gloo(
    gloo_groups: ParallelGroups, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from lightning_mcore_rl.models import HFBridge

    config = Qwen3MoeConfig(
        **TINY_HF_FIELDS, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    bridge = HFBridge.from_pretrained(tmp_path)
    transformer_config = bridge.transformer_config(gloo_groups, sequence_parallel=True)
    with pytest.raises(ValueError, match=rf"^The model's MoE layers: {GLOO_REFUSAL}"):
        bridge.build_chunk(transformer_config, groups=gloo_groups)  # before GPTModel exists


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tiny_moe_with_biases_at_expert_tp2_gets_the_projects_error(
    sequence_parallel: bool,
) -> None:
    groups = dataclasses.replace(ParallelGroups.single(), tp_size=2, etp_size=2)
    moe: dict[str, Any] = {**MOE, "add_bias_linear": True}
    also = r" MoE layers under TP > 1 also need `sequence_parallel=True`\.$"
    match = (
        r"^tiny_gpt_config: MoE layers \(`num_moe_experts=4`\) with biases "
        r"\(`add_bias_linear=True`, megatron's default\) need an expert tensor-parallel size "
        r"of 1, got expert_tp=2 \(tp=2, ep=1;.*Pass `add_bias_linear=False`, or set "
        r"`expert_tensor_parallel_size=1` with `expert_model_parallel_size` > 1\."
        + ("$" if sequence_parallel else also)
    )
    with pytest.raises(ValueError, match=match):
        tiny_gpt_config(groups, sequence_parallel=sequence_parallel, **moe)
    del moe["add_bias_linear"]  # megatron's default is True
    with pytest.raises(ValueError, match=match):
        tiny_gpt_config(groups, sequence_parallel=sequence_parallel, **moe)


def test_a_module_config_with_moe_biases_at_expert_tp2_is_named_in_build_chunk() -> None:
    """A module that builds its own ``TransformerConfig`` in ``build_chunk``: megatron's bare
    assertion becomes a ``ValueError`` naming the setting and the fix."""
    from megatron.core.transformer import TransformerConfig

    def build(_vp_stage: int | None) -> TransformerConfig:
        return TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
            tensor_model_parallel_size=2, sequence_parallel=False,
        )  # fmt: skip

    with pytest.raises(
        ValueError,
        match=r"^`build_chunk`: megatron refused the config \(Bias in Moe is only supported "
        r"when ETP==1\): MoE layers with biases \(`TransformerConfig.add_bias_linear=True`.*"
        r"`add_bias_linear=False`, or set `MCoreRLStrategy\(expert_tensor_parallel_size=1\)`",
    ):
        build_stage_chunks(build, [None], "build_chunk")
