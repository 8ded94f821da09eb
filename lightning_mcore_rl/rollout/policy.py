"""The trainer side of a rollout source: the named backends (:data:`ROLLOUT_BACKENDS`), the
choice of a source by name, instance or factory (:func:`rollout_source_factory`), and
:class:`PolicyRollout`, which builds the chosen source once the strategy has set up, refits it
after every optimizer step and samples; plus the train/inference mismatch extrema.

Shapes: ``B`` sequences, ``S`` tokens.
"""

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
        chunks: this rank's chunks of the model that samples (the policy's, or a hosted
            teacher's), one per virtual pipeline stage.
        groups: this rank's process groups (TP/PP/DP/CP groups, ranks and sizes).
        hf_bridge: the model's :class:`~lightning_mcore_rl.models.HFBridge` (its Hugging Face
            directory and the weight export a refit streams); ``None`` when the model is not a
            Hugging Face checkpoint.
        world_group: the group of every training rank the checks before a rollout agree over
            (:func:`~.preflight.check_before_rollout`; ``None``: the default group).
    """

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
    """``"megatron"``: the embedded sampler on the first chunk with the TP group (and the PP
    group under pipeline parallelism)."""
    groups = setup.groups
    pp_group = groups.pp_group if groups.pp_size > 1 else None
    return MegatronRolloutSource(setup.chunks[0], groups.tp_group, pp_group)


def _replica_generator(setup: RolloutSetup, backend: str) -> tuple[str, Any]:
    """The HF directory and the group of an engine on the first rank of each data-parallel
    replica's model-parallel group (TP x PP).

    Raises:
        ValueError: the model is not a Hugging Face checkpoint, or CP > 1.
    """
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
    """``"hf"``: a ``transformers`` copy of the model's HF checkpoint on the first rank of each
    data-parallel replica's model-parallel group (TP x PP).

    Raises:
        ValueError: the model is not a Hugging Face checkpoint, or CP > 1.
    """
    return HFRolloutSource(*_replica_generator(setup, "hf"))


def vllm_rollout_source(setup: RolloutSetup) -> RolloutSource:
    """``"vllm"``: a vLLM engine loaded from the model's HF checkpoint, owned by the first rank
    of each data-parallel replica's model-parallel group (TP x PP), refit in place.

    Raises:
        ValueError: the model is not a Hugging Face checkpoint, or CP > 1.
        ImportError: vLLM is not installed (on every rank).
    """
    return VLLMRolloutSource(*_replica_generator(setup, "vllm"))


ROLLOUT_BACKENDS: dict[str, RolloutSourceFactory] = {
    "megatron": megatron_rollout_source,
    "hf": hf_rollout_source,
    "vllm": vllm_rollout_source,
}
"""The factories of the named backends (``RolloutSpec(backend=...)`` in YAML)."""


def rollout_source_factory(choice: RolloutChoice) -> RolloutSourceFactory:
    """The factory of ``choice``: a named backend's, a source instance's (returns it as is) or
    ``choice`` itself when it is a factory (a function or a class taking the setup).

    Raises:
        ValueError: an unknown backend name.
        TypeError: neither a name, a :class:`RolloutSource` nor a callable.
    """
    if isinstance(choice, str):
        if choice not in ROLLOUT_BACKENDS:
            raise ValueError(
                f"`backend` must be one of {sorted(ROLLOUT_BACKENDS)}, a RolloutSource or a "
                f"factory `(RolloutSetup) -> RolloutSource`, got {choice!r}."
            )
        return ROLLOUT_BACKENDS[choice]
    if not isinstance(choice, type) and isinstance(choice, RolloutSource):
        source: RolloutSource = choice
        return lambda setup: source
    if callable(choice):
        return choice
    raise TypeError(
        "`backend` must be a backend name, a RolloutSource or a factory `(RolloutSetup) -> "
        f"RolloutSource`, got {type(choice).__name__}."
    )


class SubmittedRollout(NamedTuple):
    """A rollout started by :meth:`PolicyRollout.submit`.

    Attributes:
        pending: its handle (``result()`` is collective over the source's group).
        weights_step: the optimizer steps of the weights that sample it (the step the source
            was last refit at; the current step for a source that samples with the training
            model).
    """

    pending: PendingRollout
    weights_step: int


class PolicyRollout:
    """A recipe's rollout: the chosen source, built at the first :meth:`generate` (megatron's
    groups and the model exist then) and refit whenever the model has taken an optimizer step
    since the last refit (before the next :meth:`generate`, as NeMo RL refits a stale
    generation backend).

    A source with ``refit_required`` is refit from the model's
    :meth:`~lightning_mcore_rl.models.HFBridge.export_hf_weights` (TP all-gather, PP broadcast,
    on every rank), so it needs a Hugging Face model. :meth:`submit` lets a
    :class:`~.pending.BackgroundRolloutSource` sample while the trainer goes on; every later
    refit, :meth:`generate` or :meth:`submit` first waits for those samples (:meth:`wait`), so a
    rollout is sampled by the weights it was submitted with and the source serves one request
    at a time.

    Args:
        choice: the source (:data:`RolloutChoice`).
        frozen: the model never steps (a hosted teacher): one refit, before the first rollout.

    Raises:
        ValueError, TypeError: as :func:`rollout_source_factory`.
    """

    def __init__(self, choice: RolloutChoice, *, frozen: bool = False) -> None:
        self.factory = rollout_source_factory(choice)
        self.frozen = frozen
        self.source: RolloutSource | None = None
        self.refit_step: int | None = None
        self._in_flight: list[PendingRollout] = []

    def build(self, setup: RolloutSetup) -> RolloutSource:
        """The source, built on first use.

        Raises:
            TypeError: the factory returned something that is not a :class:`RolloutSource`.
        """
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
        """Block until every rollout submitted in the background has been sampled (local: the
        handles' ``result()`` is still to be called)."""
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
        """Refit the source if the model has stepped since the last refit (``step``: its
        optimizer steps so far), then sample ``prompts [B, P]`` (left-padded to
        ``prompt_lengths [B]`` real tokens; collective over the training world when refitting,
        over the source's group otherwise).

        Raises:
            ValueError: a source that needs a refit, of a model with no HF bridge (on every
                rank, before any collective).
            NonFiniteWeightError, BatchMismatchError: a NaN/inf weight on any rank, or
                different prompts on the ranks of a replica (every rank, before the refit and
                the sampling: :func:`~.preflight.check_before_rollout`).
        """
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
        """:meth:`generate`, sampled in the background by a
        :class:`~.pending.BackgroundRolloutSource` (in the foreground by any other source):
        returns once the refit is done and the sampling has started.

        Raises:
            ValueError, NonFiniteWeightError, BatchMismatchError: as :meth:`generate`.
        """
        check_before_rollout(setup, prompts, prompt_lengths)
        source = self._refit(setup, step)
        if isinstance(source, BackgroundRolloutSource):
            pending = source.submit(prompts, sampling, prompt_lengths)
            self._in_flight.append(pending)
        else:
            pending = ReadyRollout(source.generate(prompts, sampling, prompt_lengths))
        weights_step = self.refit_step if source.refit_required else step
        assert weights_step is not None  # refit above
        return SubmittedRollout(pending, weights_step)

    def _refit(self, setup: RolloutSetup, step: int) -> RolloutSource:
        """The source, after the in-flight samples (:meth:`wait`) and, when it has
        ``refit_required`` and the model has stepped since, a refit."""
        source = self.build(setup)
        self.wait()
        stale = self.refit_step is None or (not self.frozen and self.refit_step != step)
        if source.refit_required and stale:
            if setup.hf_bridge is None:
                raise ValueError(
                    f"{type(source).__name__} has refit_required=True: it is refit from the "
                    "model's Hugging Face weight export, which needs an HFModelSpec model."
                )
            weights = setup.hf_bridge.export_hf_weights(
                setup.chunks, groups=setup.groups, dtype=torch.float32
            )
            source.update_weights(weights)
            self.refit_step = step
        return source


def mismatch_extrema(batch: Mapping[str, Any], dp_group: Any) -> dict[str, Tensor]:
    """Extremes of the per-token train/inference probability ratio
    ``exp(prev_logprobs - generation_logprobs)`` over the ``token_mask`` tokens of all
    data-parallel ranks (``1`` for both when the source and the trainer agree exactly; the means
    are ``ClippedPGLossFn``'s ``token_mult_prob_error`` and ``gen_kl_error``).

    Args:
        batch: ``generation_logprobs`` (the source's, 0 at prompt positions), ``prev_logprobs``
            (the trainer's ``compute_logprobs`` of the same tokens) and ``token_mask``, each
            ``[B, S]``.
        dp_group: the data-parallel group (one MIN and one MAX all-reduce).

    Returns:
        ``{"gen_train_ratio_min": [], "gen_train_ratio_max": []}``.
    """
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
