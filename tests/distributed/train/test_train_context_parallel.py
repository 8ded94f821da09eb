"""Context parallelism (CP=2, real gloo groups, synthetic logits) and DP statistics.

``LossPostProcessor`` returns ``R = L * M / CP^2``; Megatron back-propagates ``R * CP / M``, and
the CP all-gather's backward sums the ranks' gradients, so every rank's local-logit gradient must
equal its shard of the single-process ``dL/dz`` (dense zigzag layout and packed per-span layout,
per-sequence and fused loss wrappers). Without ``cp_normalize`` the gradient is CP times too big,
which is exactly why the extra ``/CP`` exists.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _train_cp_ranks import CP, LENGTHS, M, S, cp_run, make_data

from lightning_mcore_rl.testing import run_on_ranks
from lightning_mcore_rl.train import CP_NEEDS_PACKING

ATOL = 1e-6


@functools.cache
def _results() -> list[dict]:
    return run_on_ranks(cp_run, 2, timeout=120)


def _valid() -> torch.Tensor:
    return torch.arange(S)[None, :] < torch.tensor(LENGTHS)[:, None]  # [B, S]


@pytest.mark.parametrize(
    "layout", ["dense_cp_normalize=True", "packed_fuse=False", "packed_fuse=True"]
)
def test_loss_scaling_and_local_gradients_match_single_process(layout: str) -> None:
    for out in _results():
        loss = float(out["ref"]["loss"])
        result = out[layout]
        assert float(result.result) == pytest.approx(loss * M / CP**2, abs=ATOL)
        assert float(result.loss_metric) == pytest.approx(loss, abs=ATOL)  # metrics unscaled
        expected = out["expected_packed_grad" if "packed" in layout else "expected_dense_grad"]
        assert float((result.grad - expected).abs().max()) <= ATOL


def test_without_cp_normalize_the_gradient_is_cp_times_too_large() -> None:
    for out in _results():
        result = out["dense_cp_normalize=False"]
        assert float(result.result) == pytest.approx(float(out["ref"]["loss"]) * M / CP, abs=ATOL)
        expected = CP * out["expected_dense_grad"]
        assert float((result.grad - expected).abs().max()) <= ATOL


def test_packed_cp_post_processors_match_full_logits() -> None:
    z, _ = make_data()
    valid = _valid()
    top = z.topk(3, dim=-1)
    for out in _results():
        logprobs = out["logprobs_packed"]["logprobs"]
        assert float(((logprobs - out["ref"]["logprobs"]).abs() * valid).max()) <= ATOL
        assert torch.equal(out["topk_packed"]["topk_logits"] * valid[..., None],
                           top.values * valid[..., None])  # fmt: skip
        assert torch.equal(out["topk_packed"]["topk_indices"] * valid[..., None],
                           top.indices * valid[..., None])  # fmt: skip
        payload = out["payload_packed"]["teacher_full_payload"]
        assert payload.dtype == torch.float64 and payload.device.type == "cpu"
        assert torch.equal(payload * valid[..., None], z.double() * valid[..., None])
        assert float(((out["payload_packed"]["logprobs"] - out["ref"]["logprobs"]).abs()
                      * valid).max()) <= ATOL  # fmt: skip


def test_cp_without_packing_raises_in_every_forward_only_post_processor() -> None:
    for out in _results():
        assert out["errors"] == [CP_NEEDS_PACKING] * 3


def test_aggregate_training_statistics_one_dp_all_reduce() -> None:
    results = _results()
    for rank, out in enumerate(results):
        stats = out["stats"]
        assert stats["ops"] == ["RedOpType.SUM"] and stats["group_is_world"] == [True]
        assert stats["mb_metrics"] == {"loss": [0.5 + rank, 0.25], "lr": [1e-4], "x": [1]}
        assert all(isinstance(v, float) for v in stats["mb_metrics"]["loss"])
        # losses [0.5 + rank, 0.25] summed over the 2 DP ranks: [0.5 + 1.5, 0.5]
        assert torch.allclose(stats["global_loss"], torch.tensor([2.0, 0.5]))
