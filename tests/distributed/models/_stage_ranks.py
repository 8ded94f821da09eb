"""Rank function of the stage-flag test: ``ParallelGroups.is_first_stage`` / ``is_last_stage``
against megatron's own ``is_pipeline_first_stage`` / ``is_pipeline_last_stage`` (with
``ignore_virtual=False``), and the stage flags of the chunks ``tiny_gpt`` builds from the
groups."""

from __future__ import annotations

from typing import Any

from megatron.core import parallel_state as ps

from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config


def _flags(vpp: int | None) -> dict[str, Any]:
    """``{"ours", "megatron", "chunks"}``: (first, last) per ``vp_stage`` of this rank's layout
    at PP=2 (x ``vpp``); without VPP ``vp_stage`` 0 and 1 are asked too (megatron ignores it)."""
    init_megatron_state(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp)
    groups = megatron_groups()
    stages = list(range(vpp)) if vpp else [None, 0, 1]

    def megatron(stage: int | None) -> tuple[bool, bool]:
        return (
            ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        )

    config = tiny_gpt_config(groups, num_layers=4)
    chunks = [tiny_gpt(config, groups=groups, vp_stage=s) for s in (stages if vpp else [None])]
    return {
        "ours": [(groups.is_first_stage(s), groups.is_last_stage(s)) for s in stages],
        "megatron": [megatron(s) for s in stages],
        "chunks": [(c.pre_process, c.post_process) for c in chunks],
    }


def stage_flags(rank: int) -> dict[str, Any]:
    """The flags at PP=2 x VPP=2, then (megatron re-initialised) at PP=2 without VPP."""
    return {"vpp=2": _flags(2), "vpp=None": _flags(None)}
