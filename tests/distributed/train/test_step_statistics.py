"""``reduce_step_statistics`` at DP=2: every rule against a hand-derived value, identical on both
ranks, in exactly ONE DP collective (the rule vector's all-gather, the per-microbatch losses
riding in it), and an undeclared metric on one rank raising on both; at PP=2 (DP=1): the last
stage's result on both stages in one broadcast (two for a payload over the buffer), no other
collective."""

from __future__ import annotations

import functools

import pytest
from _step_statistics_ranks import MANY, Recorded, pipeline_run, statistics_run

from lightning_mcore_rl.testing import run_on_ranks


@functools.cache
def _results() -> list[dict[str, Recorded]]:
    return run_on_ranks(statistics_run, 2, timeout=120)


@functools.cache
def _pipeline() -> list[dict[str, Recorded]]:
    return run_on_ranks(pipeline_run, 2, timeout=120)


def test_every_rule_reduces_to_the_hand_value_on_both_ranks() -> None:
    for result in _results():
        out = result["clean"].output
        assert out is not None
        # loss: sum over microbatches and ranks of [0.25 + r, 0.5] = 0.75 + 1.75
        assert float(out.loss) == 2.5
        assert out.microbatch_losses in ((0.25, 0.5), (1.25, 0.5))
        metrics = {k: float(v) for k, v in out.metrics.items()}
        # kl: 0.125 + 0.0625 (rank 0) + 0.25 + 0.0625 (rank 1); counts summed; min/max over all
        assert metrics == {"kl": 0.5, "num_valid_samples": 6.0, "ratio_min": 0.5,
                           "ratio_max": 2.25}  # fmt: skip
        assert (out.samples, out.tokens) == (6.0, 21.0)
        assert out.response_length_mean == 9.0 / 6.0
        assert out.response_length_max == 5.0


def test_one_dp_collective_the_losses_riding_in_the_gather() -> None:
    for result in _results():
        assert result["clean"].calls == [("all_gather", False, True)]


@pytest.mark.parametrize("rank", [0, 1])
def test_an_undeclared_metric_on_one_rank_raises_on_both(rank: int) -> None:
    recorded = _results()[rank]["undeclared"]
    assert recorded.output is None and recorded.error is not None
    if rank == 1:
        assert "['surprise']" in recorded.error and "metric_normalizations" in recorded.error
    else:
        assert "another data-parallel rank" in recorded.error
    assert recorded.calls == [("all_gather", False, True)]


def test_pipeline_stages_get_the_last_stage_result_in_one_broadcast() -> None:
    first, last = (result["small"] for result in _pipeline())
    assert first.output == last.output and last.output is not None
    # rank 0's microbatches only (DP=1): loss 0.25 + 0.5, kl 0.125 + 0.0625
    assert float(last.output.loss) == 0.75
    assert {k: float(v) for k, v in last.output.metrics.items()} == {
        "kl": 0.1875, "num_valid_samples": 3.0, "ratio_min": 0.5, "ratio_max": 1.5,
    }  # fmt: skip
    assert last.output.tokens == 11.0  # counts(1): the last stage (rank 1) holds them
    assert first.calls == [("broadcast", False, True)]
    assert last.calls == [("broadcast", False, True)]


def test_a_payload_over_the_buffer_takes_a_second_broadcast() -> None:
    first, last = (result["large"] for result in _pipeline())
    assert first.output == last.output and last.output is not None
    assert {k: float(v) for k, v in last.output.metrics.items()} == {
        f"metric_{i:04d}": float(i) for i in range(MANY)
    }
    assert first.calls == [("broadcast", False, True)] * 2
