"""The EAGLE-3 draft (``models/eagle3.py``, the architecture vLLM and SGLang load):

* exported to a Hugging Face directory, a plain-torch EAGLE-3 forward (vLLM's ``llama_eagle3``
  math, written against the exported ``config.json`` and ``model.safetensors`` only) reproduces the
  megatron draft's logits within 1e-5 (fp32); the TP=2 export is bitwise the TP=1 export;
* trained in the policy's step like the default draft: the policy's loss and gradients bitwise
  unchanged, two microbatches, packing, TP=2 (padded, packed) and PP=2 give the one-microbatch TP=1
  draft loss and gradients within 1e-5.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from _draft_ranks import DraftStep
from _eagle3_ranks import reference_logits, single_rank_run, two_rank_run
from safetensors.torch import load_file

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5
DRAFT_METRICS = ("draft_loss", "draft_top1_agreement", "draft_expected_acceptance")


@functools.cache
def _runs(root: str) -> tuple[dict, list[dict]]:
    single = run_on_ranks(single_rank_run, 1, root, timeout=180)[0]
    return single, run_on_ranks(two_rank_run, 2, root, timeout=180)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, list[dict]]:
    root = str(tmp_path_factory.mktemp("eagle3"))
    single, two = _runs(root)
    return root, single, two


def test_exported_directory_reproduces_the_draft(runs: tuple) -> None:
    root, single, _ = runs
    config = json.loads((Path(root) / "tp1" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # vLLM numbers the hidden state after k layers k: the outputs of layers 2 and 3 are 3 and 4
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4]
    # top-level too: vLLM's V2 model runner reads only these (see test_eagle3_export.py)
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 4]
    assert config["num_aux_hidden_states"] == 2
    expected = single["export"]["logits"]
    got = reference_logits(Path(root) / "tp1")
    print("export max abs diff", float((got - expected).abs().max()))
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=ATOL, rtol=0)


def test_tensor_parallel_export_is_bitwise_the_single_rank_one(runs: tuple) -> None:
    root, single, two = runs
    one, tp2 = (
        load_file(f"{root}/tp1/model.safetensors"),
        load_file(f"{root}/tp2/model.safetensors"),
    )
    assert sorted(one) == sorted(tp2)
    for key in one:
        assert torch.equal(one[key], tp2[key]), key
    for rank in two:
        assert (rank["export"]["logits"] - single["export"]["logits"]).abs().max() <= ATOL


def _max_diff(actual: dict, expected: dict) -> float:
    assert sorted(actual) == sorted(expected)
    return max(float((actual[k] - expected[k]).abs().max()) for k in expected)


def _assert_same_draft(step: DraftStep, reference: DraftStep) -> None:
    for key in DRAFT_METRICS:
        assert step.metrics[key] == pytest.approx(reference.metrics[key], abs=ATOL), key
    assert _max_diff(step.draft_grads, reference.draft_grads) <= ATOL


def test_the_policy_is_bitwise_unchanged(runs: tuple) -> None:
    _, single, _ = runs
    on, off = single["on"], single["off"]
    assert on.loss == off.loss
    for key, grad in off.policy_grads.items():
        assert torch.equal(on.policy_grads[key], grad), key
    assert on.metrics["draft_loss"] > 1.0 and on.draft_grads


@pytest.mark.parametrize("name", ["on_M2", "packed_M2"])
def test_microbatching_and_packing_do_not_change_the_draft(runs: tuple, name: str) -> None:
    _, single, _ = runs
    _assert_same_draft(single[name], single["on"])


@pytest.mark.parametrize("name", ["tp2", "tp2_packed", "pp2"])
def test_tensor_and_pipeline_parallel_equal_single_rank(runs: tuple, name: str) -> None:
    _, single, two = runs
    holder = next(r[name] for r in two if r[name].draft_grads)
    _assert_same_draft(holder, single["on"])
