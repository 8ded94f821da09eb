"""How the recipes sample: the one code path from a rollout choice (``RolloutSpec.backend``,
``TeacherSpec.backend``) to a `PolicyRollout` of a recipe model, and its ``generate``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, fields, is_dataclass
from typing import Any, cast

from torch import Tensor

from lightning_mcore_rl.module import MCoreRLModule
from lightning_mcore_rl.recipes.common import HFModelSpec, RecipeModel
from lightning_mcore_rl.rollout import (
    PolicyRollout,
    Rollout,
    RolloutChoice,
    RolloutSetup,
    RolloutSource,
    SamplingConfig,
    SubmittedRollout,
)
from lightning_mcore_rl.rollout.vllm_source import require_vllm

Generate = Callable[[Tensor, SamplingConfig, Tensor | None], Rollout]
"""``(prompts [B, P], sampling, prompt_lengths [B] | None) -> Rollout``."""

Submit = Callable[[Tensor, SamplingConfig, Tensor | None], SubmittedRollout]
"""``(prompts [B, P], sampling, prompt_lengths [B] | None) -> SubmittedRollout``."""


def recipe_rollout(
    choice: RolloutChoice, model: RecipeModel, *, frozen: bool = False
) -> PolicyRollout:
    """The rollout of ``model`` from ``choice`` (checked at construction); ``frozen``: a teacher.

    Raises:
        ValueError: an unknown name; ``"hf"`` or a refit source for a non-HF model.
        TypeError: ``choice`` is neither a name, a source nor a callable.
        ImportError: ``"vllm"`` without vLLM installed (naming how to install it)."""
    # "hf", "vllm" and any refit source are refit from the model's HF export
    hf = isinstance(model.spec, HFModelSpec)
    if isinstance(choice, str) and choice in ("hf", "vllm") and not hf:
        raise ValueError(
            f"`backend={choice!r}` generates with its own copy of the policy, loaded from and "
            "refit with its Hugging Face checkpoint, and needs an HFModelSpec model, got "
            f"{type(model.spec).__name__}; use backend='megatron'."
        )
    if choice == "vllm":
        # at construction, not at the first rollout minutes into the run
        require_vllm()
    instance = isinstance(choice, RolloutSource) and not isinstance(choice, type)
    if instance and cast(RolloutSource, choice).refit_required and not hf:
        raise ValueError(
            f"`backend` {type(choice).__name__} has refit_required=True: it is refit from "
            f"the model's Hugging Face export, which needs an HFModelSpec model, got "
            f"{type(model.spec).__name__}."
        )
    return PolicyRollout(choice, frozen=frozen)


def rollout_generate(
    module: MCoreRLModule, rollout: PolicyRollout, model: RecipeModel, *, teacher: bool = False
) -> Generate:
    """``rollout``'s ``generate`` for this step on ``model``'s (or the teacher's) chunks."""
    # refit first if the module has stepped since the last refit
    return functools.partial(rollout.generate, _setup(module, model, teacher), module.global_step)


def _setup(module: MCoreRLModule, model: RecipeModel, teacher: bool = False) -> RolloutSetup:
    """The `RolloutSetup` of ``model`` (the policy's chunks, or the hosted teacher's)."""
    strategy = module.mcore_strategy
    chunks = strategy.teacher.chunks if teacher else strategy.model_chunks
    bridge = model.hf_bridge() if isinstance(model.spec, HFModelSpec) else None
    return RolloutSetup(chunks, strategy.groups, bridge, world_group=strategy.world_group)


def rollout_submit(module: MCoreRLModule, rollout: PolicyRollout, model: RecipeModel) -> Submit:
    """``rollout``'s ``submit`` for this step (`rollout_generate`'s, in the background)."""
    return functools.partial(rollout.submit, _setup(module, model), module.global_step)


def describe_choice(choice: RolloutChoice) -> str:
    """A rollout choice for the hyperparameters: its name, or the qualified name of its class."""
    # neither a source nor a factory is copied into the checkpoint
    if isinstance(choice, str):
        return choice
    named = choice if isinstance(choice, type) or not isinstance(choice, RolloutSource) else None
    target = type(choice) if named is None else named
    return f"{target.__module__}.{getattr(target, '__qualname__', repr(target))}"


def spec_hparams(spec: Any) -> dict[str, Any]:
    """``asdict(spec)`` of a recipe spec dataclass, its rollout ``backend`` `describe_choice`'d."""
    out: dict[str, Any] = {}
    for field in fields(spec):
        value = getattr(spec, field.name)
        if field.name == "backend":  # asdict would deep-copy a source
            out[field.name] = describe_choice(value)
        elif is_dataclass(value) and not isinstance(value, type):
            out[field.name] = asdict(value)
        else:
            out[field.name] = value
    return out
