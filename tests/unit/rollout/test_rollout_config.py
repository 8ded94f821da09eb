"""Argument checks of the rollout layer that need no process group: ``SamplingConfig``, a
recipe's backend choice by name (also through ``GRPOModule``) and the embedded source's
``update_weights`` no-op."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.recipes import GRPOModule, HFModelSpec, RolloutSpec
from lightning_mcore_rl.recipes.common import RecipeModel, TinyGPTSpec
from lightning_mcore_rl.recipes.rollout_choice import recipe_rollout
from lightning_mcore_rl.rollout import MegatronRolloutSource, RolloutSource, SamplingConfig
from lightning_mcore_rl.rollout.sampler import draw_tokens


def test_sampling_config_checks_its_fields():
    with pytest.raises(ValueError, match="`max_new_tokens` must be >= 1, got 0"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="`temperature` must be > 0, got -1.0"):
        SamplingConfig(max_new_tokens=1, temperature=-1.0)
    with pytest.raises(ValueError, match="`top_k` must be a positive int or None, got 0"):
        SamplingConfig(max_new_tokens=1, top_k=0)
    with pytest.raises(ValueError, match=r"`top_p` must be in \(0, 1\], got 1.5"):
        RolloutSpec(top_p=1.5)
    spec = RolloutSpec(temperature=0.5, top_k=3, top_p=0.9)
    assert spec.training_params() == TrainingSamplingParams(0.5, 3, 0.9)


def test_draw_tokens_samples_the_filtered_distribution():
    """Hand-derived: logits ``[3, 2, 1, 0, -1]`` at T=1. Top-k=2 keeps ids 0 and 1, so their
    logprobs are ``log(e^3 / (e^3 + e^2))`` = -0.31326 and ``log(e^2 / (e^3 + e^2))`` = -1.31326,
    and no other id is drawn; top-p=0.5 keeps id 0 alone (its probability, 0.6364, reaches 0.5),
    logprob 0. At T=2 with top-k=2: ``log(e^1.5 / (e^1.5 + e^1))`` = -0.47408 and
    ``log(e^1 / (e^1.5 + e^1))`` = -0.97408."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).expand(4000, 5)
    tokens, logprobs = draw_tokens(logits, torch.Generator().manual_seed(0), top_k=2)
    assert set(tokens[:, 0].tolist()) == {0, 1}
    expected = torch.where(tokens == 0, -0.3132617, -1.3132617)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)
    assert abs(float((tokens == 0).float().mean()) - 0.7311) < 0.03  # binomial sd 0.007
    tokens, logprobs = draw_tokens(logits[:8], torch.Generator(), top_p=0.5)
    assert tokens.eq(0).all() and logprobs.eq(0).all()
    tokens, logprobs = draw_tokens(logits[:64], torch.Generator().manual_seed(1), 2.0, top_k=2)
    expected = torch.where(tokens == 0, -0.4740770, -0.9740770)
    assert set(tokens[:, 0].tolist()) == {0, 1}
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)


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
