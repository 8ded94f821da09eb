"""``MCoreRLStrategy(logprobs=LogprobKernelConfig(use_fused_linear_logprobs=True))`` under a
Trainer: the last stage returns its final hidden states and the post-processors compute logprobs
from hidden x output weight in chunks (no ``[tokens, V/TP]`` logits: the output layer ran as the
pass-through on every step).
The packed ClippedPG GRPO run at temperature 2 trains exactly like the logits run: the same
per-step ``train_loss``, every logged metric, megatron's grad norms and ``compute_logprobs`` on
real tokens (fp32, within 1e-5), untied and tied embeddings (tied under PP: the last stage's own
copy of the embedding), with and without an entropy bonus, at TP=2, PP=2 (1F1B), CP=2 and TP=2
with sequence parallelism. What the fused path cannot serve raises ``ValueError`` on every rank.
With ``fused_gradient_in_forward=True``, on padded and packed rows (packed: one kernel call
per microbatch, whatever ``fuse_loss`` says), ClippedPG (token-local, no entropy, CP = 1) has
the fused head's gradients computed in the forward: every backward used them (none fell back),
and the run matches the logits run to the same tolerance; GSPO (not token-local) keeps the
recomputing backward, as does every run without the option.

Measured max |fused - logits| over 2 steps (every case): metrics <= 4.8e-7, grad norms
<= 6.6e-8, logprobs <= 9.6e-7 (packed fused runs sum the loss in one call per microbatch, the
logits runs per sequence)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _strategy_fused_runs import FusedCase, fused_error_rank, fused_vs_logits_rank
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5
STEPS = 2
SPEC = RunSpec(steps=STEPS, rows=16, global_batch=8, mbs=2)


def _check(*cases: FusedCase) -> None:
    results = run_on_ranks(fused_vs_logits_rank, 2, cases, timeout=150)
    for rank, rank_results in enumerate(results):
        for case, r in zip(cases, rank_results, strict=True):
            last_stage = rank == 1 or case.spec.pp == 1  # PP=2: rank 1 is the last stage
            print(
                f"{case}: max |fused - logits| {r.diffs}, "
                f"backwards on forward gradients {r.forward_gradients}"
            )
            # every training microbatch of the last stage: (global batch / DP) / mbs per step
            dp = 2 // (case.spec.tp * case.spec.pp * case.spec.cp)
            microbatches = STEPS * SPEC.global_batch // dp // SPEC.mbs
            expected = microbatches if case.expects_forward_gradients and last_stage else 0
            assert r.forward_gradients == expected, r.forward_gradients
            assert max(r.diffs.values()) <= ATOL, (case, r.diffs)
            assert len(set(r.losses)) == STEPS  # it trains
            assert ("train_entropy" in r.metric_names) == (case.entropy_coef > 0)
            # the fused run never computed logits; the reference always did
            expected = {"logits": ["logits"], "fused": ["fused"]} if last_stage else {}
            assert r.head_modes == (expected or {"logits": [], "fused": []})


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_fused_matches_logits_untied_and_tied(layout: dict[str, int]) -> None:
    spec = replace(SPEC, **layout)
    _check(FusedCase(spec), FusedCase(spec, tied=True, entropy_coef=0.01))


def test_fused_matches_logits_cp2_and_sequence_parallel() -> None:
    _check(
        FusedCase(replace(SPEC, cp=2), entropy_coef=0.01),
        FusedCase(replace(SPEC, tp=2, sequence_parallel=True), tied=True),
    )


def test_fused_gradient_in_forward_matches_logits() -> None:
    _check(
        FusedCase(replace(SPEC, tp=2), packing=False, gradient_in_forward=True),
        FusedCase(replace(SPEC, pp=2), packing=False, tied=True, gradient_in_forward=True),
        FusedCase(replace(SPEC, tp=2), packing=False, gspo=True, gradient_in_forward=True),
        FusedCase(replace(SPEC, tp=2), gradient_in_forward=True),
    )


def test_fused_rejects_what_needs_logits() -> None:
    errors = run_on_ranks(fused_error_rank, 2, replace(SPEC, tp=2), timeout=120)
    for rank_errors in errors:
        assert "top-k/top-p filtering" in rank_errors["top_k"]
        assert "top_k=8" in rank_errors["top_k"]
        assert "TopkLogitsPostProcessor" in rank_errors["topk_logits"]
        for message in rank_errors.values():
            assert "use_fused_linear_logprobs=False" in message
