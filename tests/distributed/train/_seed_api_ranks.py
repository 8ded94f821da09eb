"""Rank worker for the seed-API test: every seed function and post-processor called with only the
seed's parameters (no ``groups``: resolved from megatron's initialised state, as NeMo RL calls
them) against the same call with the strategy's explicit ``groups``."""

from __future__ import annotations

from typing import Any

import torch
from _train_step_ranks import build_setup, loss_fn_for, make_batch
from megatron.core import parallel_state as ps

from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import megatron_groups, unwrap_model
from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.train import (
    LogprobsPostProcessor,
    LossPostProcessor,
    TeacherFullPayloadPostProcessor,
    TopkLogitsPostProcessor,
    _prepare_padding_mask_for_model,
    aggregate_training_statistics,
    forward_with_post_processing_fn,
    megatron_forward_backward,
    model_forward,
    process_global_batch,
)

MBS = 2


def _batch() -> Any:
    return process_global_batch(make_batch(), ps.get_data_parallel_group(), MBS)


def _train(setup: Any, **groups: Any) -> dict[str, Any]:
    """One ClippedPG forward-backward; the metrics, the global loss and the main grads."""
    for chunk in setup.chunks:
        chunk.zero_grad_buffer()
    batch = _batch()
    post = LossPostProcessor(loss_fn_for("pg"), None, num_microbatches=batch.num_microbatches)
    metrics = megatron_forward_backward(
        setup.chunks[0], batch.iterator(), batch.num_microbatches, batch.seq_length,
        batch.micro_batch_size, post, global_valid_seqs=batch.global_valid_seqs,
        global_valid_toks=batch.global_valid_toks, **groups,
    )  # fmt: skip
    losses = [sum(float(m["loss"]) for m in metrics)]
    reduced, loss = aggregate_training_statistics(metrics, losses, ps.get_data_parallel_group())
    grads = [p.main_grad.detach().clone() for p in setup.chunks[0].parameters()]
    return {"metrics": reduced, "loss": loss, "grads": grads}


def _forward_only(setup: Any, post: Any, **groups: Any) -> list[dict[str, Any]]:
    batch = _batch()
    return megatron_forward_backward(
        setup.chunks[0], batch.iterator(), batch.num_microbatches, batch.seq_length,
        batch.micro_batch_size, post, forward_only=True,
        sampling_params=TrainingSamplingParams(temperature=0.7), **groups,
    )  # fmt: skip


def _posts() -> dict[str, Any]:
    return {
        "logprobs": LogprobsPostProcessor(None),
        "topk": TopkLogitsPostProcessor(None, 5),
        "payload": TeacherFullPayloadPostProcessor(None, "logits", torch.float32),
    }


def _direct(setup: Any, **groups: Any) -> dict[str, Any]:
    """The forward step, ``model_forward``, the padding-mask helper and a post-processor's
    ``__call__``, each called directly with the seed's parameters."""
    mb = next(_batch().iterator())
    model = setup.chunks[0]
    with torch.no_grad():
        output, fn = forward_with_post_processing_fn(
            iter([mb]), model, LogprobsPostProcessor(None), **groups
        )
        step_logprobs = fn(output)[1]["logprobs"]
        logits = model_forward(
            model, mb.data_dict, mb.input_ids_cp_sharded, mb.position_ids, mb.attention_mask
        )
    bound = LogprobsPostProcessor(None)(
        mb.data_dict, mb.input_ids, None, mb.original_seq_length, **groups
    )
    mask = torch.zeros(MBS, mb.input_ids.shape[1], dtype=torch.bool)
    mask[:, -2:] = True
    sliced = _prepare_padding_mask_for_model(
        unwrap_model(model), mask, model_slices_context_parallel_inputs=True, **groups
    )
    return {
        "step_logprobs": step_logprobs,
        "logits": logits,
        "call_logprobs": bound(logits.clone())[1]["logprobs"],
        "padding_mask": sliced,
    }


def seed_api_run(rank: int) -> dict[str, Any]:
    """TP=2: each entry point without ``groups`` (the seed's call) and with them (the core's)."""
    init_megatron_state(tensor_model_parallel_size=2)
    setup = build_setup()
    explicit = {"groups": megatron_groups()}
    out: dict[str, Any] = {"seed_train": _train(setup), "core_train": _train(setup, **explicit)}
    for name, post in _posts().items():
        out[f"seed_{name}"] = _forward_only(setup, post)
        out[f"core_{name}"] = _forward_only(setup, post, **explicit)
    out["seed_direct"] = _direct(setup)
    out["core_direct"] = _direct(setup, **explicit)
    return out
