"""The fused LM head's scoped mechanism and its errors (``lightning_mcore_rl.train.fused``).

``lm_head_returns_hidden`` gives one real tiny ``GPTModel``'s output layer an instance
``forward`` for the block: inside, the model returns its final-norm output and ``hidden x
output_weight^T`` is the logits; after the block (also when it raises) the output layer is the
original again. ``model_forward`` keeps a ``Float16Module``'s output in bf16 for deferred logits
and fused hidden states. The model runs on one gloo rank (megatron's parallel state); the error
checks run in-process on size-1 fake groups.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.unit import FakeGroup

from lightning_mcore_rl.losses import ClippedPGLossFn, MseValueLossFn, PreferenceLossFn
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.testing import run_on_ranks
from lightning_mcore_rl.train import (
    LogprobsPostProcessor,
    LossPostProcessor,
    ParallelGroups,
    TeacherFullPayloadPostProcessor,
    TopkLogitsPostProcessor,
    run_global_batch,
)
from lightning_mcore_rl.train.forward import check_fused_linear_logprobs

B, S, VOCAB = 2, 8, 128


def _scope_rank(rank: int, tied: bool) -> dict[str, Any]:
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config
    from lightning_mcore_rl.train import causal_attention_mask
    from lightning_mcore_rl.train.fused import lm_head_returns_hidden, output_weight

    init_megatron_state()
    model = tiny_gpt(tiny_gpt_config(), vocab_size=VOCAB, share_embeddings_and_output_weights=tied)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.arange(S)[None, :].expand(B, -1), causal_attention_mask(S))
    final_norm: list[torch.Tensor] = []
    model.decoder.final_layernorm.register_forward_hook(
        lambda m, i, out: final_norm.append(out.transpose(0, 1))  # [S, B, H] -> [B, S, H]
    )
    head_calls: list[bool] = []
    model.output_layer.register_forward_pre_hook(lambda m, a: head_calls.append(True))
    original = type(model.output_layer).forward
    out: dict[str, Any] = {}
    with torch.no_grad():
        logits = model(*args)  # [B, S, V]
        with lm_head_returns_hidden(model):
            out["inside_has_instance_forward"] = "forward" in vars(model.output_layer)
            hidden = model(*args)  # [B, S, H]
            weight = output_weight(model)
            out["nested"] = _error(lambda: lm_head_returns_hidden(model).__enter__())
            out["other_weight"] = _error(
                lambda: model.output_layer(hidden.transpose(0, 1), weight=weight.clone())
            )
        out["restored"] = "forward" not in vars(model.output_layer)
        out["raises_inside"] = _error(lambda: _raise_inside(model, ids))
        out["restored_after_error"] = "forward" not in vars(model.output_layer)
        out["class_forward_untouched"] = type(model.output_layer).forward is original
        after = model(*args)
    out["hidden_is_final_norm"] = float((hidden - final_norm[1]).abs().max())
    out["hidden_shape"] = tuple(hidden.shape)
    out["hidden_x_weight_vs_logits"] = float((hidden @ weight.t() - logits).abs().max())
    out["logits_after_vs_before"] = float((after - logits).abs().max())
    out["weight_is_embedding"] = weight is model.embedding.word_embeddings.weight
    out["head_hook_calls"] = len(head_calls)  # the layer's hooks still run inside the scope
    return out


def _float16_rank(rank: int) -> dict[str, Any]:
    """``model_forward`` on a bf16 ``GPTModel`` in megatron's ``Float16Module``."""
    from megatron.core.transformer.module import Float16Module

    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config
    from lightning_mcore_rl.train import causal_attention_mask, model_forward

    init_megatron_state()
    config = tiny_gpt_config(bf16=True)
    model = Float16Module(config, tiny_gpt(config, vocab_size=VOCAB))
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    args = (model, None, ids, torch.arange(S)[None, :].expand(B, -1), causal_attention_mask(S))
    with torch.no_grad():
        outputs = {
            "logits": model_forward(*args),
            "deferred": model_forward(*args, defer_fp32_logits=True),
            "fused": model_forward(*args, use_fused_linear_logprobs=True),
        }
    out: dict[str, Any] = {k: (v.dtype, tuple(v.shape)) for k, v in outputs.items()}
    out["restored"] = "forward" not in vars(model.module.output_layer)
    return out


def test_model_forward_keeps_the_model_dtype_for_deferred_and_fused_outputs() -> None:
    (out,) = run_on_ranks(_float16_rank, 1, timeout=90)
    assert out["logits"] == (torch.float32, (B, S, VOCAB))  # Float16Module's fp32 upcast
    assert out["deferred"] == (torch.bfloat16, (B, S, VOCAB))  # fp32_output=False
    assert out["fused"] == (torch.bfloat16, (B, S, 64))  # hidden states, no fp32 copy
    assert out["restored"]


def _raise_inside(model: torch.nn.Module, ids: torch.Tensor) -> None:
    from lightning_mcore_rl.train.fused import lm_head_returns_hidden

    with lm_head_returns_hidden(model):
        model(ids + VOCAB, torch.arange(S)[None, :].expand(B, -1), None)  # ids out of range


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return ""


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_lm_head_bypass_is_scoped_and_restored(tied: bool) -> None:
    (out,) = run_on_ranks(_scope_rank, 1, tied, timeout=90)
    assert out["inside_has_instance_forward"]
    assert out["hidden_shape"] == (B, S, 64)  # [B, S, H]: no logits were built
    assert out["hidden_is_final_norm"] == 0.0
    assert out["hidden_x_weight_vs_logits"] <= 1e-5  # the weight GPTModel would have used
    assert out["weight_is_embedding"] == tied
    assert out["nested"].startswith("RuntimeError: the output layer of this chunk is already")
    assert out["other_weight"].startswith("RuntimeError: GPTModel called its output layer")
    assert out["restored"] and out["restored_after_error"] and out["class_forward_untouched"]
    assert out["raises_inside"].startswith("IndexError")  # the model's own error, unchanged
    assert out["logits_after_vs_before"] == 0.0
    assert out["head_hook_calls"] == 4  # logits, hidden, other-weight call, after


# ---------------------------------------------------------------- errors (in-process)

PG = {"reference_policy_kl_penalty": 0.0}
TOP_K = TrainingSamplingParams(temperature=2.0, top_k=4)
REMEDY = r"use `MCoreRLStrategy\(logprobs=LogprobKernelConfig\(use_fused_linear_logprobs=False\)\)`"


def test_loss_post_processor_rejects_what_needs_logits() -> None:
    with pytest.raises(ValueError, match=r"MseValueLossFn \(loss input .*LOGIT.*" + REMEDY):
        LossPostProcessor(MseValueLossFn(), None, use_fused_linear_logprobs=True)
    with pytest.raises(ValueError, match="PreferenceLossFn"):
        LossPostProcessor(PreferenceLossFn(), None, use_fused_linear_logprobs=True)
    with pytest.raises(ValueError, match="a custom `prepare_fn`.*" + REMEDY):
        LossPostProcessor(
            ClippedPGLossFn(PG), None, prepare_fn=lambda *a: a, use_fused_linear_logprobs=True
        )
    with pytest.raises(ValueError, match="an EAGLE `draft_model`"):
        LossPostProcessor(
            ClippedPGLossFn(PG), None, draft_model=object(), use_fused_linear_logprobs=True
        )
    with pytest.raises(ValueError, match=r"top-k/top-p filtering in LossPostProcessor \(top_k=4"):
        LossPostProcessor(
            ClippedPGLossFn(PG), None, sampling_params=TOP_K, use_fused_linear_logprobs=True
        )
    with pytest.raises(
        ValueError, match=r"LogprobsPostProcessor \(top_k=4, top_p=1.0\).*" + REMEDY
    ):
        LogprobsPostProcessor(None, TOP_K, use_fused_linear_logprobs=True)


def test_fused_pass_check_names_the_option() -> None:
    chunks = [torch.nn.Linear(2, 2)]
    plain = LossPostProcessor(ClippedPGLossFn(PG), None)
    with pytest.raises(ValueError, match="LossPostProcessor was built with use_fused_linear_"
                       "logprobs=False but the pass runs with use_fused_linear_logprobs=True"):  # fmt: skip
        check_fused_linear_logprobs(chunks, plain, None, True)
    fused = LogprobsPostProcessor(None, use_fused_linear_logprobs=True)
    with pytest.raises(ValueError, match="built with use_fused_linear_logprobs=True"):
        check_fused_linear_logprobs(chunks, fused, None, False)
    check_fused_linear_logprobs(chunks, plain, TOP_K, False)  # the logits path: nothing to check
    for post in (
        TopkLogitsPostProcessor(None, 4),
        TeacherFullPayloadPostProcessor(None, "hidden_states", torch.float32),
    ):
        with pytest.raises(ValueError, match=f"{type(post).__name__} needs the .*" + REMEDY):
            check_fused_linear_logprobs(chunks, post, None, True)
    with pytest.raises(ValueError, match=r"filtering in the step's sampling_params \(top_k=4"):
        check_fused_linear_logprobs(chunks, None, TOP_K, True)
    with pytest.raises(TypeError, match="needs megatron GPTModel chunks .* chunk 0 of type Linear"):
        check_fused_linear_logprobs(chunks, None, None, True)


def test_run_global_batch_rejects_fused_lm_path_before_any_collective() -> None:
    g = FakeGroup()  # any collective on it fails: the error must come first
    groups = ParallelGroups(
        tp_group=g, tp_rank=0, tp_size=1, pp_group=g, pp_rank=0, pp_size=1, pp_last_rank=0,
        dp_group=g, dp_rank=0, dp_size=1, cp_group=g, cp_rank=0, cp_size=1,
    )  # fmt: skip
    from lightning_mcore_rl.train import StepContext

    context = StepContext(groups, use_fused_linear_logprobs=True)
    with pytest.raises(ValueError, match="needs the `MCoreRLModule\\(loss_fn=...\\)` path"):
        run_global_batch([torch.nn.Linear(2, 2)], {}, context, forward_step_func=lambda *a: None)


def _batch_first_rank(rank: int, tied: bool) -> dict[str, Any]:
    """Megatron's LM head vs ``lm_head_batch_first`` on one tiny ``GPTModel`` at TP=2: logits
    and every gradient, and whether ``GPTModel``'s final ``.contiguous()`` copied."""
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config
    from lightning_mcore_rl.train import causal_attention_mask
    from lightning_mcore_rl.train.fused import batch_first_applies, lm_head_batch_first

    init_megatron_state(tensor_model_parallel_size=2)
    groups = megatron_groups()
    model = tiny_gpt(
        tiny_gpt_config(groups),
        groups=groups,
        vocab_size=VOCAB,
        share_embeddings_and_output_weights=tied,
    )
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.arange(S)[None, :].expand(B, -1), causal_attention_mask(S))
    head_out: list[torch.Tensor] = []
    model.output_layer.register_forward_hook(lambda m, i, out: head_out.append(out[0]))
    weights = torch.linspace(-1, 1, B * S * VOCAB // 2).reshape(B, S, VOCAB // 2)
    results = {}
    for name in ("megatron", "batch_first"):
        model.zero_grad()
        scope = lm_head_batch_first(model) if name == "batch_first" else _nothing()
        with scope:
            logits = model(*args)  # [B, S, V/TP]
        (logits * weights).sum().backward()
        results[name] = {
            "logits": logits.detach(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
            "no_copy": logits.data_ptr() == head_out[-1].data_ptr(),
        }
    ours, theirs = results["batch_first"], results["megatron"]
    return {
        "logits_equal": torch.equal(ours["logits"], theirs["logits"]),
        "grad_max_diff": max(
            float((ours["grads"][k] - g).abs().max()) for k, g in theirs["grads"].items()
        ),
        "grad_max": max(float(g.abs().max()) for g in theirs["grads"].values()),
        "no_copy": (ours["no_copy"], theirs["no_copy"]),
        "applies": batch_first_applies(model),
        "restored": "forward" not in vars(model.output_layer),
        "applies_to_scalar_head": batch_first_applies(_with_scalar_head(groups)),
        "applies_under_sp": batch_first_applies(
            tiny_gpt(
                tiny_gpt_config(groups, sequence_parallel=True), groups=groups, vocab_size=VOCAB
            )
        ),
    }


def _with_scalar_head(groups: Any) -> torch.nn.Module:
    """A tiny ``GPTModel`` whose output layer is the reward model's ``[H] -> 1`` head."""
    from lightning_mcore_rl.recipes.reward_model import ScalarHead
    from lightning_mcore_rl.testing import tiny_gpt, tiny_gpt_config

    model = tiny_gpt(tiny_gpt_config(groups), groups=groups, vocab_size=VOCAB)
    model.output_layer = ScalarHead(64, torch.float32)
    return model


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_batch_first_lm_head_is_bitwise_megatron_without_the_logits_copy(tied: bool) -> None:
    """At TP=2: the same logits bit for bit, the gradients within fp32 rounding (the output
    weight's gradient sums the tokens in another order: measured 1.9e-6, one fp32 ulp at the
    largest entries, 15-18; bound 1e-6 of the largest), and the logits ``GPTModel`` returns ARE the head's output (no ``[B, S, V/TP]`` copy),
    where megatron's own head copies them; not applied under sequence parallelism or to a head
    that is not megatron's ``ColumnParallelLinear``."""
    for out in run_on_ranks(_batch_first_rank, 2, tied, timeout=120):
        assert out["logits_equal"]
        assert out["grad_max_diff"] <= 1e-6 * out["grad_max"]
        assert out["no_copy"] == (True, False)
        assert out["applies"] and out["restored"]
        assert not out["applies_under_sp"] and not out["applies_to_scalar_head"]


def test_gradient_in_forward_applies_to_declared_token_local_losses_only() -> None:
    from lightning_mcore_rl.losses import NLLLossFn
    from lightning_mcore_rl.train.fused import gradient_in_forward_applies

    gspo = ClippedPGLossFn({"sequence_level_importance_ratios": True, "token_level_loss": False})
    assert gradient_in_forward_applies(NLLLossFn(), cp_size=1)
    assert gradient_in_forward_applies(ClippedPGLossFn(), cp_size=1)
    assert not gradient_in_forward_applies(ClippedPGLossFn(), cp_size=2)  # CP gathers logprobs
    assert not gradient_in_forward_applies(ClippedPGLossFn({"entropy_coef": 0.01}), cp_size=1)
    assert not gradient_in_forward_applies(gspo, cp_size=1)  # a sequence-level ratio
    assert not gradient_in_forward_applies(MseValueLossFn(), cp_size=1)  # not declared
