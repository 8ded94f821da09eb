"""HFBridge building blocks without ranks: config mapping (transformers' defaults for missing
keys, sliding windows) and its errors, the weight-name map (local and Transformer Engine layouts),
the TP slice layouts, bad checkpoint directories and parallel layouts refused before megatron."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers.unit import TINY_HF_FIELDS
from safetensors.torch import load_file, save_file

from lightning_mcore_rl.models import HFBridge
from lightning_mcore_rl.models.hf.config import parse_architecture
from lightning_mcore_rl.models.hf.safetensors_io import SafetensorsReader
from lightning_mcore_rl.models.hf.weights import merge_shards, param_map, read_shard
from lightning_mcore_rl.parallel import ParallelGroups

BASE = {
    "model_type": "llama",
    **TINY_HF_FIELDS,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def test_config_fields_map_each_family():
    qwen3 = parse_architecture({**BASE, "model_type": "qwen3", "head_dim": 32})
    fields = qwen3.config_fields()
    assert (fields["kv_channels"], fields["qk_layernorm"], fields["add_qkv_bias"]) == (
        32,
        True,
        False,
    )
    assert fields["num_query_groups"] == 2 and fields["normalization"] == "RMSNorm"
    assert fields["layernorm_epsilon"] == 1e-5 and fields["gated_linear_unit"] is True
    qwen2 = parse_architecture({**BASE, "model_type": "qwen2", "tie_word_embeddings": True})
    assert qwen2.config_fields()["add_qkv_bias"] is True
    assert qwen2.gpt_model_kwargs()["share_embeddings_and_output_weights"] is True
    llama = parse_architecture({**BASE, "rope_parameters": LLAMA3})
    kwargs = llama.gpt_model_kwargs()
    assert (kwargs["rope_scaling"], kwargs["rope_scaling_factor"]) == (True, 8.0)
    assert kwargs["rotary_base"] == 500000.0 and kwargs["max_sequence_length"] == 256
    # transformers < 5 layout: top-level rope_theta and rope_scaling
    legacy = {k: v for k, v in BASE.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}
    legacy.update(rope_theta=1e6, rope_scaling={"type": "llama3", **scaling})
    arch = parse_architecture(legacy)
    assert (arch.rotary_base, arch.rope_scaling_factor) == (1e6, 8.0)
    mistral = parse_architecture({**BASE, "model_type": "mistral", "sliding_window": 256})
    # transformers' window w: query i attends keys i-w < j <= i; megatron's (left, right)
    assert mistral.config_fields()["window_size"] == (255, 0)
    assert mistral.config_fields()["window_attn_skip_freq"] is None  # every layer
    assert "window_size" not in parse_architecture(BASE).config_fields()
    # Qwen2: transformers windows the layers from max_window_layers on (layer_types)
    qwen2_window = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    fields = parse_architecture({**BASE, "model_type": "qwen2", **qwen2_window}).config_fields()
    assert (fields["window_size"], fields["window_attn_skip_freq"]) == ((7, 0), [0, 1])
    no_window = parse_architecture({**BASE, "model_type": "qwen2", "sliding_window": 8})
    assert no_window.sliding_window is None  # use_sliding_window defaults to false
    # Qwen2's modeling code never reads attention_bias (its q/k/v always have one, o_proj never)
    assert parse_architecture({**BASE, "model_type": "qwen2", "attention_bias": True}).qkv_bias


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "gpt2"}, r"Unsupported Hugging Face `model_type` 'gpt2'"),
        ({"model_type": "mistral", "sliding_window": 0}, r"`sliding_window` = 0: a window is"),
        (
            {"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]},
            r"`layer_types` = .*'sliding_attention' layers need a `sliding_window`",
        ),
        (
            {"model_type": "qwen3", "layer_types": ["full_attention", "chunked_attention"]},
            r"`layer_types` = .*: qwen3 layers are 'full_attention' or 'sliding_attention'",
        ),
        (
            {"model_type": "qwen3", "layer_types": ["full_attention"]},
            r"(?s)Qwen3Config rejects this config.json.*`num_hidden_layers` \(2\)",
        ),
        ({"model_type": "qwen3", "attention_bias": True}, r"`attention_bias` = True"),
        ({"model_type": "llama", "hidden_size": 60}, r"LlamaConfig rejects this config.json"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            r"`rope_parameters.rope_type` = 'yarn'",
        ),
        (
            {"rope_parameters": {**LLAMA3, "low_freq_factor": 2.0}},
            r"`rope_parameters.low_freq_factor` = 2.0: megatron-core 0.16 fixes",
        ),
        (
            {"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 4096}},
            r"`rope_parameters.original_max_position_embeddings` = 4096",
        ),
        ({"attention_bias": True}, r"`attention_bias` = True"),
        ({"mlp_bias": True}, r"`mlp_bias` = True"),
        ({"hidden_act": "gelu"}, r"`hidden_act` = 'gelu'"),
    ],
)
def test_unsupported_config_raises(change, match):
    with pytest.raises(ValueError, match=match):
        parse_architecture({**BASE, **change})


def test_param_map_local_and_transformer_engine_names():
    layer = "decoder.layers.1."
    assert param_map(layer + "input_layernorm.weight", 3, False).hf_names == (
        "model.layers.3.input_layernorm.weight",
    )
    te_qkv_norm = param_map(layer + "self_attention.linear_qkv.layer_norm_weight", 3, False)
    assert te_qkv_norm.hf_names == ("model.layers.3.input_layernorm.weight",)
    te_fc1_norm = param_map(layer + "mlp.linear_fc1.layer_norm_weight", 3, False)
    assert te_fc1_norm.hf_names == ("model.layers.3.post_attention_layernorm.weight",)
    fc1 = param_map(layer + "mlp.linear_fc1.weight", 0, False)
    assert (fc1.layout, fc1.hf_names[1]) == ("fc1", "model.layers.0.mlp.up_proj.weight")
    assert param_map("output_layer.weight", None, True).hf_names == ("model.embed_tokens.weight",)
    assert param_map("output_layer.weight", None, False).hf_names == ("lm_head.weight",)
    with pytest.raises(KeyError, match="has no Hugging Face counterpart"):
        param_map(layer + "self_attention.linear_qkv._extra_state", 0, False)


def _layer_file(tmp_path: Path) -> tuple[SafetensorsReader, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    shapes = {
        "self_attn.q_proj.weight": (64, 64),
        "self_attn.k_proj.weight": (32, 64),
        "self_attn.v_proj.weight": (32, 64),
        "self_attn.q_proj.bias": (64,),
        "self_attn.k_proj.bias": (32,),
        "self_attn.v_proj.bias": (32,),
        "mlp.gate_proj.weight": (96, 64),
        "mlp.up_proj.weight": (96, 64),
        "self_attn.o_proj.weight": (64, 64),
    }
    tensors = {p + k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return SafetensorsReader(tmp_path), tensors


def test_qkv_is_interleaved_by_query_group(tmp_path):
    reader, tensors = _layer_file(tmp_path)
    arch = parse_architecture({**BASE, "head_dim": 16})  # H=4, G=2, d=16: 2 heads per group
    pm = param_map("decoder.layers.0.self_attention.linear_qkv.weight", 0, False)
    fused = read_shard(reader, pm, arch, 0, 1)
    q, k, v = (tensors[n] for n in pm.hf_names)
    # group g: [q heads 2g, 2g+1 (32 rows); k head g (16); v head g (16)]
    expected = torch.cat([q[:32], k[:16], v[:16], q[32:], k[16:], v[16:]])
    assert torch.equal(fused, expected)
    # TP=2: rank r holds group r
    assert torch.equal(read_shard(reader, pm, arch, 1, 2), expected[64:])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "suffix",
    [
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "mlp.linear_fc1.weight",
        "self_attention.linear_proj.weight",
    ],
)
def test_read_shard_then_merge_is_identity(tmp_path, tp, suffix):
    reader, tensors = _layer_file(tmp_path)
    arch = parse_architecture(BASE)
    pm = param_map(f"decoder.layers.0.{suffix}", 0, False)
    shards = [read_shard(reader, pm, arch, r, tp) for r in range(tp)]
    if suffix == "mlp.linear_fc1.weight" and tp == 2:  # rank 0: [gate rows 0..47; up rows 0..47]
        gate, up = (tensors[n] for n in pm.hf_names)
        assert torch.equal(shards[0], torch.cat([gate[:48], up[:48]]))
    merged = merge_shards(pm, shards, arch)
    assert [m.shape for m in merged] == [tensors[n].shape for n in pm.hf_names]
    for name, tensor in zip(pm.hf_names, merged, strict=True):
        assert torch.equal(tensor, tensors[name])


def _tiny_llama_dir(directory: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = {k: v for k, v in BASE.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(LlamaConfig(**config)).save_pretrained(directory)
    return directory


def test_bad_directories_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="No config.json"):
        HFBridge.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(FileNotFoundError, match=r"No \*\.safetensors weights"):
        HFBridge.from_pretrained(tmp_path)

    good = _tiny_llama_dir(tmp_path / "llama")
    assert HFBridge.from_pretrained(good).vocab_size == 128
    tensors = load_file(str(good / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, str(good / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight'.*has shape"):
        HFBridge.from_pretrained(good)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(good / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        HFBridge.from_pretrained(good)
    config = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(ValueError, match="Unsupported Hugging Face `model_type` 'gemma'"):
        HFBridge.from_pretrained(good)


def test_transformer_config_overrides_win(tmp_path):
    bridge = HFBridge.from_pretrained(_tiny_llama_dir(tmp_path / "llama"))
    assert bridge.config_fields()["hidden_dropout"] == 0.0
    config = bridge.transformer_config(hidden_dropout=0.1, num_layers=1)
    assert (config.hidden_dropout, config.num_layers, config.kv_channels) == (0.1, 1, 16)
    assert config.num_query_groups == 2 and config.tensor_model_parallel_size == 1


def test_the_layout_comes_from_groups_and_another_layout_is_refused(tmp_path):
    """``transformer_config(groups)`` takes TP/CP from ``groups``; a chunk or config of another
    layout than the ``groups`` given (here omitted: one rank) raises before any collective."""
    bridge = HFBridge.from_pretrained(_tiny_llama_dir(tmp_path / "llama"))
    tp2 = dataclasses.replace(ParallelGroups.single(), tp_size=2, cp_size=2)
    config = bridge.transformer_config(tp2)
    assert (config.tensor_model_parallel_size, config.context_parallel_size) == (2, 2)
    assert config.pipeline_dtype == torch.float32
    message = r"tensor_model_parallel_size=2 but `groups` has tp_size=1"
    with pytest.raises(ValueError, match=message):
        bridge.build_chunk(config)
    chunk = torch.nn.Linear(2, 2)
    chunk.config = config  # type: ignore[assignment]  # what a megatron chunk carries
    with pytest.raises(ValueError, match=message):
        bridge.load_weights(chunk)
    with pytest.raises(ValueError, match=message):
        next(iter(bridge.export_hf_weights([chunk])))


def _saved_without(directory: Path, config: object, *keys: str) -> Path:
    """A tiny random model of ``config`` saved to ``directory``, then ``keys`` deleted from its
    config.json (transformers itself omits keys equal to its defaults)."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    path = directory / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in saved.items() if k not in keys}))
    return directory


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_missing_keys_take_the_transformers_defaults(tmp_path, model_type):
    from transformers import CONFIG_MAPPING, AutoConfig

    small = {k: v for k, v in BASE.items() if k not in ("model_type", "rope_parameters")}
    small.pop("rms_norm_eps")
    if model_type == "qwen2":
        small.update(use_sliding_window=True, max_window_layers=1)
    keys = ("sliding_window", "rms_norm_eps", "rope_parameters", "rope_theta", "head_dim")
    keys += ("tie_word_embeddings", "attention_bias", "max_window_layers", "layer_types")
    directory = _saved_without(tmp_path, CONFIG_MAPPING[model_type](**small), *keys)
    assert not set(keys) & set(json.loads((directory / "config.json").read_text()))
    hf = AutoConfig.from_pretrained(directory)  # what transformers builds for this directory
    arch = HFBridge.from_pretrained(directory).arch
    assert arch.layernorm_epsilon == hf.rms_norm_eps == 1e-6
    assert arch.rotary_base == hf.rope_parameters["rope_theta"] == 10000.0
    assert arch.tied_embeddings is hf.tie_word_embeddings is False
    # Qwen3's default head_dim is 128, not hidden_size / num_attention_heads = 16
    assert arch.head_dim == (getattr(hf, "head_dim", None) or 64 // 4)
    assert arch.head_dim == (128 if model_type == "qwen3" else 16)
    assert arch.max_position_embeddings == hf.max_position_embeddings == 256
    windowed = [t == "sliding_attention" for t in getattr(hf, "layer_types", ())]
    if model_type == "mistral":  # no `sliding_window` key: transformers' default window, 4096
        windowed = [hf.sliding_window is not None] * 2
        assert hf.sliding_window == 4096
    if model_type == "qwen2":  # default max_window_layers (28) covers both layers
        assert windowed == [False, False] and hf.max_window_layers == 28
    expected_window = hf.sliding_window if any(windowed) else None
    assert arch.sliding_window == expected_window
    assert list(arch.window_layers) == (windowed or [False, False])
    if expected_window is not None:
        assert arch.config_fields()["window_size"] == (expected_window - 1, 0)


def _bridge_config(tmp_path: Path, **changes: object) -> tuple[HFBridge, dict]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = {k: v for k, v in BASE.items() if k != "model_type"}
    config.update(changes)
    AutoModelForCausalLM.from_config(LlamaConfig(**config)).save_pretrained(tmp_path)
    return HFBridge.from_pretrained(tmp_path), {"pipeline_dtype": torch.float32}


@pytest.mark.parametrize(
    ("changes", "sizes", "match"),
    [
        (
            {"num_hidden_layers": 3},
            {"pipeline_model_parallel_size": 2},
            r"`num_hidden_layers` \(3\) must be divisible by the pipeline-parallel size \(2\)"
            r".*Use a PP size that divides 3",
        ),
        (
            {"num_hidden_layers": 6},
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            r"`num_hidden_layers` \(6\) over the pipeline-parallel size \(2\) gives 3 layers per "
            r"stage, which the virtual pipeline size \(2\) does not divide.*PP x VPP \(4\)",
        ),
        (
            {"num_key_value_heads": 1},
            {"tensor_model_parallel_size": 2},
            r"`num_key_value_heads` \(1\) must be divisible by the tensor-parallel size \(2\): "
            r"the bridge gives each TP rank whole key/value heads \(no replication\)\. "
            r"Use a TP size that divides 1\.$",
        ),
        (
            {"intermediate_size": 97},
            {"tensor_model_parallel_size": 2},
            r"`intermediate_size` \(97\) .*equal slice of the MLP\. Use a TP size that divides 97",
        ),
    ],
)
def test_parallel_layout_refused_before_megatron(tmp_path, changes, sizes, match):
    bridge, extra = _bridge_config(tmp_path, **changes)
    config = bridge.transformer_config(**sizes, **extra)  # megatron's config accepts these
    with pytest.raises(ValueError, match=match):
        bridge.build_chunk(config)  # before megatron's bare AssertionError / any collective


def test_packed_attention_refuses_a_window_that_looks_ahead():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from lightning_mcore_rl.models.layers import PackedDotProductAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, window_size=(3, 2)
    )  # transformers' windows are causal: (w - 1, 0)
    with pytest.raises(
        ValueError, match=r"only causal windows `window_size = \(left, 0\)`.*\(3, 2\)"
    ):
        PackedDotProductAttention(config, 1, AttnMaskType.causal, "self")
