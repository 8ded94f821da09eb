"""A stalled rank is bounded by the strategy's timeout, also when the world process group was
created before the Trainer with another (here: the whole run's 120 s) timeout: the strategy's
own collectives run on the group it created with its timeout."""

from __future__ import annotations

from _stall_runs import STALL_S, STRATEGY_TIMEOUT_S, stall_rank

from lightning_mcore_rl.testing import run_on_ranks

MARGIN_S = 6.0  # the gloo timeout fires late on 2 loaded cores by well under this


def test_a_stalled_peer_raises_within_the_strategy_timeout() -> None:
    waiting, stalled = run_on_ranks(stall_rank, 2, timeout=120)
    print(f"rank 0: {waiting.seconds:.1f} s to {waiting.error[:120]!r}")
    print(f"rank 1 (slept {STALL_S} s): {stalled.seconds:.1f} s to {stalled.error[:120]!r}")
    assert waiting.error, "rank 0 finished its step although rank 1 was stalled"
    assert "timed out" in waiting.error.lower() or "timeout" in waiting.error.lower()
    # bounded by the strategy's 5 s, not the pre-created world group's 120 s nor the stall
    assert STRATEGY_TIMEOUT_S <= waiting.seconds <= STRATEGY_TIMEOUT_S + MARGIN_S
    assert stalled.error  # its peer is gone: it stops too instead of hanging
