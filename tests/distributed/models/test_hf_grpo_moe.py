"""The shipped ``grpo_moe_tiny.yaml`` trains a tiny Hugging Face Qwen3-MoE with GRPO through
``lmrl fit`` at EP=2 on two ranks, and every logged value equals the same run with the experts
replicated (EP=1, same DP=2): expert parallelism changes where the experts live, not the step.

fp32 on CPU: the two layouts reorder only the token dispatch and the gradient reductions
(measured equal to <= 1e-7 relative on every metric); 1e-5 relative leaves room for other
kernels while a wrong expert shard or a missing reduction moves the grad norm by > 1e-2.
"""

from __future__ import annotations

import math

import pytest
from _hf_grpo_ranks import lmrl_fit

from lightning_mcore_rl.recipes import train_tokenizer, write_tiny_qwen3_moe
from lightning_mcore_rl.testing import run_on_ranks

STEPS = 3
MBS = ("--trainer.strategy.init_args.microbatching.micro_batch_size=8",)  # 4 prompts x 4 / DP=2
EP1 = (*MBS, "--trainer.strategy.init_args.expert_model_parallel_size=1")


def test_lmrl_fit_grpo_moe_at_ep2_equals_ep1(tmp_path):
    source = tmp_path / "qwen3_moe"
    tokenizer = train_tokenizer([" ".join(str(i) for i in range(16))])
    write_tiny_qwen3_moe(source, tokenizer, seed=1, random_pad_embedding=True)  # as make_tiny_hf
    runs = {
        ep: run_on_ranks(
            lmrl_fit,
            2,
            str(source),
            str(tmp_path / f"ep{ep}"),
            STEPS,
            "grpo_moe_tiny.yaml",
            MBS if ep == 2 else EP1,
            timeout=240,
        )  # fmt: skip
        for ep in (2, 1)
    }
    rank0, rank1 = runs[2]
    assert rank0 == rank1  # every logged value identical on both ranks
    assert len(rank0) == STEPS
    for row in rank0:
        assert math.isfinite(row["train_loss"]) and 0.0 <= row["reward"] <= 1.0
        assert 0 < row["grad_norm"] < 10  # the pad row is a real embedding (no 1/sqrt(eps) blow-up)
    for ep2_row, ep1_row in zip(rank0, runs[1][0], strict=True):
        timing = ("step_time", "samples_per_sec", "tokens_per_sec")
        keys = sorted(set(ep2_row) - set(timing))
        assert keys == sorted(set(ep1_row) - set(timing))
        for key in keys:
            assert ep2_row[key] == pytest.approx(ep1_row[key], rel=1e-5, abs=1e-7), key
