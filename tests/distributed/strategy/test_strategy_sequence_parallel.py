"""``MCoreRLStrategy(tensor_model_parallel_size=2, sequence_parallel=True)`` under a Trainer on
CPU (gloo, fp32, tiny GPT; torch norms under SP through the CPU emulation): the ClippedPG GRPO
run, padded and packed, equals the TP=2 run without SP over 3 steps — every logged metric, grad
norms and ``compute_logprobs`` on real tokens within 1e-5. The rows are 15 tokens wide, so the
padded SP layout must pad them to a multiple of TP (megatron splits the sequence over TP ranks)
and the packed one every span to a multiple of TP.

Measured max |SP - no SP| over 3 steps (padded, packed): metrics <= 7.2e-7, grad norms <= 2.1e-7,
logprobs <= 9.6e-7."""

from __future__ import annotations

from dataclasses import replace

from _strategy_layout_runs import LayoutFit, layout_rank
from _strategy_packing_runs import max_run_diffs
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5
TP2 = RunSpec(tp=2, steps=3, rows=24, global_batch=8, mbs=2)
SP = replace(TP2, sequence_parallel=True)


def test_padded_and_packed_sequence_parallel_match_tp2_without_sp():
    fits = {
        "padded": LayoutFit(TP2, packing=False, narrow=True),
        "padded_sp": LayoutFit(SP, packing=False, narrow=True),
        "packed_sp": LayoutFit(SP, packing=True, narrow=True),
    }
    for runs in run_on_ranks(layout_rank, 2, fits, timeout=240):
        assert runs["padded"].attention_layouts == runs["padded_sp"].attention_layouts == ["sbhd"]
        assert runs["packed_sp"].attention_layouts == ["thd"]
        for name in ("padded_sp", "packed_sp"):
            diffs = max_run_diffs(runs[name], runs["padded"])
            print(f"{name}: max |{name} - padded| {diffs}")
            assert max(diffs.values()) <= ATOL, (name, diffs)
        losses = [m["train_loss"] for m in runs["padded"].metrics]
        assert len(set(losses)) == TP2.steps  # it trains
