"""``MCoreRLStrategy(microbatching=MicrobatchConfig(sequence_packing=True))`` under a Trainer: the
``loss_fn`` path (ClippedPG, variable-length rows) packs each microbatch into one THD row and trains
exactly like the padded run: the same per-step ``train_loss``, logged loss metrics and grad norms,
and the same ``compute_logprobs`` on real tokens (fp32, within 1e-5), under DP=2, TP=2 and PP=2
(1F1B: the packed microbatches are padded to one length, megatron's p2p sends one shape).

Measured max |packed - padded| over 3 steps: metrics <= 8.4e-7, grad norms <= 2.8e-7,
logprobs <= 9.6e-7."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _strategy_packing_runs import PackingResult, max_run_diffs, packing_rank
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5
STEPS = 3
SPEC = RunSpec(steps=STEPS, rows=24, global_batch=8, mbs=2)


def _max_diffs(result: PackingResult) -> dict[str, float]:
    padded, packed = result.padded, result.packed
    assert padded.attention_layouts == ["sbhd"]  # the model really saw padded batches
    assert packed.attention_layouts == ["thd"]  # ... and one THD row per microbatch
    assert padded.global_step == STEPS
    return max_run_diffs(packed, padded)


@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"pp": 2}], ids=["dp2", "tp2", "pp2"])
def test_packed_loss_fn_run_matches_padded_run(layout):
    results = run_on_ranks(packing_rank, 2, replace(SPEC, **layout), timeout=120)
    for r in results:
        diffs = _max_diffs(r)
        print(f"{layout}: max |packed - padded| {diffs}")
        assert max(diffs.values()) <= ATOL, diffs
        # The packed run trains (the loss changes step to step) and is not the padded one.
        losses = [m["train_loss"] for m in r.packed.metrics]
        assert len(set(losses)) == STEPS
    assert results[0].packed.metrics == results[1].packed.metrics
