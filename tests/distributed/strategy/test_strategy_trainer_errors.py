"""Misconfigurations raise clear errors from a real ``Trainer.fit`` (one gloo rank)."""

from __future__ import annotations

import re

from _strategy_runs import trainer_errors_rank

from lightning_mcore_rl.testing import run_on_ranks

EXPECTED = {
    "accumulate": r"ValueError: `Trainer\(accumulate_grad_batches=2\)` is not supported",
    "clip_value": r"ValueError: `Trainer\(gradient_clip_algorithm='value'\)` is not supported",
    "sizes": r"ValueError: The sizes tp=2, pp=1, cp=1 multiplied \(2\) should divide the world size 1",
    "plain_module": r"TypeError: MCoreRLStrategy needs a LightningModule with megatron model chunks",
    "config": r"ValueError: Model chunk 0: `TransformerConfig.bf16=False` but the strategy",
}


def test_trainer_misconfigurations_raise_with_the_fix_in_the_message():
    (errors,) = run_on_ranks(trainer_errors_rank, 1, timeout=120)
    for name, pattern in EXPECTED.items():
        assert re.search(pattern, errors[name]), f"{name}: {errors[name]!r}"
