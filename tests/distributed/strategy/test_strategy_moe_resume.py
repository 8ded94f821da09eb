"""Resuming the tiny MoE GPT's ClippedPG run (aux loss on): at the saved expert layout (EP=2 on
2 ranks) the resumed steps equal the uninterrupted run bitwise (model, expert optimizer, step);
a changed EP size raises ValueError naming it on every rank before any rank loads (megatron
chains a separate expert optimizer under EP > 1; the single optimizer of EP=1 cannot take its
state: unchecked, the load failed with a KeyError deep in dist_checkpointing)."""

from __future__ import annotations

from _strategy_moe_resume_runs import SAVED_AT, moe_resume_rank
from _strategy_moe_runs import MoESpec

from lightning_mcore_rl.testing import run_on_ranks

EP2, EP1 = MoESpec(ep=2, aux=0.01), MoESpec(ep=1, aux=0.01)


def test_moe_resume_at_ep2_is_exact(tmp_path):
    for result in run_on_ranks(moe_resume_rank, 2, EP2, EP2, str(tmp_path), timeout=180):
        reference, resumed = result["reference"], result["resumed"]
        assert not isinstance(resumed, str), resumed
        assert resumed["losses"] == reference["losses"][SAVED_AT:]
        assert resumed["grad_norms"] == reference["grad_norms"][SAVED_AT:]
        assert resumed["global_step"] == reference["global_step"]


def test_moe_resume_under_another_ep_size_raises_on_every_rank(tmp_path):
    for result in run_on_ranks(moe_resume_rank, 2, EP2, EP1, str(tmp_path), timeout=180):
        assert result["resumed"].startswith("ValueError: The checkpoint's optimizer state was "
                                            "saved with another `expert_model_parallel_size` "
                                            "(expert_model_parallel_size: 2 -> 1)")  # fmt: skip
