"""Choosing a rollout source by instance or factory (no process group: a size-1 fake one that
fails on any collective): the instance is used as is, a factory (function or class) gets the
setup once, refits happen when and only when the source asks for them, and every misuse raises
before sampling."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import pytest
import torch
from helpers.unit import FakeGroup
from torch import Tensor

from lightning_mcore_rl.parallel import ParallelGroups
from lightning_mcore_rl.recipes import DistillationModule, GRPOModule, RolloutSpec, TeacherSpec
from lightning_mcore_rl.recipes.common import HFModelSpec, RecipeModel, TinyGPTSpec
from lightning_mcore_rl.recipes.rollout_choice import describe_choice, recipe_rollout
from lightning_mcore_rl.rollout import (
    MegatronRolloutSource,
    PolicyRollout,
    Rollout,
    RolloutSetup,
    SamplingConfig,
    rollout_source_factory,
)

G = FakeGroup()
GROUPS = ParallelGroups(
    tp_group=G, tp_rank=0, tp_size=1, pp_group=G, pp_rank=0, pp_size=1, pp_last_rank=0,
    dp_group=G, dp_rank=0, dp_size=1, cp_group=G, cp_rank=0, cp_size=1,
)  # fmt: skip
CHUNK = torch.nn.Linear(1, 1)


class CountingSource:
    """Completion token ``j`` of row ``i`` is ``(last prompt token + j + 1) % 16`` with logprob
    ``-0.5``; records its calls."""

    refit_required: ClassVar[bool] = False

    def __init__(self, setup: RolloutSetup | None = None) -> None:
        self.setup = setup
        self.calls: list[int] = []
        self.refits: list[list[str]] = []

    def generate(
        self, prompts: Tensor, sampling: SamplingConfig, prompt_lengths: Tensor | None = None
    ) -> Rollout:
        self.calls.append(sampling.seed)
        batch, width = prompts.shape
        steps = torch.arange(1, sampling.max_new_tokens + 1)
        completion = (prompts[:, -1:] + steps[None, :]) % 16
        mask = torch.cat([torch.zeros(batch, width), torch.ones_like(completion)], 1).long()
        logprobs = -0.5 * mask.float()
        lengths = torch.full((batch,), width)
        return Rollout(torch.cat([prompts, completion], 1), mask, logprobs, lengths)

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        self.refits.append([name for name, _ in weights])


class RefitSource(CountingSource):
    refit_required: ClassVar[bool] = True


class FakeBridge:
    """Stands for an ``HFBridge``'s export (the real one gathers over TP/PP); records the groups
    and dtype of each export."""

    directory = "unused"

    def __init__(self) -> None:
        self.exports: list[tuple[ParallelGroups, torch.dtype]] = []

    def export_hf_weights(
        self, chunks: Any, groups: ParallelGroups, dtype: torch.dtype
    ) -> Iterable[tuple[str, Tensor]]:
        self.exports.append((groups, dtype))
        return iter([("weight", torch.zeros(1)), ("bias", torch.zeros(1))])


def _sample(rollout: PolicyRollout, setup: RolloutSetup, step: int) -> Rollout:
    return rollout.generate(setup, step, torch.tensor([[3, 4], [7, 15]]), SamplingConfig(3))


def test_an_instance_is_used_as_is_and_a_factory_gets_the_setup_once() -> None:
    setup = RolloutSetup([CHUNK], GROUPS)
    source = CountingSource()
    rollout = PolicyRollout(source)
    out = _sample(rollout, setup, 0)
    assert rollout.source is source and source.calls == [0] and source.refits == []
    assert torch.equal(out.tokens, torch.tensor([[3, 4, 5, 6, 7], [7, 15, 0, 1, 2]]))
    seen: list[RolloutSetup] = []

    def factory(s: RolloutSetup) -> CountingSource:
        seen.append(s)
        return CountingSource(s)

    by_function = PolicyRollout(factory)
    for step in range(3):
        _sample(by_function, setup, step)
    assert seen == [setup] and by_function.source is not None
    by_class = PolicyRollout(CountingSource)
    _sample(by_class, setup, 0)
    assert isinstance(by_class.source, CountingSource) and by_class.source.setup is setup
    assert rollout_source_factory("megatron")(setup).model is CHUNK  # type: ignore[attr-defined]
    assert isinstance(rollout_source_factory("megatron")(setup), MegatronRolloutSource)


def test_a_refit_source_is_refit_once_per_step_or_once_when_frozen() -> None:
    bridge = FakeBridge()
    setup = RolloutSetup([CHUNK], GROUPS, bridge)  # type: ignore[arg-type]
    policy, teacher = RefitSource(), RefitSource()
    stepping, frozen = PolicyRollout(policy), PolicyRollout(teacher, frozen=True)
    for step in (0, 0, 1, 2, 2):
        _sample(stepping, setup, step)
        _sample(frozen, setup, step)
    assert policy.refits == [["weight", "bias"]] * 3  # steps 0, 1, 2
    assert teacher.refits == [["weight", "bias"]]
    assert bridge.exports == [(GROUPS, torch.float32)] * 4  # the setup's groups, every refit


def test_misused_choices_raise_before_sampling() -> None:
    with pytest.raises(TypeError, match="`backend` must be a backend name, a RolloutSource or a"):
        PolicyRollout(3)  # type: ignore[arg-type]
    not_a_source = PolicyRollout(lambda setup: object())  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="returned a object, not a RolloutSource"):
        _sample(not_a_source, RolloutSetup([CHUNK], GROUPS), 0)
    no_bridge = PolicyRollout(RefitSource)
    with pytest.raises(ValueError, match="RefitSource has refit_required=True.*HFModelSpec"):
        _sample(no_bridge, RolloutSetup([CHUNK], GROUPS), 0)
    with pytest.raises(ValueError, match="backend='hf' .* needs a Hugging Face checkpoint"):
        rollout_source_factory("hf")(RolloutSetup([CHUNK], GROUPS))
    tiny = RecipeModel(TinyGPTSpec(), vocab_size=16, max_sequence_length=16)
    with pytest.raises(ValueError, match="`backend` RefitSource has refit_required=True.*TinyGPT"):
        recipe_rollout(RefitSource(), tiny)
    hf = RecipeModel(HFModelSpec(path="unread"), vocab_size=16, max_sequence_length=16)
    assert recipe_rollout(RefitSource(), hf).source is None


def test_recipes_take_a_source_or_factory_and_record_its_name() -> None:
    source = CountingSource()
    grpo = GRPOModule(rollout=RolloutSpec(backend=source))
    assert grpo.rollout_source.factory(RolloutSetup([CHUNK], GROUPS)) is source
    assert grpo.hparams["rollout"]["backend"] == f"{__name__}.CountingSource"
    distillation = DistillationModule(
        rollout=RolloutSpec(backend=CountingSource), teacher=TeacherSpec(backend=source)
    )
    assert distillation.teacher_rollout.frozen and not distillation.rollout_source.frozen
    assert distillation.hparams["teacher"]["backend"] == f"{__name__}.CountingSource"
    assert distillation.hparams["teacher"]["model"] == {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seed": 0,
        "mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.1,
    }  # fmt: skip
    assert describe_choice("hf") == "hf"
    assert describe_choice(test_recipes_take_a_source_or_factory_and_record_its_name) == (
        f"{__name__}.test_recipes_take_a_source_or_factory_and_record_its_name"
    )
