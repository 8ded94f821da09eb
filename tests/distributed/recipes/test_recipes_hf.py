"""SFT, DPO and the reward model of a Hugging Face model (``HFModelSpec``, a random tiny Llama) at
TP=2: the SFT step-0 loss equals ``transformers``' NLL of the same batch, DPO's reference (re-read
from the checkpoint) gives exactly ln 2 at step 0, and so does the reward model's zero score head,
whose step-0 gradient norm equals the one derived from ``transformers``' final hidden states."""

from __future__ import annotations

import math

import pytest
import torch
from _recipe_runs import build_hf_llama, hf_recipes, hf_tied_rm_pp2_error

from lightning_mcore_rl.testing import run_on_ranks

STEPS = 2


def test_sft_and_dpo_of_an_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    build_hf_llama(str(tmp_path))
    runs, runs1 = run_on_ranks(hf_recipes, 2, str(tmp_path), STEPS, timeout=240)
    for name in runs:
        assert runs[name].rows == runs1[name].rows, name  # equal on both TP ranks
    # SFT step 0 against transformers: log_softmax + gather + masked mean on the HF logits
    batch = runs["sft"].first_batch
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits.float()  # causal: padding comes last
    ids = batch["input_ids"]
    logprobs = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    plain = float(-(logprobs * mask).sum() / mask.sum())
    sft = [row["train_loss"] for row in runs["sft"].rows]
    print(
        f"SFT step 0: {sft[0]} (transformers {plain}); DPO {[r['train_loss'] for r in runs['dpo'].rows]}"
    )
    assert sft[0] == pytest.approx(plain, abs=1e-5)
    assert sft[1] < sft[0]
    dpo = [row["train_loss"] for row in runs["dpo"].rows]
    assert dpo[0] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(dpo[1] - math.log(2)) > 1e-4  # the policy moved away from the reference
    _check_reward_model(model, runs["rm"])


def _check_reward_model(model, fit) -> None:
    """Step 0 of the HF reward model: the zero head scores every row 0 (loss ln 2, accuracy 0),
    and only the head has a gradient, ``dL/dw = -1/2 mean over pairs (h_chosen - h_rejected)``
    with ``h`` the final (normed) hidden state at each row's last real token, so the logged
    pre-clip grad norm is its norm."""
    batch = fit.first_batch
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state.float()  # [B, S, H], causal
    last = hidden[torch.arange(ids.shape[0]), lengths - 1]  # [B, H]
    grad = -0.5 * (last[::2] - last[1::2]).mean(0)
    rm = fit.rows
    print(f"RM: losses {[r['train_loss'] for r in rm]}, step-0 grad norm {rm[0]['grad_norm']} "
          f"(transformers {float(grad.norm())})")  # fmt: skip
    assert rm[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rm[0]["grad_norm"] == pytest.approx(float(grad.norm()), rel=1e-5)
    assert rm[1]["train_loss"] < math.log(2)  # the scores separate the pairs


def test_reward_model_of_a_tied_hf_checkpoint_refuses_pipeline_parallelism(tmp_path):
    build_hf_llama(str(tmp_path), tied=True)
    for error in run_on_ranks(hf_tied_rm_pp2_error, 2, str(tmp_path), timeout=240):
        assert error.startswith("ValueError: RewardModelModule: the HF checkpoint ties"), error
