"""HFBridge on gloo CPU ranks: tiny random Llama (plain and llama3 RoPE scaling), Qwen2 (tied
embeddings, qkv bias), Qwen3 (q/k norm, explicit head_dim) and Mistral imported at TP=1, TP=2,
PP=2 (+ a 4-layer PP=2 x VPP=2 Llama) and TP=2 x PP=2 give the ``transformers`` logits on padded
and packed (THD) input; the export and ``save_pretrained`` reproduce the source bitwise. Sliding
windows (Mistral, Qwen2 ``layer_types``) shorter than the sequence, and one equal to
``max_position_embeddings`` run past it, match too at TP=2, PP=2 and (packed) CP=2."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from _hf_ranks import (
    PACKED_LENGTHS,
    build_hf_model,
    cp_window_ranks,
    hf_configs,
    hf_logits,
    input_ids,
    layout_ranks,
    vocab_error_ranks,
    window_configs,
)
from safetensors.torch import load_file

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5  # fp32; sharded matmuls reduce in a different order than transformers


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("hf")
    models = {}
    for seed, (name, config) in enumerate(hf_configs().items()):
        models[name] = (root / name, build_hf_model(config, root / name, seed))
    return models


@pytest.fixture(scope="module")
def window_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("hf_window")
    models = {}
    for seed, (name, config) in enumerate(window_configs().items(), start=20):
        models[name] = (root / name, build_hf_model(config, root / name, seed))
    return models


@pytest.fixture(scope="module")
def vpp_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    config = hf_configs()["llama"]
    config.num_hidden_layers = 4
    directory = tmp_path_factory.mktemp("hf") / "llama_4_layers"
    return directory, build_hf_model(config, directory, seed=11)


def _source_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def _saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


def _check_layout(results: list[dict], models: dict, out_root: Path) -> dict[str, float]:
    """Assert logits and round trips for every model; return the max logit diff per model."""
    from transformers import AutoModelForCausalLM

    ids = input_ids()
    diffs = {}
    for name, (directory, hf_model) in models.items():
        (padded,) = [r[name]["padded"] for r in results if r[name]["padded"] is not None]
        (packed,) = [r[name]["packed"] for r in results if r[name]["packed"] is not None]
        reference = hf_logits(hf_model, ids)
        worst = (padded - reference).abs().max().item()
        for row, length in enumerate(PACKED_LENGTHS):
            alone = hf_logits(hf_model, ids[row : row + 1, :length])[0]
            worst = max(worst, (packed[row, :length] - alone).abs().max().item())
        assert worst <= ATOL, f"{name}: max |megatron - transformers| logits = {worst:.3g}"
        diffs[name] = worst
        # megatron's grad-norm filter over the imported shards counts every HF weight once
        # (TP-split weights carry `tensor_model_parallel`; without it only TP rank 0's count)
        hf_norm = torch.cat([p.detach().flatten() for p in hf_model.parameters()]).norm().item()
        for result in results:
            assert result[name]["norm"] == pytest.approx(hf_norm, rel=1e-5), name

        source = _source_tensors(directory)
        _assert_bitwise(results[0][name]["exported"], source)
        saved = out_root / name
        _assert_bitwise(_saved_tensors(saved), source)
        reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
        assert torch.equal(hf_logits(reloaded, ids), reference), name
    return diffs


def _run(models: dict, world: int, tp: int, pp: int, vpp: int | None, out_root: Path) -> list:
    dirs = {name: str(directory) for name, (directory, _) in models.items()}
    return run_on_ranks(layout_ranks, world, dirs, tp, pp, vpp, str(out_root), timeout=240)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)])
def test_import_matches_transformers_and_round_trips(hf_models, tmp_path, tp, pp):
    results = _run(hf_models, tp * pp, tp, pp, None, tmp_path)
    diffs = _check_layout(results, hf_models, tmp_path)
    print(f"TP={tp} PP={pp} max logit diffs: {diffs}")


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_sliding_window_matches_transformers_past_the_window(window_models, tmp_path, tp, pp):
    # SEQ = 10 and the packed 7-token sequence exceed every window (4, 8 = max positions, 3)
    diffs = _check_layout(
        _run(window_models, tp * pp, tp, pp, None, tmp_path), window_models, tmp_path
    )
    print(f"sliding window TP={tp} PP={pp} max logit diffs: {diffs}")


def test_sliding_window_packed_context_parallel_matches_transformers(window_models):
    dirs = {name: str(directory) for name, (directory, _) in window_models.items()}
    results = run_on_ranks(cp_window_ranks, 2, dirs, timeout=240)
    ids = input_ids()
    diffs = {}
    for name, (_, hf_model) in window_models.items():
        worst = 0.0
        for result, (row, length) in itertools.product(results, enumerate(PACKED_LENGTHS)):
            alone = hf_logits(hf_model, ids[row : row + 1, :length])[0]
            worst = max(worst, (result[name][row, :length] - alone).abs().max().item())
        assert worst <= ATOL, f"{name}: max |megatron CP=2 - transformers| logits = {worst:.3g}"
        diffs[name] = worst
    print(f"sliding window CP=2 packed max logit diffs: {diffs}")


def test_pipeline_2_virtual_2_matches_transformers(vpp_model, tmp_path):
    models = {"llama_4_layers": vpp_model}
    diffs = _check_layout(_run(models, 2, 1, 2, 2, tmp_path), models, tmp_path)
    print(f"PP=2 VPP=2 max logit diffs: {diffs}")


def test_tp2_pp2_four_ranks_matches_transformers(hf_models, tmp_path):
    diffs = _check_layout(_run(hf_models, 4, 2, 2, None, tmp_path), hf_models, tmp_path)
    print(f"TP=2 PP=2 max logit diffs: {diffs}")


def test_tied_checkpoint_that_stores_lm_head_round_trips(tmp_path):
    from safetensors.torch import save_file

    directory = tmp_path / "qwen2_tied_with_head"
    model = build_hf_model(hf_configs()["qwen2_tied"], directory, seed=7)
    tensors = _source_tensors(directory)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    models = {directory.name: (directory, model)}
    _check_layout(_run(models, 2, 2, 1, None, tmp_path / "out"), models, tmp_path / "out")


def test_vocab_not_divisible_by_tp_raises(tmp_path):
    config = hf_configs()["llama"]
    config.vocab_size = 127
    build_hf_model(config, tmp_path / "odd_vocab", seed=0)
    (message, _) = run_on_ranks(vocab_error_ranks, 2, str(tmp_path / "odd_vocab"))
    assert "`vocab_size` (127) must be divisible by the tensor-parallel size (2)" in message


def test_tokenizer_and_vocab(hf_models):
    from lightning_mcore_rl.models import HFBridge

    bridge = HFBridge.from_pretrained(hf_models["qwen3"][0])
    assert bridge.vocab_size == 128
    tokenizer = bridge.tokenizer()
    chat = [{"role": "user", "content": "hi world"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<user> hi world <assistant>"
    assert tokenizer(text)["input_ids"] == [4, 8, 7, 5]
