"""The embedded sampler: TP=2 draws the same tokens as TP=1, with the right logprobs."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.rollout import generate
from lightning_mcore_rl.testing import init_megatron_state, run_on_ranks, tiny_gpt, tiny_gpt_config

PROMPTS = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(0))


def _sample(rank: int, tp: int) -> dict[str, torch.Tensor]:
    init_megatron_state(tensor_model_parallel_size=tp)
    groups = megatron_groups()
    model = tiny_gpt(groups=groups)
    out = generate(
        model,
        PROMPTS,
        max_new_tokens=6,
        generator=torch.Generator().manual_seed(7),
        temperature=0.7,
        tp_group=groups.tp_group,
    )
    # independent reference on the final sequence, only meaningful at TP=1 (full-vocab logits)
    with torch.no_grad():
        tokens = out.tokens
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None).float()
    return {**out._asdict(), "logits": logits}


def test_tp2_sampling_matches_tp1_and_logprobs_are_exact():
    (ref,) = run_on_ranks(_sample, 1, 1)
    tp2 = run_on_ranks(_sample, 2, 2)
    for result in tp2:
        assert torch.equal(result["tokens"], ref["tokens"])  # both TP ranks agree with TP=1
        torch.testing.assert_close(result["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
    assert torch.equal(ref["tokens"][:, :5], PROMPTS)
    # logprob of token t+1 under softmax(logits[t] / T), recomputed in one forward pass
    expected = torch.log_softmax(ref["logits"][:, 4:-1] / 0.7, dim=-1)
    expected = expected.gather(-1, ref["tokens"][:, 5:, None]).squeeze(-1)
    torch.testing.assert_close(ref["logprobs"][:, 5:], expected, atol=1e-5, rtol=0)
    assert (ref["logprobs"][:, :5] == 0).all()
    assert ref["completion_mask"].sum().item() == 3 * 6


def _bad(rank: int) -> None:
    init_megatron_state()
    model = tiny_gpt(tiny_gpt_config(pipeline_model_parallel_size=1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, PROMPTS, max_new_tokens=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="integer"):
        generate(model, PROMPTS.float(), max_new_tokens=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="temperature"):
        generate(model, PROMPTS, max_new_tokens=1, temperature=0, generator=torch.Generator())


def test_bad_arguments():
    run_on_ranks(_bad, 1)
