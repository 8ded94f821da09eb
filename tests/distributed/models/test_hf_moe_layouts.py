"""HFBridge for routed experts on gloo CPU ranks: tiny random Qwen3-MoE (no top-k
renormalisation), Mixtral (renormalised) and a Qwen3-MoE with a dense layer 0
(``decoder_sparse_step`` 2, ``norm_topk_prob``) imported at one rank, EP=2, TP=2 (sequence
parallel, expert TP 2), PP=2 (stage 0 dense, stage 1 routed for the mixed model) and TP=2 x EP=2
(expert TP 1) give the ``transformers`` logits on padded input (and, at TP=1, packed THD input),
and ``export_hf_weights`` / ``save_pretrained`` from every layout give the source safetensors
bitwise (experts gathered over EP and expert TP), which ``transformers`` loads into the source
model's state dict.

fp32; sharded matmuls and the token dispatch only reorder sums. Measured max |megatron -
transformers| logits: <= 7.2e-7 over every layout and model, so ATOL = 1e-5 as for the dense
families, while a swapped gate/up, a wrong global expert index or router normalisation moves the
logits by >= 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _hf_moe_ranks import hf_moe_configs, moe_layout_ranks
from _hf_ranks import PACKED_LENGTHS, build_hf_model, hf_logits, input_ids
from safetensors.torch import load_file

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {
        name: (root / name, build_hf_model(config, root / name, seed))
        for seed, (name, config) in enumerate(hf_moe_configs().items(), start=30)
    }


def _check(results: list[dict], models: dict, out_root: Path) -> dict[str, float]:
    """Assert every reported logits tensor and every written directory; return the max logit
    diff per model."""
    from transformers import AutoModelForCausalLM

    ids = input_ids()
    diffs = {}
    for name, (directory, hf_model) in models.items():
        reference = hf_logits(hf_model, ids)
        reported = [r[name] for r in results if r[name] is not None]
        assert reported, name
        worst = 0.0
        for out in reported:
            worst = max(worst, (out["padded"] - reference).abs().max().item())
            for row, length in enumerate(PACKED_LENGTHS if out["packed"] is not None else ()):
                alone = hf_logits(hf_model, ids[row : row + 1, :length])[0]
                worst = max(worst, (out["packed"][row, :length] - alone).abs().max().item())
        assert worst <= ATOL, f"{name}: max |megatron - transformers| logits = {worst:.3g}"
        diffs[name] = worst

        source = load_file(str(directory / "model.safetensors"))
        saved = load_file(str(out_root / name / "model.safetensors"))
        exports = [out["exported"] for out in reported if out["exported"] is not None]
        for tensors in [saved, *exports]:
            assert sorted(tensors) == sorted(source), name
            for key, tensor in source.items():
                assert tensors[key].dtype == tensor.dtype, key
                assert torch.equal(tensors[key], tensor), key
        reloaded = AutoModelForCausalLM.from_pretrained(out_root / name, dtype=torch.float32)
        expected = hf_model.state_dict()
        state = reloaded.state_dict()
        assert sorted(state) == sorted(expected), name
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), key
    return diffs


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "etp"),
    [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 1, None), (1, 2, 1, None), (2, 1, 2, 1)],
    ids=["one-rank", "ep2", "tp2-sp-etp2", "pp2", "tp2-ep2-etp1"],
)
def test_moe_import_matches_transformers_and_round_trips(hf_models, tmp_path, tp, pp, ep, etp):
    dirs = {name: str(directory) for name, (directory, _) in hf_models.items()}
    world = tp * pp * (ep if tp == 1 else 1)  # TP=2 x EP=2 (ETP 1) fits 2 ranks
    results = run_on_ranks(moe_layout_ranks, world, dirs, tp, pp, ep, etp, str(tmp_path))
    diffs = _check(results, hf_models, tmp_path)
    print(f"TP={tp} PP={pp} EP={ep} ETP={etp} max logit diffs: {diffs}")
