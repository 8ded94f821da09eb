"""The seed API keeps NeMo RL's signatures: every function and class of the two seed pages
takes the seed's parameters, in the seed's order (a NeMo RL caller may pass them positionally),
and the per-feature flags the core moved into extensions still turn those extensions on."""

from __future__ import annotations

import importlib
import inspect

import pytest

from lightning_mcore_rl.train.extension import seed_flag_extensions

# name -> the parameters of the seed pages (NeMo RL's `nemo_rl.models.megatron.train` and
# `nemo_rl.algorithms.loss.loss_input`), in order; classes: their constructor's
SEED: dict[str, list[str]] = {
    "train._prepare_padding_mask_for_model": [
        "model",
        "padding_mask",
        "model_slices_context_parallel_inputs",
    ],
    "train.suspend_activation_offload_for_forward_only": ["model", "forward_only"],
    "train.model_forward": [
        "model",
        "data_dict",
        "input_ids_cp_sharded",
        "position_ids",
        "attention_mask",
        "packed_seq_params",
        "defer_fp32_logits",
        "mtp_loss_mask",
        "padding_mask",
        "straggler_timer",
        "use_fused_linear_logprobs",
        "labels_cp_sharded",
        "loss_mask_cp_sharded",
        "media_token_validity_mask",
        "model_slices_context_parallel_inputs",
    ],
    "train.apply_temperature_scaling": ["logits", "sampling_params"],
    "train.forward_with_post_processing_fn": [
        "data_iterator",
        "model",
        "post_processing_fn",
        "defer_fp32_logits",
        "global_valid_seqs",
        "global_valid_toks",
        "sampling_params",
        "straggler_timer",
        "draft_model",
        "enable_hidden_capture",
        "enable_opd_full_capture",
        "use_fused_linear_logprobs",
        "use_router_replay",
        "router_replay_train",
        "model_slices_context_parallel_inputs",
    ],
    "train.megatron_forward_backward": [
        "model",
        "data_iterator",
        "num_microbatches",
        "seq_length",
        "mbs",
        "post_processing_fn",
        "forward_only",
        "defer_fp32_logits",
        "global_valid_seqs",
        "global_valid_toks",
        "sampling_params",
        "straggler_timer",
        "draft_model",
        "enable_hidden_capture",
        "enable_opd_full_capture",
        "use_fused_linear_logprobs",
        "use_router_replay",
        "router_replay_train",
        "model_slices_context_parallel_inputs",
    ],
    "train.LossPostProcessor": [
        "loss_fn",
        "cfg",
        "num_microbatches",
        "cp_normalize",
        "sampling_params",
        "draft_model",
        "prepare_fn",
        "defer_draft_normalization",
        "teacher_output_layer_weight_by_index",
    ],
    "train.should_reduce_loss_across_context_parallel": ["data"],
    "train.strip_context_parallel_local_loss_metric": ["metrics", "enabled"],
    "train.LogprobsPostProcessor": ["cfg", "sampling_params", "use_fused_linear_logprobs"],
    "train.TeacherFullPayloadPostProcessor": ["cfg", "payload", "payload_dtype", "sampling_params"],
    "train.TopkLogitsPostProcessor": ["cfg", "k"],
    "train.aggregate_training_statistics": ["all_mb_metrics", "losses", "data_parallel_group"],
    "losses.loss_input._prepare_opd_full_loss_input": [
        "logits",
        "data",
        "loss_fn",
        "vocab_parallel_rank",
        "vocab_parallel_group",
        "context_parallel_group",
        "sampling_params",
        "chunk_size",
        "teacher_output_layer_weight_by_index",
    ],
    "losses.loss_input.prepare_loss_input": [
        "logits",
        "data",
        "loss_fn",
        "vocab_parallel_rank",
        "vocab_parallel_group",
        "context_parallel_group",
        "sampling_params",
        "d2t",
        "chunk_size",
        "cp_sharder",
        "teacher_output_layer_weight_by_index",
    ],
    "losses.loss_input.prepare_packed_loss_input": [
        "logits",
        "data",
        "loss_fn",
        "cu_seqlens_q",
        "cu_seqlens_q_padded",
        "vocab_parallel_rank",
        "vocab_parallel_group",
        "context_parallel_group",
        "sampling_params",
        "chunk_size",
    ],
}


@pytest.mark.parametrize("path", sorted(SEED))
def test_seed_parameters_in_the_seed_order(path: str) -> None:
    module, _, name = path.rpartition(".")
    obj = getattr(importlib.import_module(f"lightning_mcore_rl.{module}"), name)
    signature = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    params = [p for p in signature.parameters.values() if p.name != "self"]
    want = SEED[path]
    assert [p.name for p in params[: len(want)]] == want
    # whatever the package adds after them has a default: a seed-only call still binds
    assert all(p.default is not inspect.Parameter.empty for p in params[len(want) :])


def test_seed_flags_turn_on_their_extensions_once() -> None:
    assert seed_flag_extensions((), None, False, False, False) == ()
    draft, replay = seed_flag_extensions((), object(), True, True, True)
    assert [type(e.inner).__name__ for e in (draft, replay)] == ["DraftExtension", "MoEExtension"]
    # the pass's own flag does not matter: the seed flag is the forward hooks' `training`
    assert (draft.training, replay.training) == (True, True)
    assert seed_flag_extensions((), None, False, True, False)[0].training is False
    # a kind already present (the package's own calls) is not added a second time
    assert seed_flag_extensions((draft, replay), object(), True, True, True) == (draft, replay)
    with pytest.raises(ValueError, match="router_replay_train=True. needs .use_router_replay=True"):
        seed_flag_extensions((), None, False, False, True)
