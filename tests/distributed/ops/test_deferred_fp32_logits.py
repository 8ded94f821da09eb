"""Deferred fp32 logits through the step: a bf16 tiny GPT in ``Float16Module`` + megatron DDP,
the same batch and weights with fp32 logits and deferred (``_deferred_logits_ranks.py``).

* ``defer_fp32_logits=None`` defers exactly where the result is the fp32-logit path's: there
  the losses, every parameter gradient (``main_grad``), the logprobs, the top-k and the
  teacher's logits payload are bitwise equal, at TP=1 and TP=2 (vocab-parallel kernels),
  padded and packed; where it is not exact (entropy bonus, distillation's ``H_all``,
  temperature != 1) it keeps fp32 logits.
* ``defer_fp32_logits=True`` there: the losses stay bitwise equal (the forward upcasts the same
  bf16 values), the gradients within the stated bf16 tolerance: two logits consumers round
  their gradients to bf16 before summing (measured <= 9.0e-3 of each parameter's gradient
  norm); a temperature of 0.7 is divided in bf16 (logprobs 6.7e-2 apart at ``max|z/T|`` =
  35, within the bound ``max|z/T| / 256`` = 0.14; gradients 3.2e-2 of the norm).
* Under fp32 (``32-true``: no ``Float16Module``) ``True`` changes nothing, bitwise.
"""

from __future__ import annotations

from typing import Any

import torch
from _deferred_logits_ranks import compare_rank

from lightning_mcore_rl.testing import run_on_ranks

BF16, FP32 = torch.bfloat16, torch.float32
EXACT_CASES: list[tuple[str, bool | None]] = [
    ("pg", None),
    ("pg_packed", None),
    ("distillation", None),  # top-k logprobs only (no H_all): one kernel
    ("logprobs", None),
    ("topk", None),
    ("payload", None),  # teacher_full_payload of the logits
    ("pg_entropy", None),  # not exact: stays fp32
    ("pg_temperature", None),
]


def _check_exact(report: dict[str, Any]) -> None:
    for key, r in report.items():
        deferred = not key.startswith(("pg_entropy", "pg_temperature"))
        assert r["dtypes"][0] == [FP32, FP32], key  # the reference: Float16Module's upcast
        assert r["dtypes"][1] == [BF16 if deferred else FP32] * 2, key
        if "outputs_bitwise" in r:
            assert r["outputs_bitwise"], key
        else:
            assert r["loss"][0] == r["loss"][1], key
            assert r["grads_bitwise"], (key, r["grad_max_abs"])


def test_auto_deferral_is_bitwise_at_tp1() -> None:
    (report,) = run_on_ranks(compare_rank, 1, 1, True, EXACT_CASES, timeout=240)
    _check_exact(report)


def test_auto_deferral_is_bitwise_at_tp2() -> None:
    reports = run_on_ranks(compare_rank, 2, 2, True, EXACT_CASES[:6], timeout=240)
    for report in reports:
        _check_exact(report)


def test_forced_deferral_stays_within_the_bf16_tolerance() -> None:
    cases: list[tuple[str, bool | None]] = [
        ("pg_entropy", True),
        ("distillation_tail", True),
        ("pg_temperature", True),
        ("logprobs_temperature", True),
    ]
    (report,) = run_on_ranks(compare_rank, 1, 1, True, cases, timeout=240)
    for key in ("pg_entropy:True", "distillation_tail:True"):
        r = report[key]
        assert r["dtypes"][1] == [BF16, BF16]
        assert r["loss"][0] == r["loss"][1], key  # same forward values
        assert 0 < r["grad_norm_rel"] <= 1.2e-2, (key, r["grad_norm_rel"])  # measured 8.8e-3
    r = report["pg_temperature:True"]
    assert abs(r["loss"][0] - r["loss"][1]) <= 1e-4 * abs(r["loss"][0])  # measured 2.1e-5
    assert r["grad_norm_rel"] <= 5e-2  # measured 3.2e-2
    r = report["logprobs_temperature:True"]
    # |d log p| <= |d z_y| + max_v |d z_v| <= 2 * 2^-9 * max|z/T| (bf16 rounds to nearest)
    assert 0 < r["output_max_abs"] <= r["logits_absmax"] / 0.7 / 256  # 6.7e-2 <= 0.14


def test_deferral_is_a_no_op_under_fp32() -> None:
    cases: list[tuple[str, bool | None]] = [
        ("pg", True),
        ("pg_entropy", True),
        ("pg_temperature", True),
        ("distillation_tail", True),
        ("logprobs", True),
        ("topk", True),
    ]
    reports = run_on_ranks(compare_rank, 2, 2, False, cases, timeout=240)
    for report in reports:
        for key, r in report.items():
            assert r["dtypes"] == ([FP32, FP32], [FP32, FP32]), key
            if "outputs_bitwise" in r:
                assert r["outputs_bitwise"], key
            else:
                assert r["loss"][0] == r["loss"][1], key
                assert r["grads_bitwise"], key
