"""Rank workers of the deferred-fp32-logits tests: one tiny GPT step, fp32 logits vs deferred.

The model is a bf16 tiny GPT in megatron's ``Float16Module`` inside megatron DDP (fp32
``main_grad``), as the strategy wraps it under ``bf16-mixed``; the ``fp32`` runs leave it in
fp32 without ``Float16Module``, as under ``32-true``. Each case runs the same batch through
:func:`~lightning_mcore_rl.train.run_global_batch` (or ``run_forward_only``) twice on the same
weights: with ``defer_fp32_logits=False`` (``Float16Module`` upcasts the whole output) and
with the case's setting, and reports the loss, the outputs and every parameter's ``main_grad``
of both, on this rank (TP shards compared shard by shard).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossFn, DistillationLossFn
from lightning_mcore_rl.models.layers import get_packed_local_layer_spec
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.train import (
    LogprobsPostProcessor,
    LossPostProcessor,
    Microbatching,
    PolicyConfig,
    StepContext,
    TeacherFullPayloadPostProcessor,
    TopkLogitsPostProcessor,
    run_forward_only,
    run_global_batch,
)

V, S, B, K = 128, 16, 4, 5
LENGTHS = [16, 11, 7, 13]
CHUNK = 4  # logprob_chunk_size: 4 chunks per row
LOGIT_SCALE = 40.0  # output weight x 40: logits of magnitude ~5, where bf16 rounding shows
PG = {"reference_policy_kl_penalty": 0.01, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2}


def make_batch() -> BatchedDataDict:
    """``B=4`` right-padded rows of lengths ``LENGTHS`` with GRPO and top-k distillation fields."""
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(S)[None, :]
    real = positions < torch.tensor(LENGTHS)[:, None]
    ids = torch.randint(1, V, (B, S), generator=g) * real
    near = -torch.log(torch.tensor(float(V)))
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor(LENGTHS),
        token_mask=(real & (positions >= 3)).float(),
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, S, generator=g),
        prev_logprobs=near + 0.15 * torch.randn(B, S, generator=g),
        generation_logprobs=near + 0.15 * torch.randn(B, S, generator=g),
        reference_policy_logprobs=near + 0.15 * torch.randn(B, S, generator=g),
        teacher_topk_logits=3 * torch.randn(B, S, K, generator=g),
        teacher_topk_indices=torch.stack(
            [torch.randperm(V, generator=g)[:K] for _ in range(B * S)]
        ).view(B, S, K),
    )


def _model(bf16: bool) -> Any:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    groups = megatron_groups()
    config = tiny_gpt_config(groups, calculate_per_token_loss=True, bf16=bf16)
    model = tiny_gpt(
        config, groups=groups, vocab_size=V, transformer_layer_spec=get_packed_local_layer_spec()
    )
    with torch.no_grad():
        model.output_layer.weight.mul_(LOGIT_SCALE)
    inner = Float16Module(config, model) if bf16 else model
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), inner
    )
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def _loss_case(name: str) -> tuple[Any, TrainingSamplingParams | None, bool]:
    """``(loss_fn, sampling_params, sequence_packing)`` of a training case."""
    if name == "pg_entropy":
        return ClippedPGLossFn({**PG, "entropy_coef": 0.1}), None, False
    if name.startswith("distillation"):  # H_all (a second kernel) only with the tail term
        cfg = {"kl_type": "mixed", "zero_outside_topk": name == "distillation_tail"}
        return DistillationLossFn(cfg), None, False
    if name.endswith("temperature"):
        return ClippedPGLossFn(PG), TrainingSamplingParams(temperature=0.7), False
    return ClippedPGLossFn(PG), None, name == "pg_packed"


def _run(model: Any, case: str, defer: bool | None, dtypes: list[torch.dtype]) -> dict[str, Any]:
    """One pass of ``case`` with ``defer_fp32_logits=defer``."""
    loss_fn, sampling, packed = _loss_case(case)
    policy = PolicyConfig(sequence_packing=packed, logprob_chunk_size=CHUNK)
    context = StepContext(
        megatron_groups(), Microbatching(micro_batch_size=2, sequence_packing=packed), policy,
        sampling_params=sampling, defer_fp32_logits=defer,
    )  # fmt: skip
    batch = make_batch()
    dtypes.clear()
    if case.startswith(("logprobs", "topk", "payload")):
        post: Any = LogprobsPostProcessor(policy, sampling_params=sampling)
        if case == "topk":
            post = TopkLogitsPostProcessor(policy, K)
        elif case == "payload":  # the TP-gathered logits, returned in fp32
            post = TeacherFullPayloadPostProcessor(policy, "logits", torch.float32)
        outputs = run_forward_only([model], batch, context, post)
        return {"outputs": outputs, "logits_dtype": list(dtypes)}
    model.zero_grad_buffer()
    post = LossPostProcessor(loss_fn, policy, sampling_params=sampling)
    out = run_global_batch(
        [model], batch, context, loss=post, normalizations=loss_fn.metric_normalizations
    )
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": float(out.loss), "grads": grads, "logits_dtype": list(dtypes)}


def compare_rank(
    rank: int, tp: int, bf16: bool, cases: list[tuple[str, bool | None]]
) -> dict[str, Any]:
    """For each ``(case, setting)``: the fp32-logit run vs the run with ``setting``.

    Returns per case the losses, the largest gradient difference (absolute, and relative to the
    largest gradient entry of that parameter), whether every gradient is bitwise equal, and for
    the forward-only cases the largest output difference.
    """
    init_megatron_state(tensor_model_parallel_size=tp)
    model = _model(bf16)
    dtypes: list[torch.dtype] = []
    model.module.register_forward_hook(  # the last stage's output, as the post-processor sees it
        lambda m, i, out: dtypes.append(out.dtype) if out.dim() == 3 else None
    )
    scale: list[float] = []  # largest |logit| of the batch (bounds the temperature error)
    model.module.register_forward_hook(lambda m, i, out: scale.append(float(out.abs().max())))
    report: dict[str, Any] = {}
    for case, setting in cases:
        ref = _run(model, case, False, dtypes)
        got = _run(model, case, setting, dtypes)
        report[f"{case}:{setting}"] = {**_difference(ref, got), "logits_absmax": max(scale)}
    return report


def _difference(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"dtypes": (ref["logits_dtype"], got["logits_dtype"])}
    if "outputs" in ref:
        diffs = [
            float((ref["outputs"][k].double() - got["outputs"][k].double()).abs().max())
            for k in ref["outputs"]
        ]
        out["output_max_abs"] = max(diffs)
        out["outputs_bitwise"] = all(
            torch.equal(ref["outputs"][k], got["outputs"][k]) for k in ref["outputs"]
        )
        return out
    abs_diff, rel_diff, norm_diff, bitwise = 0.0, 0.0, 0.0, True
    for name, g in ref["grads"].items():
        d = float((g - got["grads"][name]).abs().max())
        abs_diff = max(abs_diff, d)
        rel_diff = max(rel_diff, d / max(float(g.abs().max()), 1e-30))
        n = float((g - got["grads"][name]).norm() / max(float(g.norm()), 1e-30))
        norm_diff = max(norm_diff, n)
        bitwise &= torch.equal(g, got["grads"][name])
    out.update(
        loss=(ref["loss"], got["loss"]),
        grad_max_abs=abs_diff,
        grad_max_rel=rel_diff,
        grad_norm_rel=norm_diff,
        grads_bitwise=bitwise,
    )
    return out
