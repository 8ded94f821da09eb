"""The tiny MoE GPT (megatron's MoE layer, ``SequentialMLP`` experts, local spec) trains the same
under expert, expert-tensor and tensor parallelism as on one rank: the grad norm, every gradient
and every updated weight (experts gathered by global index) against the single-rank run.

fp32 on CPU: the layouts only reorder sums (token dispatch, DP/TP reductions), measured at
<= 2e-8 on the gradients; 1e-6 leaves room for other kernels while a wrong expert index, shard
or missing reduction is >= 5e-3 off (TP=2, ETP=1 at EP=1 measured 5.6e-3, which is why the
strategy refuses that layout).
"""

from __future__ import annotations

import pytest
from _moe_ranks import moe_train_step

from lightning_mcore_rl.testing import run_on_ranks


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(moe_train_step, 1, 1, 1, None, "alltoall")[0]


@pytest.mark.parametrize(
    ("tp", "ep", "etp", "dispatcher"),
    [
        (1, 2, None, "alltoall"),
        (1, 2, None, "allgather"),
        (2, 2, 1, "alltoall"),
        (2, 1, None, "alltoall"),
    ],
    ids=["ep2-alltoall", "ep2-allgather", "tp2-ep2-etp1", "tp2-etp2"],
)
def test_moe_layout_matches_one_rank(reference, tp, ep, etp, dispatcher):
    grad_norm, grads, params = run_on_ranks(moe_train_step, 2, tp, ep, etp, dispatcher)[0]
    ref_norm, ref_grads, ref_params = reference
    assert sorted(grads) == sorted(ref_grads)
    assert sum("local_experts" in name for name in grads) == 2 * 4 * 2  # layers x experts x fc
    assert grad_norm == pytest.approx(ref_norm, abs=1e-6)
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).abs().max().item() <= 1e-6, name
        assert (params[name] - ref_params[name]).abs().max().item() <= 1e-6, name
