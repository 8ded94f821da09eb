"""Rank functions for the ``loss_fn`` path under the interleaved (virtual pipeline) schedule: the
ClippedPG GRPO run of ``_strategy_rl_runs`` fitted twice in one rank process, PP without VPP
(1F1B) and PP x VPP (interleaved), on the same layout-invariant tiny GPT and the same batches."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from _strategy_packing_runs import RecordedRun, StepRecorder
from _strategy_rl_runs import GRPOModule, RolloutRows
from _strategy_runs import make_trainer
from helpers.distributed import RunSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.utils.data import DataLoader

from lightning_mcore_rl.testing import destroy_megatron_state


@dataclass(frozen=True)
class ScheduleRun:
    """One fit: what :class:`StepRecorder` saw, the step's microbatch losses (every rank gets
    them) and the transformer layers of each of this rank's model chunks."""

    recorded: RecordedRun
    microbatch_losses: list[tuple[float, ...]]
    layers_per_chunk: list[int]


def _fit(spec: RunSpec, world_size: int) -> ScheduleRun:
    recorder = StepRecorder()
    trainer = make_trainer(spec, world_size, callbacks=[recorder])
    module = GRPOModule(num_layers=spec.num_layers)
    trainer.fit(module, DataLoader(RolloutRows(spec.rows), batch_size=spec.local_batch(world_size)))
    assert module.chunks is not None
    layers = [sum(isinstance(m, TransformerLayer) for m in c.modules()) for c in module.chunks]
    destroy_megatron_state()  # the next fit has another (virtual) pipeline layout
    return ScheduleRun(
        recorded=RecordedRun(
            attention_layouts=[],  # not recorded: the batches are padded, never packed
            logprobs=recorder.logprobs,
            lengths=recorder.lengths,
            metrics=recorder.metrics,
            grad_norms=recorder.grad_norms,
            global_step=trainer.global_step,
        ),
        microbatch_losses=module.microbatch_losses,
        layers_per_chunk=layers,
    )


def vpp_rank(rank: int, spec: RunSpec) -> dict[str, ScheduleRun]:
    """``"pp"``: ``spec`` without VPP (1F1B); ``"vpp"``: ``spec`` as given (interleaved)."""
    world_size = int(os.environ["WORLD_SIZE"])
    return {"pp": _fit(replace(spec, vpp=None), world_size), "vpp": _fit(spec, world_size)}
