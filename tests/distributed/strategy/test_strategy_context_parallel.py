"""``MCoreRLStrategy(context_parallel_size=2)`` with ``MicrobatchConfig(sequence_packing=True)``
under a Trainer on CPU (gloo, fp32, the tiny GPT on the packed local spec:
``PackedDotProductAttention`` gathers keys and values over CP): the ClippedPG GRPO run equals the
CP=1 run over 3 steps — every logged metric (``train_loss`` and the loss metrics), megatron's grad
norms and ``compute_logprobs`` on real tokens within 1e-5 — at CP=2 (2 ranks) and CP=2 x TP=2 (4
ranks), with learned absolute positions (per-document ids, CP-sharded) and with RoPE (megatron
applies it per span at CP-aware positions). The CP=1 references hold the whole global batch on every
rank (DP=1: TP=2 on 2 ranks, TP=4 on 4), so ``compute_logprobs`` compares row for row.

Measured max |CP - CP=1| over 3 steps (CP=2 learned / RoPE, CP2xTP2): metrics <= 8.4e-7, grad
norms <= 3.1e-7, logprobs <= 9.6e-7."""

from __future__ import annotations

from dataclasses import replace

from _strategy_layout_runs import LayoutFit, first_error_rank, layout_rank
from _strategy_packing_runs import max_run_diffs
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5
SPEC = RunSpec(steps=3, rows=24, global_batch=8, mbs=2)


def _check(runs: dict, reference: str, candidates: list[str]) -> None:
    for name in candidates:
        assert runs[name].attention_layouts == ["thd"]
        diffs = max_run_diffs(runs[name], runs[reference])
        print(f"{name}: max |{name} - {reference}| {diffs}")
        assert max(diffs.values()) <= ATOL, (name, diffs)
    losses = [m["train_loss"] for m in runs[reference].metrics]
    assert len(set(losses)) == SPEC.steps  # it trains


def test_cp2_matches_cp1_learned_and_rope():
    fits = {
        "tp2": LayoutFit(replace(SPEC, tp=2), packing=True),
        "cp2": LayoutFit(replace(SPEC, cp=2), packing=True),
        "tp2_rope": LayoutFit(replace(SPEC, tp=2), packing=True, position_embedding_type="rope"),
        "cp2_rope": LayoutFit(replace(SPEC, cp=2), packing=True, position_embedding_type="rope"),
    }
    for runs in run_on_ranks(layout_rank, 2, fits, timeout=240):
        _check(runs, "tp2", ["cp2"])
        _check(runs, "tp2_rope", ["cp2_rope"])


def test_cp2_tp2_matches_cp1_on_four_ranks():
    fits = {
        "tp4": LayoutFit(replace(SPEC, tp=4), packing=True),
        "cp2_tp2": LayoutFit(replace(SPEC, cp=2, tp=2), packing=True),
    }
    for runs in run_on_ranks(layout_rank, 4, fits, timeout=240):
        _check(runs, "tp4", ["cp2_tp2"])


def test_packing_on_megatron_local_spec_names_the_packed_spec():
    error = run_on_ranks(
        first_error_rank, 2, LayoutFit(replace(SPEC, tp=2), packing=True), True, timeout=120
    )
    for message in error:
        assert message.startswith("ValueError: sequence packing needs a core attention")
        assert "get_packed_local_layer_spec()" in message


def test_cp_on_megatron_local_spec_names_the_cp_capable_spec():
    error = run_on_ranks(
        first_error_rank, 2, LayoutFit(replace(SPEC, cp=2), packing=True), True, timeout=120
    )
    for message in error:
        assert message.startswith(
            "ValueError: `build_chunk`: context_parallel_size > 1 needs a CP-capable core attention"
        ), message
        assert "get_packed_local_layer_spec()" in message
