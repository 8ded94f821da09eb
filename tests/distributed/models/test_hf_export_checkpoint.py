"""``lmrl export`` (``export_checkpoint.main``): a TP=2 ``Trainer.fit`` checkpoint of an
HF-imported Qwen2 becomes an HF directory whose ``transformers`` logits equal the trained megatron
model's."""

from __future__ import annotations

import pytest
import torch
from _hf_export_ranks import fit_and_checkpoint
from _hf_ranks import build_hf_model, hf_configs, hf_logits, input_ids
from safetensors.torch import load_file

from lightning_mcore_rl.strategy.export import main
from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5


def test_export_checkpoint_matches_trained_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "source"
    build_hf_model(hf_configs()["qwen2_tied"], source, seed=4)
    ckpt = tmp_path / "ckpt"
    trained, peer = run_on_ranks(fit_and_checkpoint, 2, str(source), str(ckpt), timeout=240)
    losses = trained["losses"]
    print(f"export_checkpoint: train_loss per step {[round(x, 4) for x in losses]}")
    assert losses == peer["losses"] and len(losses) == 6  # identical on both TP ranks
    # training on one repeated batch, fixed data and seed: the loss falls. Measured (2-core
    # Xeon, AVX-512 and MKL/oneDNN AVX2 kernels alike): 4.939 -> 3.779, a drop of 1.16 >> 0.05.
    assert losses[-1] < losses[0] - 0.05

    assert (
        main(["--ckpt", str(ckpt), "--hf-source", str(source), "--out", str(tmp_path / "out")]) == 0
    )
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    original = load_file(str(source / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert not torch.equal(exported["model.norm.weight"], original["model.norm.weight"])  # trained
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    diff = (hf_logits(model, input_ids()) - trained["logits"]).abs().max().item()
    print(f"export_checkpoint: max |transformers - trained megatron| logits = {diff:.3g}")
    assert diff <= ATOL
    bf16_dir = tmp_path / "out_bf16"
    main(
        ["--ckpt", str(ckpt), "--hf-source", str(source), "--out", str(bf16_dir), "--dtype", "bf16"]
    )
    bf16 = load_file(str(bf16_dir / "model.safetensors"))
    for name, tensor in exported.items():
        assert torch.equal(bf16[name], tensor.to(torch.bfloat16)), name
    assert AutoModelForCausalLM.from_pretrained(bf16_dir).dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hello world"}], tokenize=False, add_generation_prompt=True
        )
        == "<user> hello world <assistant>"
    )


def test_export_refuses_a_directory_with_weights(tmp_path):
    source = tmp_path / "source"
    build_hf_model(hf_configs()["llama"], source, seed=0)
    with pytest.raises(FileExistsError, match="already holds model weights"):
        main(["--ckpt", str(tmp_path), "--hf-source", str(source), "--out", str(source)])
