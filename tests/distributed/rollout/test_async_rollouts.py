"""Asynchronous GRPO (``RolloutSpec(max_staleness=1)``): the rollout a step trains was sampled by
the previous step's weights — its ``generation_logprobs`` equal the trainer's logprobs under a
copy of those weights and differ from the current ones — and ``rollout_staleness`` says so;
with the embedded sampler (sampled in the foreground, a step early) and with the Hugging Face
copy sampling in a background thread at TP=2 (its generator broadcasts to the other rank) and at
DP=2 (two generators, each sampling its replica's prompts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))  # the tiny HF model builders

from _hf_ranks import build_hf_model, hf_configs  # noqa: E402
from _rollout_ranks import (  # noqa: E402
    async_grpo_run,
    async_without_peek,
    check_one_step_stale,
)

from lightning_mcore_rl.testing import run_on_ranks  # noqa: E402

STEPS = 4
# fp32. The embedded sampler runs the training chunk itself (measured max |diff| 2.4e-7 to
# 4.8e-7); the HF copy is transformers' kernels on the refit weights (measured <= 9.5e-7). 1e-5
# bounds both; one step at lr 1e-2 moves the logprobs by > 1e-2 (measured 0.76 to 2.33), the bound
# that shows the rollout was NOT sampled by the current weights.
TOL = 1e-5
MOVED = 1e-2


def test_embedded_sampler_one_step_off_policy():
    (result,) = run_on_ranks(async_grpo_run, 1, None, "megatron", 1, STEPS, 1, timeout=120)
    check_one_step_stale(result, STEPS, TOL, MOVED)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [2, 1], ids=["tp2-one-generator", "dp2-two-generators"])
def test_hf_copy_samples_in_the_background(tmp_path, tp):
    build_hf_model(hf_configs()["llama"], tmp_path, seed=1)
    results = run_on_ranks(async_grpo_run, 2, str(tmp_path), "hf", tp, STEPS, 1, timeout=170)
    for result in results:
        check_one_step_stale(result, STEPS, TOL, MOVED)
    assert results[0]["rows"] == results[1]["rows"]  # logged metrics agree across ranks


def test_a_loader_without_peek_is_refused():
    (message,) = run_on_ranks(async_without_peek, 1, timeout=120)
    assert "`rollout.max_staleness=1`" in message and "got DataLoader" in message, message
