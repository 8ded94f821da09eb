"""``MCoreRLModule(loss_fn=ClippedPGLossFn)`` under a Trainer runs ``lightning_mcore_rl.train``
exactly like a bare loop calling the same train-layer functions (bitwise microbatch losses),
logs the global loss (sum over microbatches and DP) and ``compute_logprobs`` matches the bare
``LogprobsPostProcessor`` run on every rank."""

from __future__ import annotations

import pytest
import torch
from _strategy_rl_runs import grpo_rank
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks


@pytest.mark.parametrize("layout", [{"tp": 2}, {}], ids=["tp2", "dp2"])
def test_grpo_loss_fn_path_matches_bare_train_layer_loop(layout):
    spec = RunSpec(steps=2, rows=16, global_batch=4, **layout)
    results = run_on_ranks(grpo_rank, 2, spec, timeout=120)
    for r in results:
        assert r.global_step == 2
        assert [tuple(x) for x in r.bare.losses] == r.microbatch_losses  # bitwise
        for mine, bare in zip(r.logprobs, r.bare.logprobs, strict=True):
            assert torch.equal(mine, bare)
    assert results[0].metrics == results[1].metrics
    # Global loss of the LAST step = sum of all DP ranks' microbatch losses (distinct DP ranks).
    dp_ranks = results if "tp" not in layout else results[:1]
    expected = sum(sum(r.bare.losses[-1]) for r in dp_ranks)
    assert results[0].metrics["train_loss"] == pytest.approx(expected, abs=1e-6)
