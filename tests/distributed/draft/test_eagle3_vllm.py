"""vLLM loads the exported EAGLE-3 draft: a tiny Llama target (2 layers, hidden 64, 2 heads of 32:
vLLM's CPU attention needs head dim >= 32) with ``speculative_config={"method": "eagle3", "model":
<the export>}`` generates, and its greedy tokens equal the target's alone (transformers, fp32:
speculative decoding keeps greedy outputs). Runs where vLLM is installed (``scripts/run_vllm_tests.sh``); skipped
elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from lightning_mcore_rl.testing import run_on_ranks  # noqa: E402


def export_draft(rank: int, directory: str) -> None:
    """An EAGLE-3 draft of the target's shape (H = 64, 2 heads, FFN 128, V = 24) reading both
    target layers (vLLM ids 1 and 2), exported to ``directory``."""
    from lightning_mcore_rl.models.eagle3 import eagle3_draft, save_eagle3
    from lightning_mcore_rl.models.tiny_gpt import tiny_gpt_config
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    config = tiny_gpt_config(num_layers=2, hidden_size=64, num_attention_heads=2,
                             ffn_hidden_size=128)  # fmt: skip
    draft = eagle3_draft(config, vocab_size=24, aux_layers=(0, 1), seed=3)
    save_eagle3(draft, directory, max_position_embeddings=64)


def test_vllm_speculates_with_the_exported_draft(tmp_path: Path) -> None:
    from lightning_mcore_rl.recipes.arithmetic import VLLM_HEADS, train_tokenizer, write_tiny_llama

    tokenizer = train_tokenizer([" ".join(str(i) for i in range(16))])
    target = write_tiny_llama(tmp_path / "target", tokenizer, num_attention_heads=VLLM_HEADS,
                              num_key_value_heads=VLLM_HEADS, random_pad_embedding=True)  # fmt: skip
    run_on_ranks(export_draft, 1, str(tmp_path / "draft"), timeout=120)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["vocab_size"] == json.loads((target / "config.json").read_text())["vocab_size"]
    script = Path(__file__).with_name("_eagle3_vllm_script.py")
    done = subprocess.run(
        [sys.executable, str(script), str(target), str(tmp_path / "draft")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith('{"eagle3"'))
    result = json.loads(line)
    print(result)
    assert all(len(tokens) == 10 for tokens in result["eagle3"])
    assert result["eagle3"] == result["plain"]
