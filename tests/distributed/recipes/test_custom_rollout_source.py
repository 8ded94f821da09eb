"""User rollout sources in the recipes under a Trainer at DP=2 (CPU, gloo): a factory passed as
``GRPOModule(rollout=RolloutSpec(backend=factory))`` is called once per rank with the strategy's
chunks and groups, and its tokens and logprobs are the training batch (checked against the
hand-derived rows); ``DistillationModule`` samples with its student source (a class) and, for
``val_teacher_reward``, with its teacher source (an instance), each task reward the one derived
by hand for the source's rule (counting on: 1; repeating: 0)."""

from __future__ import annotations

import torch
from _custom_source_runs import GROUP, LOGPROB, NEW, custom_sources_rank

from lightning_mcore_rl.testing import run_on_ranks


def test_recipes_sample_with_user_sources_at_dp2():
    results = run_on_ranks(custom_sources_rank, 2, timeout=240)
    for result in results:
        grpo = result["grpo"]
        assert grpo["setups"] == 1 and grpo["setup_is_the_strategy's"] and grpo["dp_size"] == 2
        assert len(grpo["seeds"]) == 2 == len(grpo["batches"])  # one rollout per step
        for batch in grpo["batches"]:
            prompts = batch["prompts"].repeat_interleave(GROUP, dim=0)  # [b*G, P]
            width = prompts.shape[1]
            counted = (prompts[:, -1:] + torch.arange(1, NEW + 1)) % 16
            assert torch.equal(batch["input_ids"], torch.cat([prompts, counted], dim=1))
            expected = torch.zeros(prompts.shape[0], width + NEW)
            expected[:, width:] = LOGPROB
            assert torch.equal(batch["generation_logprobs"], expected)
            assert torch.equal(batch["token_mask"], (expected != 0).float())
        assert grpo["rewards"] == [1.0, 1.0]
        assert result["student_calls"] == 2 + 1  # two steps, one validation batch
        assert result["teacher_calls"] == 1 and result["teacher_is_the_instance"]
        assert result["rewards"] == [0.0, 0.0]
        assert result["val_reward"] == 0.0 and result["val_teacher_reward"] == 1.0
    # each data-parallel rank rolls out its own prompts with its own seeds
    first, second = (r["grpo"] for r in results)
    assert first["seeds"] != second["seeds"]
    assert not torch.equal(first["batches"][0]["prompts"], second["batches"][0]["prompts"])
