"""``MCoreRLModule(loss_fn=ClippedPGLossFn)`` under ``MCoreRLStrategy(pipeline_model_parallel_size=2,
virtual_pipeline_model_parallel_size=2)``: megatron's interleaved schedule on the ``loss_fn`` path
trains exactly like the PP=2 1F1B run of the same 4-layer tiny GPT (layout-invariant weights, same
batches): per step the same ``train_loss``, every logged metric, grad norm, per-microbatch loss
and ``compute_logprobs`` (forward-only, interleaved too), within 1e-6 over 3 steps.

The PP=2 run is itself checked against one loss call on the whole batch in
``test_strategy_loss_metrics.py`` (``pp2``), so this pins the interleaved schedule to it."""

from __future__ import annotations

from _strategy_packing_runs import max_run_diffs
from _strategy_vpp_runs import vpp_rank
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-6
STEPS = 3
# 2 ranks = PP=2, DP=1: 8 rows per step in 4 microbatches of 2 (a multiple of PP, as the
# interleaved schedule needs); 4 layers = 2 per stage = 1 per chunk with VPP=2.
SPEC = RunSpec(pp=2, vpp=2, num_layers=4, steps=STEPS, rows=24, global_batch=8, mbs=2)


def test_pp2_vpp2_loss_fn_run_matches_pp2_run():
    results = run_on_ranks(vpp_rank, 2, SPEC, timeout=180)
    for rank, r in enumerate(results):
        pp, vpp = r["pp"], r["vpp"]
        assert pp.layers_per_chunk == [2] and vpp.layers_per_chunk == [1, 1], rank
        assert vpp.recorded.global_step == STEPS
        diffs = max_run_diffs(vpp.recorded, pp.recorded)
        # 4 microbatch losses per step on both stages (the step's statistics are broadcast).
        assert [len(x) for x in vpp.microbatch_losses] == [4] * STEPS
        mb_diff = max(
            abs(a - b)
            for x, y in zip(vpp.microbatch_losses, pp.microbatch_losses, strict=True)
            for a, b in zip(x, y, strict=True)
        )
        print(f"rank {rank}: max |vpp - pp| {diffs}, microbatch losses {mb_diff}")
        assert max(*diffs.values(), mb_diff) <= ATOL, (diffs, mb_diff)
        # The run trains: the loss changes from step to step.
        assert len({m["train_loss"] for m in vpp.recorded.metrics}) == STEPS
    # Every logged value is identical on both pipeline stages.
    assert results[0]["vpp"].recorded.metrics == results[1]["vpp"].recorded.metrics
