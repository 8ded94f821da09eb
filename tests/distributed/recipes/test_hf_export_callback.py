"""``HFExport`` on two ranks: after a short SFT of the arithmetic example's tiny Llama at TP=2
(and of a tiny Qwen3-MoE at EP=2, each rank holding half the experts), the exported directory
loads with ``transformers`` and its token logprobs equal the trained megatron policy's on the
same batch within 1e-5 (and differ from the initial model's: the export holds the trained
weights, not the source's)."""

from __future__ import annotations

import json

import torch
from _hf_export_runs import sft_and_export

from lightning_mcore_rl.recipes import (
    make_splits,
    train_tokenizer,
    write_sft_rows,
    write_tiny_llama,
    write_tiny_qwen3_moe,
)
from lightning_mcore_rl.testing import run_on_ranks

STEPS = 3


def _logprobs(hf_dir, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, S-1]`` transformers logprobs of tokens 1.. (causal: the right padding comes last)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = batch["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def _sft_data(tmp_path):
    """The SFT rows' file and the tokenizer trained on them."""
    train, _ = make_splits(64, 0, seed=1)
    sft_file = str(write_sft_rows(train, tmp_path / "sft.jsonl"))
    return sft_file, train_tokenizer(p.prompt + " " + p.response for p in train)


def test_hf_export_equals_the_trained_policy(tmp_path):
    from transformers import AutoTokenizer

    sft_file, tokenizer = _sft_data(tmp_path)
    init, out = tmp_path / "init", tmp_path / "export"
    write_tiny_llama(init, tokenizer)
    results = run_on_ranks(sft_and_export, 2, str(init), sft_file, str(out), STEPS, timeout=240)
    (batch, megatron), (batch1, megatron1) = results
    assert torch.equal(batch["input_ids"], batch1["input_ids"]) and torch.equal(megatron, megatron1)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (init / "config.json").read_text()
    )
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == tokenizer.get_vocab()
    _export_matches(out, init, batch, megatron)


def _export_matches(out, init, batch, megatron) -> None:
    positions = torch.arange(batch["input_ids"].shape[1])[None, 1:]
    real = positions < batch["input_lengths"][:, None]  # positions 1 .. input_lengths - 1
    diff = float((_logprobs(out, batch) - megatron[:, 1:])[real].abs().max())
    moved = float((_logprobs(init, batch) - megatron[:, 1:])[real].abs().max())
    assert diff <= 1e-5, diff
    assert moved > 1e-2, moved


def test_hf_export_of_an_ep2_moe_equals_the_trained_policy(tmp_path):
    sft_file, tokenizer = _sft_data(tmp_path)
    init, out = tmp_path / "init", tmp_path / "export"
    write_tiny_qwen3_moe(init, tokenizer)
    layout = (("expert_model_parallel_size", 2),)  # DP=2: each rank trains on its own rows
    results = run_on_ranks(
        sft_and_export, 2, str(init), sft_file, str(out), STEPS, layout, timeout=240
    )
    for batch, megatron in results:
        _export_matches(out, init, batch, megatron)
