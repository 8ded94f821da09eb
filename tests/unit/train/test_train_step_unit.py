"""Single-process checks of the training-step layer: contracts, scaling, errors.

Post-processors get size-1 fake groups explicitly (``groups=``, as the forward step passes the
step context's); model calls use small stand-in modules.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.unit import FakeGroup
from torch import nn

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.extensions.eagle_draft import DraftExtension
from lightning_mcore_rl.losses import ClippedPGLossFn, NLLLossFn
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import ParallelGroups
from lightning_mcore_rl.train import (
    LogprobsPostProcessor,
    LossPostProcessor,
    PolicyConfig,
    TeacherFullPayloadPostProcessor,
    TopkLogitsPostProcessor,
    apply_temperature_scaling,
    causal_attention_mask,
    forward_with_post_processing_fn,
    load_policy_config,
    model_forward,
    process_microbatch,
    should_reduce_loss_across_context_parallel,
    strip_context_parallel_local_loss_metric,
    suspend_activation_offload_for_forward_only,
)


def _groups() -> ParallelGroups:
    g = FakeGroup()
    return ParallelGroups(
        tp_group=g, tp_rank=0, tp_size=1, pp_group=g, pp_rank=0, pp_size=1, pp_last_rank=0,
        dp_group=g, dp_rank=0, dp_size=1, cp_group=g, cp_rank=0, cp_size=1,
    )  # fmt: skip


G = _groups()


def _data() -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    return BatchedDataDict(
        input_ids=torch.randint(0, 8, (2, 5), generator=g),
        input_lengths=torch.tensor([5, 3]),
        token_mask=torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]).float(),
        sample_mask=torch.ones(2),
    )


def test_temperature_is_applied_in_place() -> None:
    logits = torch.randn(2, 3, 4)
    original = logits.clone()
    out = apply_temperature_scaling(logits, TrainingSamplingParams(temperature=0.5))
    assert out is logits and out.data_ptr() == logits.data_ptr()
    assert torch.equal(out, original / 0.5)
    assert apply_temperature_scaling(logits, None) is logits
    kept = logits.clone()
    apply_temperature_scaling(logits, TrainingSamplingParams(temperature=1.0))
    assert torch.equal(logits, kept)


def test_context_parallel_loss_helpers_contract() -> None:
    assert should_reduce_loss_across_context_parallel({"packed_cu_seqlens": 1, "target_ids": 2})
    assert should_reduce_loss_across_context_parallel({"packed_cu_seqlens": 1})
    assert not should_reduce_loss_across_context_parallel({"target_ids": 2})
    loss = torch.tensor(1.0)
    metrics = {"loss": [loss], "lr": [1e-4]}
    assert strip_context_parallel_local_loss_metric(metrics, True) == {"lr": [1e-4]}
    assert strip_context_parallel_local_loss_metric(metrics, False) is metrics


def test_policy_config_from_nemo_mapping() -> None:
    cfg = load_policy_config(
        {"sequence_packing": {"enabled": True, "fuse_loss": True}, "logprob_chunk_size": 8,
         "draft": {"loss_weight": 0.5}, "optimizer": {"lr": 1}}
    )  # fmt: skip
    assert cfg == PolicyConfig(True, True, 8, 0.5)
    assert load_policy_config(None) == PolicyConfig()
    with pytest.raises(ValueError, match="fuse_loss"):
        PolicyConfig(fuse_loss=True)
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        PolicyConfig(logprob_chunk_size=0)
    with pytest.raises(TypeError, match="PolicyConfig or a mapping"):
        load_policy_config(3)


def test_loss_post_processor_scales_by_microbatches_over_cp_squared() -> None:
    data = _data()
    logits = torch.randn(2, 5, 8)
    post = LossPostProcessor(NLLLossFn(), None, num_microbatches=4)
    loss, metrics = post(data, None, torch.tensor(2.0), torch.tensor(5.0), groups=G)(logits)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    expected = -(lp * data["token_mask"][:, 1:]).sum() / 5.0
    assert float(metrics["loss"]) == pytest.approx(float(expected), abs=1e-6)
    assert float(loss) == pytest.approx(4 * float(expected), abs=1e-6)  # M=4, CP=1
    loss.div_(4)  # Megatron divides the returned loss in place: the metric must not move
    assert float(metrics["loss"]) == pytest.approx(float(expected), abs=1e-6)


def test_direct_prepacked_sft_loss() -> None:
    data = _data()
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    post = LossPostProcessor(NLLLossFn(), None, num_microbatches=2)
    loss, metrics = post(data, None, None, torch.tensor(4.0), prepacked_loss_mask=mask, groups=G)(
        per_token
    )
    assert float(metrics["loss"]) == pytest.approx(8.0 / 4.0)  # (1 + 3 + 4) / N_t
    assert float(loss) == pytest.approx(2 * 2.0)
    assert float(metrics["num_valid_samples"]) == 2
    with pytest.raises(ValueError, match="loss and loss mask shapes must match"):
        post(data, None, None, torch.tensor(4.0), prepacked_loss_mask=mask[:, :3], groups=G)(
            per_token
        )
    with pytest.raises(TypeError, match="requires the loss function to be NLLLossFn"):
        LossPostProcessor(ClippedPGLossFn(), None, 1)(data, prepacked_loss_mask=mask, groups=G)


def test_loss_post_processor_takes_the_pass_microbatch_count() -> None:
    """Built without ``M`` (the module hooks), the pass's ``M`` scales the loss; one built with
    another ``M`` than the pass's, or no ``M`` at all, is refused before any forward output."""
    data = _data()
    logits = torch.randn(2, 5, 8)
    counts = (None, torch.tensor(5.0))
    hook = LossPostProcessor(NLLLossFn(), None)
    loss, metrics = hook(data, None, *counts, groups=G, num_microbatches=3)(logits)
    assert float(loss) == pytest.approx(3 * float(metrics["loss"]), abs=1e-6)  # M=3, CP=1
    with pytest.raises(ValueError, match="needs the pass's `num_microbatches`"):
        hook(data, None, *counts, groups=G)
    with pytest.raises(ValueError, match="built with num_microbatches=2 but the pass runs 3"):
        LossPostProcessor(NLLLossFn(), None, 2)(data, None, *counts, groups=G, num_microbatches=3)


def test_without_groups_cp_slicing_reads_megatron_state_or_says_it_is_missing() -> None:
    from megatron.core import parallel_state as ps

    from lightning_mcore_rl.train import _prepare_padding_mask_for_model

    assert not ps.model_parallel_is_initialized()  # this process never initialises it
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="parallel state is not initialised.*pass `groups="):
        _prepare_padding_mask_for_model(_Model(), mask, model_slices_context_parallel_inputs=True)


def test_loss_post_processor_argument_errors() -> None:
    with pytest.raises(ValueError, match="num_microbatches"):
        LossPostProcessor(NLLLossFn(), None, num_microbatches=0)
    assert LossPostProcessor(
        NLLLossFn(), None, defer_draft_normalization=True
    ).defer_draft_normalization


def test_fused_packed_loss_rejects_a_custom_prepare_fn() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
    cfg = {"sequence_packing": {"enabled": True, "fuse_loss": True}}
    post = LossPostProcessor(NLLLossFn(), cfg, prepare_fn=lambda *a: None)
    with pytest.raises(ValueError, match="custom `prepare_fn`"):
        post(_data(), params, groups=G, num_microbatches=1)


def test_pairwise_losses_refuse_the_per_sequence_packed_wrapper() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    from lightning_mcore_rl.losses import DPOLossFn, PreferenceLossFn
    from lightning_mcore_rl.train.validation import loss_input_keys

    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
    packed = {"sequence_packing": {"enabled": True}}
    for loss_fn in (DPOLossFn(), PreferenceLossFn()):
        with pytest.raises(ValueError, match="scores chosen/rejected pairs.*fuse_loss=True"):
            LossPostProcessor(loss_fn, packed)(_data(), params, groups=G, num_microbatches=1)
    assert loss_input_keys(DPOLossFn()) == ("token_mask", "reference_policy_logprobs")


def test_logprobs_post_processor_prepends_zero_and_truncates() -> None:
    data = _data()
    logits = torch.randn(2, 7, 8)  # dense padding to 7 (pipeline parallelism)
    data_padded = BatchedDataDict(data)
    loss, out = LogprobsPostProcessor(None)(data_padded, data["input_ids"], None, 5, groups=G)(
        logits
    )
    lp = torch.log_softmax(logits[:, :4], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    assert float(loss) == 0.0
    assert out["logprobs"].shape == (2, 5)
    assert torch.equal(out["logprobs"][:, 0], torch.zeros(2))
    assert torch.allclose(out["logprobs"][:, 1:], lp, atol=1e-6)


def test_post_processor_argument_errors() -> None:
    with pytest.raises(ValueError, match="positive int"):
        TopkLogitsPostProcessor(None, 0)
    with pytest.raises(ValueError, match="'hidden_states' or 'logits'"):
        TeacherFullPayloadPostProcessor(None, "probs", torch.float32)


def test_teacher_payload_errors() -> None:
    data = _data()
    post = TeacherFullPayloadPostProcessor(None, "hidden_states", torch.float32)
    with pytest.raises(ValueError, match="enable_opd_full_capture"):
        post(data, data["input_ids"], None, 5, groups=G)(torch.randn(2, 5, 8))
    split = torch.randn(2, 2, 3)  # [S/TP, B, H] under sequence parallelism
    with pytest.raises(ValueError, match="sequence-parallel"):
        post(data, data["input_ids"], None, 5, hidden_states=split, groups=G)(torch.randn(2, 5, 8))
    hidden = torch.randn(5, 2, 3)
    _, out = post(data, data["input_ids"], None, 5, hidden_states=hidden, groups=G)(
        torch.randn(2, 5, 8)
    )
    assert torch.equal(out["teacher_full_payload"], hidden.transpose(0, 1))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []
        self.post_process = True

    def forward(self, ids, position_ids, attention_mask, **kwargs):
        self.calls.append(kwargs)
        return torch.ones(*ids.shape, 3, dtype=torch.bfloat16), "aux"


def test_model_forward_kwargs_tuple_output_cast_and_timer() -> None:
    model, entered = _Model(), []

    class Timer:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    ids = torch.zeros(1, 4, dtype=torch.long)
    out = model_forward(model, _data(), ids, None, None, straggler_timer=Timer)
    assert out.dtype == torch.float32 and out.shape == (1, 4, 3)
    assert entered == [True] and model.calls == [{}]
    out = model_forward(model, _data(), ids, None, None, packed_seq_params="p",
                        defer_fp32_logits=True, mtp_loss_mask="m")  # fmt: skip
    assert out.dtype == torch.bfloat16
    assert model.calls[-1] == {"packed_seq_params": "p", "loss_mask": "m"}


def test_model_forward_rejects_unsupported_features() -> None:
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="Direct packed SFT labels"):
        model_forward(_Model(), _data(), ids, None, None, use_fused_linear_logprobs=True,
                      labels_cp_sharded=ids)  # fmt: skip
    with pytest.raises(TypeError, match="needs megatron GPTModel chunks"):
        model_forward(_Model(), _data(), ids, None, None, use_fused_linear_logprobs=True)
    with pytest.raises(NotImplementedError, match="multimodal"):
        model_forward(_Model(), _data(), ids, None, None, media_token_validity_mask=ids)


def test_forward_step_rejects_unknown_post_processors_and_missing_components() -> None:
    never = iter(())  # nothing is consumed before the checks
    with pytest.raises(TypeError, match="Unknown post-processing function type"):
        forward_with_post_processing_fn(never, _Model(), lambda *a: None, groups=G)
    loss = LossPostProcessor(NLLLossFn(), None)
    draft = (DraftExtension(None),)  # no draft model: the draft's check refuses the forward
    with pytest.raises(ValueError, match="`enable_hidden_capture=True` on the last pipeline stage "
                       "needs the `draft_model`"):  # fmt: skip
        forward_with_post_processing_fn(
            iter([None]), _Model(), loss, extensions=draft, training=True, groups=G
        )
    cp2 = dataclasses.replace(G, cp_size=2)
    with pytest.raises(
        ValueError, match="draft-model training needs context_parallel_size=1.*CP=2"
    ):
        forward_with_post_processing_fn(
            iter([None]), _Model(), loss, extensions=draft, training=True, groups=cp2
        )


class _Chunk(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config


class _Config:
    def __init__(self, offload: bool) -> None:
        self.fine_grained_activation_offloading = offload


def test_offload_is_suspended_for_forward_only_and_restored_on_error() -> None:
    shared, other = _Config(True), _Config(False)
    chunks = [_Chunk(shared), _Chunk(shared), _Chunk(other)]
    with suspend_activation_offload_for_forward_only(chunks, forward_only=True):
        assert not shared.fine_grained_activation_offloading
    assert (
        shared.fine_grained_activation_offloading and not other.fine_grained_activation_offloading
    )
    with (
        pytest.raises(RuntimeError, match="boom"),
        suspend_activation_offload_for_forward_only(chunks, forward_only=True),
    ):
        raise RuntimeError("boom")
    assert shared.fine_grained_activation_offloading
    with suspend_activation_offload_for_forward_only(chunks, forward_only=False):
        assert shared.fine_grained_activation_offloading  # training keeps offloading on


def test_offload_config_lookup_is_atomic() -> None:
    config = _Config(True)
    ran = []
    chunks = [_Chunk(config), nn.Linear(1, 1)]  # the second chunk has no config
    with (
        pytest.raises(RuntimeError, match="couldn't find attribute config"),
        suspend_activation_offload_for_forward_only(chunks, True),
    ):
        ran.append(True)
    assert config.fine_grained_activation_offloading and ran == []


def test_process_microbatch_padded_and_packed() -> None:
    data = _data()
    mb = process_microbatch(data, pad_full_seq_to=8)
    assert mb.input_ids.shape == (2, 8) and mb.original_seq_length == 5
    assert torch.equal(mb.attention_mask, causal_attention_mask(8))
    assert mb.attention_mask[0, 0, 0, 1] and not mb.attention_mask[0, 0, 1, 0]
    assert torch.equal(mb.position_ids[1], torch.arange(8))
    packed = process_microbatch(data, sequence_packing=True)
    assert packed.input_ids.tolist() == [
        data["input_ids"][0].tolist() + data["input_ids"][1, :3].tolist()
    ]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert packed.cu_seqlens_padded.tolist() == [0, 5, 8] and packed.attention_mask is None


def test_process_microbatch_errors() -> None:
    data = _data()
    with pytest.raises(ValueError, match="requires sequence packing"):
        process_microbatch(data, cp_size=2)
    del data["input_lengths"]
    with pytest.raises(ValueError, match="input_lengths"):
        process_microbatch(data, sequence_packing=True)
    with pytest.raises(ValueError, match="pad_full_seq_to"):
        process_microbatch(_data(), pad_full_seq_to=3)


def test_a_post_processor_with_another_temperature_is_rejected() -> None:
    from lightning_mcore_rl.ops import TrainingSamplingParams
    from lightning_mcore_rl.train import LogprobsPostProcessor, TeacherFullPayloadPostProcessor
    from lightning_mcore_rl.train.step import _check_temperature

    hot = TrainingSamplingParams(temperature=2.0)
    _check_temperature(LogprobsPostProcessor(None, sampling_params=hot), hot)  # same: fine
    _check_temperature(LogprobsPostProcessor(None), None)
    with pytest.raises(ValueError, match=r"built with temperature=2.0 but the step applies"):
        _check_temperature(LogprobsPostProcessor(None, sampling_params=hot), None)
    payload = TeacherFullPayloadPostProcessor(None, "logits", torch.float32, sampling_params=hot)
    with pytest.raises(ValueError, match="temperature=1.5"):
        _check_temperature(payload, TrainingSamplingParams(temperature=1.5))
