"""Rank functions for context- and sequence-parallel ``MCoreRLStrategy`` runs: several ClippedPG
GRPO fits (same weights, same rows) under different layouts in ONE spawned process group, each
recorded by :func:`~_strategy_packing_runs.fit_recorded`; the tests compare them to a reference
layout with :func:`~_strategy_packing_runs.max_run_diffs`."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from _strategy_packing_runs import PackedGRPOModule, RecordedRun, fit_recorded
from _strategy_rl_runs import RolloutRows
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import destroy_megatron_state


class NarrowRows(RolloutRows):
    """:class:`RolloutRows` cut to an odd width (15 columns, lengths clamped to it): sequence
    parallelism at TP=2 must pad the padded layout's rows to an even width."""

    WIDTH = 15

    def __init__(self, num_rows: int) -> None:
        super().__init__(num_rows)
        self.lengths = self.lengths.clamp(max=self.WIDTH)
        self.ids = self.ids[:, : self.WIDTH]
        self.token_mask = self.token_mask[:, : self.WIDTH]
        self.advantages = self.advantages[:, : self.WIDTH]
        self.logprobs = [lp[:, : self.WIDTH] for lp in self.logprobs]


@dataclass(frozen=True)
class LayoutFit:
    """One fit of :func:`layout_rank`: the layout, packing, position embedding and data width."""

    spec: RunSpec
    packing: bool
    position_embedding_type: str = "learned_absolute"
    narrow: bool = False


def layout_rank(rank: int, fits: dict[str, LayoutFit]) -> dict[str, RecordedRun]:
    """Run every fit in order (megatron's parallel state is rebuilt for each layout)."""
    world_size = int(os.environ["WORLD_SIZE"])
    out = {}
    for name, fit in fits.items():
        destroy_megatron_state()
        rows = (NarrowRows if fit.narrow else RolloutRows)(fit.spec.rows)
        module = PackedGRPOModule(fit.position_embedding_type)
        out[name] = fit_recorded(fit.spec, world_size, module, rows, packing=fit.packing)
    return out


def first_error_rank(rank: int, fit: LayoutFit, spec_module: bool) -> str:
    """The error a fit raises (``""`` when none); ``spec_module``: build the tiny GPT on
    megatron's default local spec (no packed attention) instead."""
    world_size = int(os.environ["WORLD_SIZE"])
    module = LocalSpecModule() if spec_module else PackedGRPOModule(fit.position_embedding_type)
    try:
        fit_recorded(fit.spec, world_size, module, RolloutRows(fit.spec.rows), packing=fit.packing)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return ""


class LocalSpecModule(PackedGRPOModule):
    """The tiny GPT on megatron's own local layer spec (``DotProductAttention``: no THD)."""

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config

        groups = self.parallel_groups
        config = tiny_gpt_config(groups, calculate_per_token_loss=True)
        spec = get_gpt_layer_local_spec()
        return tiny_gpt(config, groups=groups, vocab_size=128, seed=0, vp_stage=vp_stage,
                        transformer_layer_spec=spec)  # fmt: skip
