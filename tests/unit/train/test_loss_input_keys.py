"""The step's up-front batch check reads the loss's own ``input_keys`` (no table of built-in
losses): a user loss with its own keys validates; a missing key raises naming the key and the
loss class, before any collective (the size-1 fake groups fail on any collective)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from helpers.unit import FakeGroup
from torch import Tensor, nn

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import LossFunction, LossInputType, LossType, MetricNormalizer
from lightning_mcore_rl.train import (
    LossPostProcessor,
    Microbatching,
    ParallelGroups,
    StepContext,
    run_global_batch,
)
from lightning_mcore_rl.train.validation import BatchSpec, loss_input_keys, validate_batch


class WeightedNLL:
    """A user loss reading a key no built-in loss knows: ``token_weights [B, S]``."""

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB
    input_keys = ("token_mask", "token_weights")
    metric_normalizations = {"loss": MetricNormalizer.TOKENS}

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        **loss_input: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        weights = data["token_weights"][:, 1:] * data["token_mask"][:, 1:]
        loss = -(loss_input["next_token_logprobs"] * weights).sum() / global_valid_toks
        return loss, {"loss": loss.detach()}


class Undeclared:
    """A user loss written before ``input_keys`` existed."""

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB
    metric_normalizations = {"loss": MetricNormalizer.TOKENS}


def _batch(**extra: Tensor) -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]),
        sample_mask=torch.ones(2),
        token_mask=torch.tensor([[0, 1, 1], [0, 1, 0]]).float(),
        **extra,
    )


def _spec(loss_fn: object) -> BatchSpec:
    return BatchSpec(
        vocab_size=8, required=loss_input_keys(loss_fn), required_by=type(loss_fn).__name__
    )


def test_a_user_loss_with_its_own_input_keys_validates() -> None:
    loss_fn = WeightedNLL()
    assert isinstance(loss_fn, LossFunction)
    assert loss_input_keys(loss_fn) == ("token_mask", "token_weights")
    assert validate_batch(_batch(token_weights=torch.ones(2, 3)), _spec(loss_fn)) is None


def test_a_missing_input_key_names_the_key_and_the_loss_class() -> None:
    with pytest.raises(ValueError, match="missing the key `token_weights` that WeightedNLL reads"):
        validate_batch(_batch(), _spec(WeightedNLL()))
    with pytest.raises(TypeError, match="`token_weights` must be a torch.Tensor, got list"):
        validate_batch(_batch(token_weights=[1.0, 1.0]), _spec(WeightedNLL()))  # type: ignore[arg-type]


def test_the_step_refuses_the_batch_before_any_collective() -> None:
    g = FakeGroup()
    groups = ParallelGroups(
        tp_group=g, tp_rank=0, tp_size=1, pp_group=g, pp_rank=0, pp_size=1, pp_last_rank=0,
        dp_group=g, dp_rank=0, dp_size=1, cp_group=g, cp_rank=0, cp_size=1,
    )  # fmt: skip
    context = StepContext(groups, Microbatching(micro_batch_size=2))
    loss_fn = WeightedNLL()
    with pytest.raises(ValueError, match="missing the key `token_weights` that WeightedNLL reads"):
        run_global_batch(
            [nn.Linear(1, 1)], _batch(), context, loss=LossPostProcessor(loss_fn, None),
            normalizations=loss_fn.metric_normalizations,
            required_keys=loss_input_keys(loss_fn), required_by=type(loss_fn).__name__,
        )  # fmt: skip


def test_recorded_experts_for_a_model_without_moe_layers_are_refused() -> None:
    # no extension replays them (the dense model's config turns none on): they would be dropped
    g = FakeGroup()
    groups = ParallelGroups(
        tp_group=g, tp_rank=0, tp_size=1, pp_group=g, pp_rank=0, pp_size=1, pp_last_rank=0,
        dp_group=g, dp_rank=0, dp_size=1, cp_group=g, cp_rank=0, cp_size=1,
    )  # fmt: skip
    context = StepContext(groups, Microbatching(micro_batch_size=2), extensions=())
    loss_fn = WeightedNLL()
    batch = _batch(token_weights=torch.ones(2, 3), routed_experts=torch.zeros(2, 3, 1, 2).long())
    with pytest.raises(ValueError, match="carries `routed_experts`.*has no MoE layers"):
        run_global_batch(
            [nn.Linear(1, 1)], batch, context, loss=LossPostProcessor(loss_fn, None),
            normalizations=loss_fn.metric_normalizations,
            required_keys=loss_input_keys(loss_fn), required_by=type(loss_fn).__name__,
        )  # fmt: skip


def test_an_undeclared_loss_requires_only_the_data_contract() -> None:
    assert loss_input_keys(Undeclared()) == ()
    assert validate_batch(_batch(), _spec(Undeclared())) is None
    with pytest.raises(ValueError, match=r"missing the key `sample_mask` \(present"):
        validate_batch({"input_ids": torch.tensor([[1, 2]])}, _spec(Undeclared()))


@pytest.mark.parametrize("declared", ["token_mask", ("token_mask", 3), 7])
def test_a_malformed_declaration_is_a_type_error(declared: object) -> None:
    loss_fn = Undeclared()
    loss_fn.input_keys = declared  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"`Undeclared.input_keys` must be a tuple of batch key"):
        loss_input_keys(loss_fn)
