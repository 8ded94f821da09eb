"""The trainer side of a rollout source: the named backends, the choice of a source,
`PolicyRollout` (build, refit, sample) and the train/inference mismatch extrema."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.rollout.hf_source import HFRolloutSource
from lightning_mcore_rl.rollout.pending import (
    BackgroundRolloutSource,
    PendingRollout,
    ReadyRollout,
)
from lightning_mcore_rl.rollout.preflight import check_before_rollout
from lightning_mcore_rl.rollout.source import (
    MegatronRolloutSource,
    Rollout,
    RolloutSource,
    SamplingConfig,
)
from lightning_mcore_rl.rollout.vllm_source import VLLMRolloutSource

if TYPE_CHECKING:
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import ParallelGroups

RolloutBackend = Literal["megatron", "hf", "vllm"]
"""``"megatron"``: the embedded sampler on the training chunk (:class:`MegatronRolloutSource`);
``"hf"``: a ``transformers`` copy of an HF policy (:class:`HFRolloutSource`); ``"vllm"``: a vLLM
engine loaded from an HF policy's directory (:class:`VLLMRolloutSource`)."""


@dataclass(frozen=True)
class RolloutSetup:
    """What a rollout source is built from, known once the strategy has set up.

    Attributes:
        chunks: this rank's chunks (one per VPP stage) of the model that samples.
        hf_bridge: the model's HF directory and weight export; ``None`` for a non-HF model.
        world_group: the training ranks `check_before_rollout` agrees over (``None``: default)."""

    chunks: Sequence[torch.nn.Module]
    groups: ParallelGroups
    hf_bridge: HFBridge | None = None
    world_group: Any = None


RolloutSourceFactory = Callable[[RolloutSetup], RolloutSource]
"""Builds a source from the :class:`RolloutSetup` (called once, on every rank, at the first
rollout); a :class:`RolloutSource` class taking the setup is one."""

RolloutChoice = RolloutBackend | RolloutSource | RolloutSourceFactory
"""A backend name, a built source (used as is) or a factory."""


def megatron_rollout_source(setup: RolloutSetup) -> RolloutSource:
    """``"megatron"``: the embedded sampler on the first chunk with the TP (and PP) group."""
    groups = setup.groups
    pp_group = groups.pp_group if groups.pp_size > 1 else None
    return MegatronRolloutSource(setup.chunks[0], groups.tp_group, pp_group)


def _replica_generator(setup: RolloutSetup, backend: str) -> tuple[str, Any]:
    """The HF directory and the group (each DP replica's TP x PP group) of a one-rank engine.

    Raises:
        ValueError: not a Hugging Face model, or CP > 1."""
    if setup.hf_bridge is None:
        raise ValueError(
            f"backend={backend!r} generates with its own copy of the model and needs a Hugging "
            "Face checkpoint (an HFModelSpec model), which it is loaded from and refit with; "
            "use backend='megatron'."
        )
    groups = setup.groups
    if groups.cp_size != 1:
        raise ValueError(
            f"backend={backend!r} shares a rollout over the model-parallel group (TP x PP); "
            f"context_parallel_size must be 1, got {groups.cp_size}."
        )
    return str(setup.hf_bridge.directory), groups.mp_group


def hf_rollout_source(setup: RolloutSetup) -> RolloutSource:
    """``"hf"``: a ``transformers`` copy of the model on the first rank of each DP replica.

    Raises:
        ValueError: not a Hugging Face model, or CP > 1."""
    return HFRolloutSource(*_replica_generator(setup, "hf"))


def vllm_rollout_source(setup: RolloutSetup) -> RolloutSource:
    """``"vllm"``: a vLLM engine of the model owned by the first rank of each DP replica.

    Raises:
        ValueError: not a Hugging Face model, or CP > 1.
        ImportError: vLLM is not installed (on every rank)."""
    return VLLMRolloutSource(*_replica_generator(setup, "vllm"))


ROLLOUT_BACKENDS: dict[str, RolloutSourceFactory] = {
    "megatron": megatron_rollout_source,
    "hf": hf_rollout_source,
    "vllm": vllm_rollout_source,
}
"""The factories of the named backends (``RolloutSpec(backend=...)`` in YAML)."""


def rollout_source_factory(choice: RolloutChoice) -> RolloutSourceFactory:
    """The factory of a backend name, a source instance (returned as is) or a factory.

    Raises:
        ValueError: an unknown backend name.
        TypeError: neither a name, a `RolloutSource` nor a callable."""
    if isinstance(choice, str):
        if choice not in ROLLOUT_BACKENDS:
            raise ValueError(
                f"`backend` must be one of {sorted(ROLLOUT_BACKENDS)}, a RolloutSource or a "
                f"factory `(RolloutSetup) -> RolloutSource`, got {choice!r}."
            )
        return ROLLOUT_BACKENDS[choice]
    if not isinstance(choice, type) and isinstance(choice, RolloutSource):
        source: RolloutSource = choice
        # a built source is used as is, on every call
        return lambda setup: source
    if callable(choice):
        return choice
    raise TypeError(
        "`backend` must be a backend name, a RolloutSource or a factory `(RolloutSetup) -> "
        f"RolloutSource`, got {type(choice).__name__}."
    )


class SubmittedRollout(NamedTuple):
    """A rollout started by `PolicyRollout.submit`: its handle and the optimizer step of the
    weights that sample it (the last refit's; the current one for the training model)."""

    pending: PendingRollout
    weights_step: int


class PolicyRollout:
    """A recipe's rollout: the chosen source, built at the first rollout and refit before one
    whenever the model has stepped since the last refit.

    Args:
        choice: the source (`RolloutChoice`).
        frozen: the model never steps (a hosted teacher): one refit, before the first rollout."""

    def __init__(self, choice: RolloutChoice, *, frozen: bool = False) -> None:
        self.factory = rollout_source_factory(choice)
        self.frozen = frozen
        self.source: RolloutSource | None = None
        self.refit_step: int | None = None
        self._in_flight: list[PendingRollout] = []

    def build(self, setup: RolloutSetup) -> RolloutSource:
        """The source, built on first use.

        Raises:
            TypeError: the factory returned something that is not a `RolloutSource`."""
        # built this late because megatron's groups and the model exist only then
        if self.source is None:
            source = self.factory(setup)
            if not isinstance(source, RolloutSource):
                raise TypeError(
                    f"The rollout source factory {self.factory!r} returned a "
                    f"{type(source).__name__}, not a RolloutSource (`refit_required`, "
                    "`generate`, `update_weights`)."
                )
            self.source = source
        return self.source

    def wait(self) -> None:
        """Block until every background rollout is sampled (local; ``result()`` still to call)."""
        for pending in self._in_flight:
            pending.wait()
        self._in_flight.clear()

    def generate(
        self,
        setup: RolloutSetup,
        step: int,
        prompts: Tensor,
        sampling: SamplingConfig,
        prompt_lengths: Tensor | None = None,
    ) -> Rollout:
        """Refit the source if the model has stepped (``step``: optimizer steps so far), then
        sample ``prompts [B, P]`` (left-padded, ``prompt_lengths [B]`` real tokens).

        Raises:
            ValueError: a source that needs a refit, of a model with no HF bridge (every rank).
            NonFiniteWeightError, BatchMismatchError: as `check_before_rollout`."""
        check_before_rollout(setup, prompts, prompt_lengths)
        source = self._refit(setup, step)
        return source.generate(prompts, sampling, prompt_lengths)

    def submit(
        self,
        setup: RolloutSetup,
        step: int,
        prompts: Tensor,
        sampling: SamplingConfig,
        prompt_lengths: Tensor | None = None,
    ) -> SubmittedRollout:
        """`generate`, in the background for a `BackgroundRolloutSource`: returns once the sampling
        has started."""
        check_before_rollout(setup, prompts, prompt_lengths)
        source = self._refit(setup, step)
        if isinstance(source, BackgroundRolloutSource):
            pending = source.submit(prompts, sampling, prompt_lengths)
            # waited for before the next refit or rollout (`wait`)
            self._in_flight.append(pending)
        else:
            pending = ReadyRollout(source.generate(prompts, sampling, prompt_lengths))
        # a source sampling with the training model itself uses the current step's weights
        weights_step = self.refit_step if source.refit_required else step
        assert weights_step is not None  # refit above
        return SubmittedRollout(pending, weights_step)

    def _refit(self, setup: RolloutSetup, step: int) -> RolloutSource:
        """The source, after the in-flight samples (`wait`) and a refit when it is stale."""
        source = self.build(setup)
        # a rollout is sampled by the weights it was submitted with, and a source serves one
        # request at a time
        self.wait()
        # stale once the model has stepped since the last refit, as NeMo RL refits a stale
        # generation backend
        stale = self.refit_step is None or (not self.frozen and self.refit_step != step)
        if source.refit_required and stale:
            # on every rank alike, before the collective export
            if setup.hf_bridge is None:
                raise ValueError(
                    f"{type(source).__name__} has refit_required=True: it is refit from the "
                    "model's Hugging Face weight export, which needs an HFModelSpec model."
                )
            # collective on every rank: TP all-gather, PP broadcast
            # fp32 export: each source casts to its own dtype as the tensors arrive
            weights = setup.hf_bridge.export_hf_weights(
                setup.chunks, groups=setup.groups, dtype=torch.float32
            )
            source.update_weights(weights)
            self.refit_step = step
        return source


def mismatch_extrema(batch: Mapping[str, Any], dp_group: Any) -> dict[str, Tensor]:
    """``{"gen_train_ratio_min": [], "gen_train_ratio_max": []}``: extremes over all DP ranks of
    ``exp(prev_logprobs - generation_logprobs)`` at ``token_mask``, all ``[B, S]`` in ``batch``
    (``ValueError`` when their shapes differ)."""
    # Both are 1 when the source and the trainer agree exactly; the means are ClippedPGLossFn's
    # token_mult_prob_error and gen_kl_error.
    gen, prev, mask = (batch[k] for k in ("generation_logprobs", "prev_logprobs", "token_mask"))
    if not gen.shape == prev.shape == mask.shape:
        raise ValueError(
            f"`generation_logprobs` {tuple(gen.shape)}, `prev_logprobs` {tuple(prev.shape)} and "
            f"`token_mask` {tuple(mask.shape)} must be the same [B, S] shape."
        )
    ratio = torch.exp(prev.double() - gen.double())[mask.bool()]
    empty = ratio.numel() == 0
    low = torch.tensor(torch.inf, dtype=torch.float64) if empty else ratio.min()
    high = torch.tensor(-torch.inf, dtype=torch.float64) if empty else ratio.max()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=dp_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=dp_group)
    return {"gen_train_ratio_min": low.float(), "gen_train_ratio_max": high.float()}
