"""How the recipes sample: the one code path from a rollout choice (``RolloutSpec.backend`` of
GRPO, PPO and the distillation student, ``TeacherSpec.backend`` of the distillation teacher: a
backend name, a :class:`~lightning_mcore_rl.rollout.RolloutSource` or a factory) to a
:class:`~lightning_mcore_rl.rollout.PolicyRollout` of a recipe model, and its ``generate``."""

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
    """The rollout of ``model`` from ``choice`` (checked at construction).

    Args:
        choice: a backend name (``"megatron"``, ``"hf"``, ``"vllm"``), a source or a factory
            ``(RolloutSetup) -> RolloutSource``.
        model: the recipe model that samples.
        frozen: ``model`` never steps (a hosted teacher): refit once.

    Raises:
        ValueError: ``"hf"``, or a source instance with ``refit_required``, for a model that is
            not an :class:`~.common.HFModelSpec` (a refit streams its HF export); an unknown name.
        TypeError: ``choice`` is neither a name, a source nor a callable.
        ImportError: ``"vllm"`` without vLLM installed (naming how to install it).
    """
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
    """``rollout``'s ``generate`` for this step: the setup of ``model`` (the policy's chunks, or
    with ``teacher`` the hosted teacher's), refit if ``module`` has stepped since the last one."""
    return functools.partial(rollout.generate, _setup(module, model, teacher), module.global_step)


def _setup(module: MCoreRLModule, model: RecipeModel, teacher: bool = False) -> RolloutSetup:
    """The :class:`RolloutSetup` of ``model`` (the policy's chunks, or the hosted teacher's)."""
    strategy = module.mcore_strategy
    chunks = strategy.teacher.chunks if teacher else strategy.model_chunks
    bridge = model.hf_bridge() if isinstance(model.spec, HFModelSpec) else None
    return RolloutSetup(chunks, strategy.groups, bridge, world_group=strategy.world_group)


def rollout_submit(module: MCoreRLModule, rollout: PolicyRollout, model: RecipeModel) -> Submit:
    """``rollout``'s ``submit`` for this step (:func:`rollout_generate`'s, sampled in the
    background by a source that can)."""
    return functools.partial(rollout.submit, _setup(module, model), module.global_step)


def describe_choice(choice: RolloutChoice) -> str:
    """A rollout choice for the hyperparameters: the backend name, or the source's class / the
    factory's qualified name (neither is copied into the checkpoint)."""
    if isinstance(choice, str):
        return choice
    named = choice if isinstance(choice, type) or not isinstance(choice, RolloutSource) else None
    target = type(choice) if named is None else named
    return f"{target.__module__}.{getattr(target, '__qualname__', repr(target))}"


def spec_hparams(spec: Any) -> dict[str, Any]:
    """``asdict(spec)`` of a recipe spec dataclass, its rollout ``backend`` described by
    :func:`describe_choice` (``asdict`` would deep-copy a source)."""
    out: dict[str, Any] = {}
    for field in fields(spec):
        value = getattr(spec, field.name)
        if field.name == "backend":
            out[field.name] = describe_choice(value)
        elif is_dataclass(value) and not isinstance(value, type):
            out[field.name] = asdict(value)
        else:
            out[field.name] = value
    return out
