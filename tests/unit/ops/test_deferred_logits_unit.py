"""Deferred fp32 logits on one process: where ``defer_fp32_logits=None`` turns it on, the config
field's check, and the bf16 gradients of the kernels against the fp32-logit path's.

The fp32-logit path is what megatron's ``Float16Module`` gives the post-processors: the bf16
logits upcast (``logits.float()``), whose backward rounds the fp32 gradient to bf16 once. The
deferred path hands the kernels the bf16 logits themselves; each test runs both and compares
bitwise. The step-level comparison (tiny GPT, TP=1 and TP=2) is
``tests/distributed/ops/test_deferred_fp32_logits.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_mcore_rl.losses import (
    ClippedPGLossFn,
    DistillationLossFn,
    MseValueLossFn,
    NLLLossFn,
    OPDFullLossFn,
)
from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    distributed_logprob,
    distributed_logprob_with_sampling,
    distributed_logprobs_at_indices,
    gather_logits_at_global_indices,
    vocab_parallel_entropy,
    vocab_parallel_reverse_kl,
)
from lightning_mcore_rl.ops import topk as topk_module
from lightning_mcore_rl.strategy.config import LogprobKernelConfig
from lightning_mcore_rl.train import (
    LogprobsPostProcessor,
    LossPostProcessor,
    PolicyConfig,
    TeacherFullPayloadPostProcessor,
    TopkLogitsPostProcessor,
)
from lightning_mcore_rl.train.logits_dtype import defers_fp32_logits


class SoloGroup:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


G = SoloGroup()
CHUNKED = PolicyConfig(logprob_chunk_size=4)
PG = {"reference_policy_kl_penalty": 0.0}
T07 = TrainingSamplingParams(temperature=0.7)
TOPK = TrainingSamplingParams(top_k=8)


def _loss(loss_fn: Any, cfg: PolicyConfig = CHUNKED, **kwargs: Any) -> LossPostProcessor:
    return LossPostProcessor(loss_fn, cfg, 1, **kwargs)


# ---------------------------------------------------------------- where None turns it on

EXACT = {
    "pg": (_loss(ClippedPGLossFn(PG)), None),
    "nll": (_loss(NLLLossFn()), TrainingSamplingParams(temperature=1.0)),
    "distillation_topk_only": (_loss(DistillationLossFn({"zero_outside_topk": False})), None),
    "distillation_forward_kl": (
        _loss(DistillationLossFn({"zero_outside_topk": True, "kl_type": "forward"})),
        None,
    ),
    "logprobs": (LogprobsPostProcessor(CHUNKED), None),
    "topk": (TopkLogitsPostProcessor(CHUNKED, 3), None),
    "teacher_payload": (TeacherFullPayloadPostProcessor(CHUNKED, "logits", torch.float32), None),
}
NOT_EXACT = {
    "unchunked": (_loss(ClippedPGLossFn(PG), PolicyConfig()), None),  # loss input .float()s
    "temperature": (_loss(ClippedPGLossFn(PG), sampling_params=T07), T07),
    "top_k": (_loss(ClippedPGLossFn(PG), sampling_params=TOPK), TOPK),
    "post_own_top_k": (LogprobsPostProcessor(CHUNKED, sampling_params=TOPK), None),
    "payload_top_k": (
        TeacherFullPayloadPostProcessor(CHUNKED, "logits", torch.bfloat16, TOPK),
        None,
    ),
    "entropy_bonus": (_loss(ClippedPGLossFn({**PG, "entropy_coef": 0.01})), None),
    "distillation_tail": (_loss(DistillationLossFn({"zero_outside_topk": True})), None),
    "value_head": (_loss(MseValueLossFn()), None),  # the MSE would run in bf16
    "opd_full": (_loss(OPDFullLossFn()), None),  # the teacher is cast to the student dtype
    "custom_prepare_fn": (_loss(NLLLossFn(), prepare_fn=lambda *a, **k: None), None),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_none_defers_where_the_result_is_the_fp32_logit_paths(case: str) -> None:
    post, sampling = EXACT[case]
    assert defers_fp32_logits(None, post, sampling) is True


@pytest.mark.parametrize("case", list(NOT_EXACT))
def test_none_keeps_fp32_logits_where_deferring_is_not_exact_or_saves_nothing(case: str) -> None:
    post, sampling = NOT_EXACT[case]
    assert defers_fp32_logits(None, post, sampling) is False


@pytest.mark.parametrize("setting", [True, False])
def test_an_explicit_setting_is_kept(setting: bool) -> None:
    for post, sampling in (*EXACT.values(), *NOT_EXACT.values()):
        assert defers_fp32_logits(setting, post, sampling) is setting


def test_config_field_rejects_a_non_bool() -> None:
    assert LogprobKernelConfig().defer_fp32_logits is None
    with pytest.raises(
        TypeError, match=r"`LogprobKernelConfig.defer_fp32_logits` must be a bool or None.*got str"
    ):
        LogprobKernelConfig(defer_fp32_logits="auto")  # type: ignore[arg-type]


# ---------------------------------------------------------------- kernels: bf16 = fp32 path

B, S, V, K = 2, 9, 48, 6


def _bf16_logits(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (5 * torch.randn(B, S, V, generator=gen)).to(torch.bfloat16)


def _ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def _both_paths(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn`` on fp32-upcast logits (gradient rounded by the cast's backward) and on the bf16
    logits themselves: ``(out_fp32_path, grad_fp32_path, out_deferred, grad_deferred)``."""
    base = _bf16_logits()
    weights = torch.randn(fn(base.float()).shape, generator=torch.Generator().manual_seed(2))
    results = []
    for deferred in (False, True):
        leaf = base.clone().requires_grad_(True)
        out = fn(leaf if deferred else leaf.float())
        (out * weights).sum().backward()
        assert leaf.grad is not None and leaf.grad.dtype == torch.bfloat16
        results += [out.detach(), leaf.grad]
    return results[0], results[1], results[2], results[3]


KERNELS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "logprob_chunked": lambda z: distributed_logprob(z, _ids(B, S), 0, V, G, chunk_size=4),
    "logprob_unchunked": lambda z: distributed_logprob(z, _ids(B, S), 0, V, G),
    "logprobs_at_indices": lambda z: distributed_logprobs_at_indices(
        z, _ids(B, S, K), 0, V, G, chunk_size=4
    ),
    "gather_at_indices": lambda z: gather_logits_at_global_indices(
        z,
        _ids(B, S, K) % 5,
        0,
        V,
        G,  # ids in [0, 5): duplicates accumulate
    ),
    "entropy": lambda z: vocab_parallel_entropy(z, G, chunk_size=4),
    "top_k_sampling": lambda z: distributed_logprob_with_sampling(
        z, _ids(B, S), 0, V, G, TrainingSamplingParams(top_k=10, top_p=0.9), chunk_size=3
    ),
    "reverse_kl": lambda z: (
        vocab_parallel_reverse_kl(z, _bf16_logits(seed=3).to(z.dtype), G, chunk_size=4).reverse_kl
    ),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernels_on_bf16_logits_equal_the_fp32_logit_path_bitwise(kernel: str) -> None:
    out_ref, grad_ref, out, grad = _both_paths(KERNELS[kernel])
    assert out.dtype == out_ref.dtype == torch.float32
    assert torch.equal(out, out_ref)
    assert torch.equal(grad, grad_ref)


def test_gather_backward_scatters_in_bounded_fp32_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # one block is 3 rows of V fp32 values: the 18 rows run in 6 blocks
    monkeypatch.setattr(topk_module, "_BLOCK_BYTES", 3 * V * 4)
    _, grad_ref, _, grad = _both_paths(KERNELS["gather_at_indices"])
    assert torch.equal(grad, grad_ref)
