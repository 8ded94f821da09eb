"""``scripts/make_tiny_hf.py`` writes the Hugging Face directory ``grpo_hf.yaml`` (and, with
``--vllm``, ``grpo_vllm_tiny.yaml``) points at: the YAML instantiates with it as written, and the
model covers the task (vocabulary, positions)."""

from __future__ import annotations

import importlib.util
import json
import runpy
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightning_mcore_rl.cli import ConfigError, build_cli
from lightning_mcore_rl.recipes import GRPOModule, HFModelSpec

ROOT = Path(__file__).parents[3]


def test_make_tiny_hf_makes_the_model_grpo_hf_yaml_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the script's and the YAML's relative paths, as run by a user
    script = runpy.run_path(str(ROOT / "scripts" / "make_tiny_hf.py"))  # not as __main__
    script["main"]([])  # the defaults: `python scripts/make_tiny_hf.py`
    out = tmp_path / "outputs" / "tiny_llama"  # the YAML's model.path
    assert capsys.readouterr().out == "tiny Llama + tokenizer: outputs/tiny_llama\n"
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 24 and config["max_position_embeddings"] == 64
    assert not config["tie_word_embeddings"]  # GRPO at TP=2 needs no tied-embedding care
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 20 and tokenizer("0 1 15").input_ids == [2, 4, 5, 11]  # BOS + words

    cli = build_cli(["--config", str(ROOT / "examples/configs/grpo_hf.yaml")], run=False)
    module = cli.model
    assert isinstance(module, GRPOModule) and module.model_spec == HFModelSpec("outputs/tiny_llama")
    bridge = module.hf_bridge()  # raises unless vocabulary and positions cover the task
    assert (bridge.vocab_size, bridge.arch.max_position_embeddings) == (24, 64)
    assert cli.trainer.max_steps == cli.datamodule.num_steps == 60
    assert cli.trainer.max_epochs is None  # max_steps alone ends the run (a resume continues)
    assert cli.trainer.checkpoint_callback is not None  # `lmrl export` needs the checkpoint


def test_make_tiny_hf_vllm_writes_head_dim_32_for_grpo_vllm_tiny_yaml(
    tmp_path, monkeypatch, capsys
):
    """``--vllm``: the same Llama with 2 heads of 32 (vLLM's CPU attention needs head dim >= 32)
    at the path ``grpo_vllm_tiny.yaml`` reads; a MoE is refused."""
    monkeypatch.chdir(tmp_path)
    script = runpy.run_path(str(ROOT / "scripts" / "make_tiny_hf.py"))
    assert script["main"](["--vllm"]) == Path("outputs/tiny_llama_vllm")
    config = json.loads((tmp_path / "outputs" / "tiny_llama_vllm" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 2)
    assert (config["hidden_size"], config["vocab_size"]) == (64, 24)
    args = ["--config", str(ROOT / "examples/configs/grpo_vllm_tiny.yaml")]
    if importlib.util.find_spec("vllm") is None:  # refused at construction, naming the install
        with pytest.raises(ConfigError, match=r"backend='vllm' needs vLLM"):
            build_cli(args, run=False)
    else:
        cli = build_cli(args, run=False)
        assert cli.model.model_spec == HFModelSpec("outputs/tiny_llama_vllm")
        assert cli.model.rollout.backend == "vllm"
        assert cli.model.hf_bridge().vocab_size == 24
    with pytest.raises(SystemExit):
        script["main"](["--vllm", "--arch", "qwen3_moe"])
    assert "--vllm makes a Llama only, got --arch qwen3_moe" in capsys.readouterr().err
