"""Argument checks of the rollout layer that need no process group: ``SamplingConfig``, a
recipe's backend choice by name (also through ``GRPOModule``) and the embedded source's
``update_weights`` no-op."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.recipes import GRPOModule, HFModelSpec, RolloutSpec
from lightning_mcore_rl.recipes.common import RecipeModel, TinyGPTSpec
from lightning_mcore_rl.recipes.rollout_choice import recipe_rollout
from lightning_mcore_rl.rollout import MegatronRolloutSource, RolloutSource, SamplingConfig


def test_sampling_config_checks_its_fields():
    with pytest.raises(ValueError, match="`max_new_tokens` must be >= 1, got 0"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="`temperature` must be > 0, got -1.0"):
        SamplingConfig(max_new_tokens=1, temperature=-1.0)


def test_recipe_backend_choice():
    tiny = RecipeModel(TinyGPTSpec(), vocab_size=16, max_sequence_length=16)
    with pytest.raises(
        ValueError, match=r"`backend` must be one of \['hf', 'megatron', 'vllm'\], a Rol"
    ):
        recipe_rollout("sglang", tiny)  # type: ignore[arg-type]
    for backend in ("hf", "vllm"):  # both load and refit their own copy from the HF checkpoint
        with pytest.raises(ValueError, match="needs an HFModelSpec model, got TinyGPTSpec"):
            recipe_rollout(backend, tiny)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="needs an HFModelSpec model, got TinyGPTSpec"):
            GRPOModule(rollout=RolloutSpec(backend=backend))  # type: ignore[arg-type]
    hf = RecipeModel(HFModelSpec(path="unread"), vocab_size=16, max_sequence_length=16)
    assert recipe_rollout("hf", hf).source is None  # built on first use, nothing read yet


def test_embedded_source_never_reads_the_weight_stream():
    def stream():
        raise AssertionError("the embedded source must not consume a (collective) export")
        yield  # pragma: no cover

    source = MegatronRolloutSource(torch.nn.Linear(1, 1))
    assert isinstance(source, RolloutSource) and not source.refit_required
    source.update_weights(stream())
