"""The seed API as NeMo RL calls it: on 2 megatron ranks (TP=2) every seed function and
post-processor called with only the seed's parameters (no ``groups``) gives bitwise the numbers
of the core path, which passes the strategy's explicit ``groups`` (the same computation, so
``torch.equal``); the core path itself is checked against plain torch in
test_train_step_invariance.py."""

from __future__ import annotations

import torch
from _seed_api_ranks import seed_api_run

from lightning_mcore_rl.testing import run_on_ranks


def _assert_equal(seed: object, core: object, where: str) -> None:
    if isinstance(seed, torch.Tensor):
        assert isinstance(core, torch.Tensor) and torch.equal(seed, core), where
    elif isinstance(seed, dict):
        assert isinstance(core, dict) and seed.keys() == core.keys(), where
        for key in seed:
            _assert_equal(seed[key], core[key], f"{where}.{key}")
    elif isinstance(seed, (list, tuple)):
        assert isinstance(core, (list, tuple)) and len(seed) == len(core), where
        for i, (a, b) in enumerate(zip(seed, core, strict=True)):
            _assert_equal(a, b, f"{where}[{i}]")
    else:
        assert seed == core, where


def test_seed_functions_without_groups_match_the_core_path_at_tp2() -> None:
    for rank, out in enumerate(run_on_ranks(seed_api_run, 2, timeout=150)):
        for name in ("train", "logprobs", "topk", "payload", "direct"):
            _assert_equal(out[f"seed_{name}"], out[f"core_{name}"], f"rank {rank} {name}")
        # the passes produced something to compare: a finite loss, non-zero grads, logprobs
        assert torch.isfinite(out["seed_train"]["loss"]).all()
        assert any(g.abs().sum() > 0 for g in out["seed_train"]["grads"])
        logprobs = out["seed_logprobs"][0]["logprobs"]
        assert logprobs.shape[0] == 2 and (logprobs[:, 1:] < 0).any()
        assert out["seed_payload"][0]["teacher_full_payload"].shape[-1] == 128  # V, TP gathered
        assert out["seed_direct"]["padding_mask"][:, -2:].all()
