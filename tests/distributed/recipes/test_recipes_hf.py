"""SFT and DPO of a Hugging Face model (``HFModelSpec``, a random tiny Llama) at TP=2: the SFT
step-0 loss equals ``transformers``' NLL of the same batch, and DPO's reference (re-read from the
checkpoint) gives exactly ln 2 at step 0."""

from __future__ import annotations

import math

import pytest
import torch
from _recipe_runs import build_hf_llama, hf_recipes

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
