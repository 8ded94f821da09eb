"""vLLM loads the exported EAGLE-3 drafts: a tiny Llama target (3 layers, hidden 64, 2 heads of 32:
vLLM's CPU attention needs head dim >= 32) with ``speculative_config={"method": "eagle3", "model":
<the export>}`` for a 2-aux draft (``fc [H, 2H]``, the README's ``aux_layers=(i, j)``) and a 3-aux
one (``fc [H, 3H]``, upstream's default layout):

* both of vLLM's model runners read the draft's target layers from its ``config.json`` (the V2
  runner, vLLM's only one from 0.34 on and the GPU default before, reads the top-level
  ``eagle_aux_hidden_state_layer_ids`` alone), and the engine's target captures exactly those;
* vLLM generates with each draft, its greedy tokens (up to EOS) equal the target's alone
  (transformers, fp32: speculative decoding keeps greedy outputs).

Runs where vLLM is installed (``scripts/run_vllm_tests.sh``); skipped elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from lightning_mcore_rl.testing import run_on_ranks  # noqa: E402

DRAFTS = {"aux2": (0, 2), "aux3": (0, 1, 2)}
"""Export name -> the draft's aux layers (0-based layers of the 3-layer target)."""


def export_drafts(rank: int, root: str) -> None:
    """EAGLE-3 drafts of the target's shape (H = 64, 2 heads, FFN 128, V = 24), one per
    :data:`DRAFTS` entry, exported to ``root/<name>`` (checked against the installed vLLM)."""
    from lightning_mcore_rl.models.eagle3 import eagle3_draft, save_eagle3
    from lightning_mcore_rl.models.tiny_gpt import tiny_gpt_config
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    config = tiny_gpt_config(num_layers=3, hidden_size=64, num_attention_heads=2,
                             ffn_hidden_size=128)  # fmt: skip
    for name, aux in DRAFTS.items():
        draft = eagle3_draft(config, vocab_size=24, aux_layers=aux, seed=3)
        save_eagle3(draft, f"{root}/{name}", max_position_embeddings=64)


@pytest.mark.timeout(600)  # two vLLM engines and a transformers reference on 2 shared cores
def test_vllm_loads_and_speculates_with_two_and_three_aux_drafts(tmp_path: Path) -> None:
    from safetensors import safe_open

    from lightning_mcore_rl.recipes.arithmetic import VLLM_HEADS, train_tokenizer, write_tiny_llama

    tokenizer = train_tokenizer([" ".join(str(i) for i in range(16))])
    target = write_tiny_llama(tmp_path / "target", tokenizer, num_layers=3,
                              num_attention_heads=VLLM_HEADS, num_key_value_heads=VLLM_HEADS,
                              random_pad_embedding=True)  # fmt: skip
    run_on_ranks(export_drafts, 1, str(tmp_path), timeout=120)
    dirs = {name: str(tmp_path / name) for name in DRAFTS}
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    for name, aux in DRAFTS.items():
        assert json.loads((Path(dirs[name]) / "config.json").read_text())["vocab_size"] == vocab
        with safe_open(str(Path(dirs[name]) / "model.safetensors"), "pt") as f:
            assert list(f.get_slice("fc.weight").get_shape()) == [64, 64 * len(aux)]
    script = Path(__file__).with_name("_eagle3_vllm_script.py")
    done = subprocess.run(
        [sys.executable, str(script), str(target), *dirs.values()],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith('{"drafts"'))
    result = json.loads(line)
    print(result)
    for name, aux in DRAFTS.items():
        got = result["drafts"][dirs[name]]
        ids = [i + 1 for i in aux]  # vLLM's id of layer i's output: the state after i + 1 layers
        assert got["config"] == {"v1": ids, "v2": ids}, name
        assert got["captured"] == ids, name
        # up to 10 tokens each, fewer where the target says EOS: 28 of 30 here
        assert sum(map(len, got["tokens"])) >= 20, name
        assert got["tokens"] == result["plain"], name
