"""Text rollouts on a tiny random Llama over a 16-word tokenizer (fp32, gloo): the Hugging Face
source on left-padded prompts with an EOS stop equals ``transformers`` on each unpadded row, and
the GRPO recipe on a text task (``TextRewardTask``) keeps its HF backend exact after every refit:
``token_mult_prob_error`` = 1 within 1e-5 on right-aligned rows of stopped completions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))  # the tiny HF model builders

from _text_ranks import EOS, PAD, padded_source, text_grpo_run, write_text_model  # noqa: E402

from lightning_mcore_rl.testing import run_on_ranks  # noqa: E402

TOL = 1e-5


def test_hf_source_left_padding_and_eos_equal_transformers_per_row(tmp_path):
    from transformers import AutoModelForCausalLM

    write_text_model(tmp_path, seed=2)
    (result,) = run_on_ranks(padded_source, 1, str(tmp_path), timeout=120)
    out, prompt_ids = result["rollout"], result["prompt_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    width = out.tokens.shape[1] - 8
    stopped = 0
    for row, ids in enumerate(prompt_ids):
        length = len(ids)
        assert out.prompt_lengths[row] == length
        assert out.tokens[row, width - length : width].tolist() == ids
        completion = out.tokens[row, width:][out.completion_mask[row, width:].bool()]
        assert out.completion_mask[row, :width].sum() == 0
        # the completion ends at its first EOS (or runs to N = 8), then PAD, mask and logprob 0
        eos = (completion == EOS).nonzero()
        assert eos.numel() == 0 or int(eos[0]) == completion.numel() - 1
        stopped += int(eos.numel() > 0)
        rest = slice(width + completion.numel(), None)
        assert (out.tokens[row, rest] == PAD).all() and (
            out.generation_logprobs[row, rest] == 0
        ).all()
        # transformers on the unpadded prompt + completion, teacher-forced, at temperature 1.2
        sequence = torch.tensor([ids + completion.tolist()])
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0, length - 1 : -1].float() / 1.2
        reference = torch.log_softmax(logits, dim=-1).gather(1, completion[:, None])[:, 0]
        kept = out.generation_logprobs[row, width : width + completion.numel()]
        error = float((kept - reference).abs().max())
        print(
            f"row {row}: prompt {length}, completion {completion.numel()}, |HF - ref| {error:.2e}"
        )
        assert error <= TOL
    assert 0 < stopped < len(prompt_ids)  # both kinds of row occur with this seed


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_text_grpo_refit_exact_on_left_padded_prompts_with_eos(tmp_path, tp):
    """4 steps: the rollouts of steps 1..3 come from weights refit after 1..3 optimizer steps."""
    steps = 4
    write_text_model(tmp_path, seed=2)
    rank0, rank1 = run_on_ranks(text_grpo_run, 2, str(tmp_path), tp, steps, timeout=300)
    assert rank0["rows"] == rank1["rows"]
    errors = [max(a, b) for a, b in zip(rank0["max_errors"], rank1["max_errors"], strict=True)]
    assert len(rank0["rows"]) == len(errors) == steps
    short_rows = 0
    for batch in rank0["batches"] + rank1["batches"]:
        lengths, mask = batch["input_lengths"], batch["token_mask"]
        # right-aligned: the completion is the last tokens of each row's real length
        for row in range(lengths.numel()):
            real = int(lengths[row])
            assert mask[row, real:].sum() == 0 and mask[row, real - 1] == 1
        short_rows += int((lengths < batch["input_ids"].shape[1]).sum())
    assert short_rows > 0  # left padding or an EOS made rows shorter than the batch
    for step, (row, error) in enumerate(zip(rank0["rows"], errors, strict=True)):
        print(
            f"text tp={tp} step {step}: reward {row['reward']:.3f}, max |gen - prev| {error:.2e}, "
            f"token_mult_prob_error - 1 {row['train_token_mult_prob_error'] - 1:.2e}, "
            f"grad_norm {row['grad_norm']:.3f}"
        )
        assert error <= TOL
        assert abs(row["train_token_mult_prob_error"] - 1) <= TOL
        assert abs(row["gen_train_ratio_min"] - 1) <= TOL
        assert abs(row["gen_train_ratio_max"] - 1) <= TOL
        assert row["grad_norm"] > 0
