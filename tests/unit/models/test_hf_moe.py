"""HFBridge MoE building blocks without ranks: Qwen3-MoE / Mixtral config mapping (router,
mixed dense/MoE layers, sliding windows), the expert weight names on disk, the global expert
index of local experts, and every refused router field and expert layout."""

from __future__ import annotations

import pytest
from helpers.unit import TINY_HF_FIELDS

from lightning_mcore_rl.models.hf.bridge import check_parallel_layout
from lightning_mcore_rl.models.hf.config import parse_architecture
from lightning_mcore_rl.models.hf.weights import hf_name_groups, hf_shapes, moe_param_map

BASE = {**TINY_HF_FIELDS, "num_experts_per_tok": 2}
QWEN3_MOE = {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 48}
MIXTRAL = {**BASE, "model_type": "mixtral", "num_local_experts": 4}


def test_router_fields_reproduce_transformers_routing():
    qwen = parse_architecture(QWEN3_MOE).config_fields()
    assert qwen["num_moe_experts"] == 4 and qwen["moe_router_topk"] == 2
    assert qwen["moe_ffn_hidden_size"] == 48 and qwen["ffn_hidden_size"] == 96
    assert qwen["moe_layer_freq"] == [1, 1] and qwen["qk_layernorm"] is True
    # norm_topk_prob False (Qwen3-MoE's default): the full softmax's top-k values
    assert qwen["moe_router_pre_softmax"] is True
    assert qwen["moe_router_score_function"] == "softmax"
    assert qwen["moe_expert_capacity_factor"] is None  # no token dropping
    assert (qwen["moe_router_load_balancing_type"], qwen["moe_aux_loss_coeff"]) == ("none", 0.0)
    assert qwen["moe_grouped_gemm"] is False and qwen["moe_token_dispatcher_type"] == "alltoall"
    normalized = parse_architecture({**QWEN3_MOE, "norm_topk_prob": True}).config_fields()
    assert normalized["moe_router_pre_softmax"] is False
    mixtral = parse_architecture(MIXTRAL).config_fields()
    assert mixtral["moe_router_pre_softmax"] is False  # Mixtral always renormalises
    assert mixtral["moe_ffn_hidden_size"] == 96 and mixtral["qk_layernorm"] is False


@pytest.mark.parametrize(
    ("change", "layers"),
    [
        ({"num_hidden_layers": 4, "decoder_sparse_step": 2}, [0, 1, 0, 1]),
        ({"num_hidden_layers": 4, "mlp_only_layers": [0, 3]}, [0, 1, 1, 0]),
        ({"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1]}, [0, 0, 0, 1]),
    ],
)
def test_mixed_dense_and_moe_layers_as_transformers_builds_them(change, layers):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = {**QWEN3_MOE, **change}
    arch = parse_architecture(config)
    assert arch.config_fields()["moe_layer_freq"] == layers
    hf_model = AutoModelForCausalLM.from_config(
        Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "model_type"})
    )
    routed = [int(hasattr(layer.mlp, "experts")) for layer in hf_model.model.layers]
    assert routed == layers
    shapes = hf_shapes(arch)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (96, 64)  # dense: intermediate_size
    i = layers.index(1)
    assert shapes[f"model.layers.{i}.mlp.gate.weight"] == (4, 64)
    assert shapes[f"model.layers.{i}.mlp.experts.3.down_proj.weight"] == (64, 48)
    assert f"model.layers.{i}.mlp.gate_proj.weight" not in shapes


def test_every_layer_dense_is_a_dense_model():
    arch = parse_architecture({**QWEN3_MOE, "mlp_only_layers": [0, 1]})
    assert arch.moe is None and "num_moe_experts" not in arch.config_fields()
    assert parse_architecture({**QWEN3_MOE, "num_experts": 0}).moe is None


def test_sliding_window_on_every_layer():
    fields = parse_architecture({**MIXTRAL, "sliding_window": 8}).config_fields()
    assert (fields["window_size"], fields["window_attn_skip_freq"]) == ((7, 0), None)
    qwen = {**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 8}
    assert parse_architecture(qwen).config_fields()["window_size"] == (7, 0)
    # transformers nulls Qwen3-MoE's window unless use_sliding_window
    assert (
        "window_size" not in parse_architecture({**QWEN3_MOE, "sliding_window": 8}).config_fields()
    )


def test_expert_names_on_disk_and_global_expert_index():
    mixtral = parse_architecture(MIXTRAL)
    assert mixtral.moe is not None
    groups = hf_name_groups(mixtral)
    prefix = "model.layers.1.block_sparse_moe."
    assert groups[prefix + "experts.2.w1.weight"] == (
        prefix + "experts.2.w1.weight",
        prefix + "experts.2.w3.weight",
    )
    assert hf_shapes(mixtral)[prefix + "experts.2.w2.weight"] == (64, 96)
    # local expert 1 of EP rank 1 (of 2, E = 4) is global expert 2 * 1 + 1 = 3
    local = "decoder.layers.0.mlp.experts.local_experts.1."
    fc1 = moe_param_map(local + "linear_fc1.weight", 1, mixtral.moe, first_expert=2)
    fc2 = moe_param_map(local + "linear_fc2.weight", 1, mixtral.moe, first_expert=2)
    assert fc1 is not None and fc2 is not None
    assert (fc1.layout, fc1.hf_names) == (
        "fc1",
        (prefix + "experts.3.w1.weight", prefix + "experts.3.w3.weight"),
    )
    assert (fc2.layout, fc2.hf_names) == ("dim1", (prefix + "experts.3.w2.weight",))
    router = moe_param_map("decoder.layers.0.mlp.router.weight", 1, mixtral.moe, first_expert=2)
    assert router is not None and router.hf_names == (prefix + "gate.weight",)
    assert moe_param_map("decoder.layers.0.mlp.linear_fc1.weight", 1, mixtral.moe, 0) is None


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**QWEN3_MOE, "output_router_logits": True}, r"`output_router_logits` = True"),
        ({**MIXTRAL, "output_router_logits": True}, r"`output_router_logits` = True"),
        ({**MIXTRAL, "router_jitter_noise": 0.1}, r"`router_jitter_noise` = 0.1"),
        ({**QWEN3_MOE, "num_experts_per_tok": 5}, r"`num_experts_per_tok` = 5: must be in \[1, `num_experts`"),
        ({**MIXTRAL, "num_experts_per_tok": 0}, r"`num_experts_per_tok` = 0: .*`num_local_experts`"),
        ({**QWEN3_MOE, "num_experts_per_tok": 1, "norm_topk_prob": True}, r"`norm_topk_prob` = True"),
        ({**MIXTRAL, "num_experts_per_tok": 1}, r"`num_experts_per_tok` = 1: one expert"),
        ({**QWEN3_MOE, "decoder_sparse_step": 0}, r"`decoder_sparse_step` = 0"),
        ({**QWEN3_MOE, "attention_bias": True}, r"`attention_bias` = True"),
        ({**QWEN3_MOE, "hidden_act": "gelu"}, r"`hidden_act` = 'gelu'"),
        ({**BASE, "model_type": "olmoe"}, r"`model_type` 'olmoe': its q_norm/k_norm normalise"),
    ],
)  # fmt: skip
def test_unmappable_router_fields_raise(config, match):
    with pytest.raises(ValueError, match=match):
        parse_architecture(config)


def test_top_k_one_without_renormalisation_maps():
    fields = parse_architecture({**QWEN3_MOE, "num_experts_per_tok": 1}).config_fields()
    assert (fields["moe_router_topk"], fields["moe_router_pre_softmax"]) == (1, True)


@pytest.mark.parametrize(
    ("config", "sizes", "match"),
    [
        (QWEN3_MOE, {"expert_model_parallel_size": 3}, r"`num_experts` \(4\) must be divisible by the expert-parallel size \(3\)"),
        (MIXTRAL, {"expert_model_parallel_size": 8}, r"`num_local_experts` \(4\) must be divisible"),
        (
            QWEN3_MOE,
            {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 5},
            r"`moe_intermediate_size` \(48\) must be divisible by the expert tensor-parallel size \(5\)",
        ),
        (MIXTRAL, {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 5}, r"`intermediate_size` \(96\) must be divisible by the expert tensor"),
        (QWEN3_MOE, {"tensor_model_parallel_size": 2}, r"under tensor parallelism \(TP=2\) need sequence parallelism: .*`sequence_parallel=True`"),
    ],
)  # fmt: skip
def test_expert_layout_refused_before_megatron(config, sizes, match):
    from megatron.core.transformer import TransformerConfig

    arch = parse_architecture(config)
    transformer_config = TransformerConfig(**arch.config_fields(), **sizes)  # megatron accepts it
    with pytest.raises(ValueError, match=match):
        check_parallel_layout(arch, transformer_config)
