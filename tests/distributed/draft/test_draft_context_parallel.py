"""An EAGLE draft under context parallelism is refused by the project, alike on every rank and
before anything is built (the draft attends over whole sequences): by ``eagle_draft`` and
``eagle3_draft`` given CP groups (or, ``groups`` omitted, a CP policy config), and by the
strategy's setup for a draft of the module's own builder, all at CP=2 on two gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
from _draft_trainer_runs import DraftSFT
from helpers.trainer import cpu_trainer
from megatron.core.transformer.module import MegatronModule

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.models.draft_model import eagle_draft, eagle_draft_config
from lightning_mcore_rl.models.eagle3 import eagle3_draft
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt_config
from lightning_mcore_rl.recipes import SFTDataModule, SFTModule
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.strategy.parallel import megatron_groups
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state, run_on_ranks

REFUSAL = (
    "An EAGLE draft needs context_parallel_size=1 (it attends over whole sequences), but this "
    "layout has context_parallel_size=2. Train the draft with context_parallel_size=1"
)


class OwnDraftSFT(SFTModule):
    """SFT whose hook returns a megatron module of its own (no builder of the package's)."""

    def build_draft_model(self) -> torch.nn.Module | None:
        assert self.chunks is not None
        config = self.chunks[-1].config  # megatron's wrappers carry the chunk's config
        return MegatronModule(config=eagle_draft_config(config))


def _error(call: Any) -> str:
    """``"type: message"`` of what ``call()`` raised (``""``: nothing)."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return ""


def _cp2_drafts(rank: int) -> dict[str, str]:
    out: dict[str, str] = {}
    init_megatron_state(context_parallel_size=2)
    groups = megatron_groups()
    config = tiny_gpt_config(groups)
    for name, build in (("eagle", eagle_draft), ("eagle3", eagle3_draft)):
        out[name] = _error(lambda b=build: b(config, vocab_size=16, aux_layers=(1,), groups=groups))
    out["groups_omitted"] = _error(lambda: eagle_draft(config, vocab_size=16, aux_layers=(1,)))
    destroy_megatron_state()
    for name, module in (("trainer", DraftSFT), ("own_draft", OwnDraftSFT)):
        strategy = MCoreRLStrategy(
            context_parallel_size=2,
            microbatching=MicrobatchConfig(micro_batch_size=8, sequence_packing=True),
        )
        trainer = cpu_trainer(strategy=strategy, max_steps=1, num_sanity_val_steps=0)
        out[name] = _error(
            lambda t=trainer, m=module: t.fit(m(), datamodule=SFTDataModule(num_steps=2))
        )
        destroy_megatron_state()
    return out


def test_a_draft_under_context_parallelism_is_refused_on_every_rank() -> None:
    results = run_on_ranks(_cp2_drafts, 2, timeout=300)
    for rank, out in enumerate(results):
        for case, message in out.items():
            assert message.startswith(f"ValueError: {REFUSAL}"), (rank, case, message)
            assert "tensor_model_parallel_size" in message and "build_draft_model()" in message
    assert results[0] == results[1]  # the same decision and message on both ranks
