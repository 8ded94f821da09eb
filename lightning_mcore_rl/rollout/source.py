"""The rollout-source protocol: what an RL recipe needs from whatever generates its samples
(the embedded megatron sampler, a Hugging Face copy of the policy, or an inference engine such as
vLLM/SGLang), and the embedded sampler wrapped as one. The contract is in ``docs/rollout.md``.

Shapes: ``B`` sequences, ``P`` prompt tokens, ``N`` new tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_mcore_rl.rollout.sampler import generate


@dataclass(frozen=True)
class SamplingConfig:
    """How one :meth:`RolloutSource.generate` call samples.

    Attributes:
        max_new_tokens: ``N`` >= 1 tokens per prompt (no early stop: every completion has ``N``).
        temperature: > 0; tokens are drawn from ``softmax(logits / temperature)`` (no top-k/p).
        seed: the seed of the draw; the same prompts, weights and seed give the same tokens.
    """

    max_new_tokens: int
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {self.temperature}")


class Rollout(NamedTuple):
    """Prompts plus sampled completions, identical on every rank that asked for them.

    Attributes:
        tokens: ``[B, P+N]`` prompt then ``N`` sampled tokens (int64).
        completion_mask: ``[B, P+N]`` 1 at sampled positions, 0 at prompt positions.
        generation_logprobs: ``[B, P+N]`` fp32 log-probability of each sampled token under the
            temperature-scaled sampling distribution ``log_softmax(logits / T)``; 0 at prompt
            positions (the stored-logprob convention of the losses' ``generation_logprobs``).
    """

    tokens: Tensor
    completion_mask: Tensor
    generation_logprobs: Tensor


@runtime_checkable
class RolloutSource(Protocol):
    """Anything that samples completions of a policy (contract: ``docs/rollout.md``).

    Attributes:
        refit_required: ``True`` when the source holds its own copy of the weights, which the
            trainer must refresh with :meth:`update_weights` after every optimizer step;
            ``False`` when it generates with the training model itself (never refit).
    """

    refit_required: ClassVar[bool]

    def generate(self, prompts: Tensor, sampling: SamplingConfig) -> Rollout:
        """Sample ``sampling.max_new_tokens`` tokens after each of ``prompts [B, P]``.

        Collective over the source's group: every rank of it passes the same prompts and gets
        the same :class:`Rollout`.
        """
        ...

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Refit: replace every weight with ``(hf_name, full tensor)`` pairs, e.g. the stream of
        :meth:`~lightning_mcore_rl.models.HFBridge.export_hf_weights`. Called only when
        :attr:`refit_required`, on every rank of the training world with the same stream (the
        export is collective), which the source must consume to the end."""
        ...


def check_prompts(prompts: Tensor) -> None:
    """``ValueError`` unless ``prompts`` is an integer ``[B, P]`` tensor (before any collective)."""
    if prompts.ndim != 2 or prompts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"`prompts` must be integer [B, P], got {prompts.dtype} {tuple(prompts.shape)}"
        )


def completion_mask(batch: int, prompt_length: int, new_tokens: int) -> Tensor:
    """``[B, P+N]`` int64: 0 on the ``P`` prompt positions, 1 on the ``N`` sampled ones."""
    mask = torch.zeros(batch, prompt_length + new_tokens, dtype=torch.long)
    mask[:, prompt_length:] = 1
    return mask


class MegatronRolloutSource:
    """The embedded sampler (:func:`~lightning_mcore_rl.rollout.generate`) as a
    :class:`RolloutSource`: it runs the training chunk itself, so refitting is a no-op.

    Every rank of the tensor-parallel group generates (same seed, gathered logits, so the same
    tokens without communicating them); under PP the stages run in turn and the last one draws
    and broadcasts the tokens. CP, SP and VPP are refused as by ``generate``.

    Args:
        model: this rank's megatron GPT chunk (possibly DDP/``Float16Module``-wrapped).
        tp_group: its tensor-parallel group (``None``: TP=1).
        pp_group: its pipeline-parallel group (``None``: PP=1).
        kv_cache: keep keys/values in megatron's ``StaticInferenceContext`` (``generate``).
    """

    refit_required: ClassVar[bool] = False

    def __init__(
        self,
        model: torch.nn.Module,
        tp_group: Any = None,
        pp_group: Any = None,
        kv_cache: bool = False,
    ) -> None:
        self.model = model
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.kv_cache = kv_cache

    def generate(self, prompts: Tensor, sampling: SamplingConfig) -> Rollout:
        """``generate(model, prompts, ...)`` with a CPU generator seeded by ``sampling.seed``."""
        out = generate(
            self.model,
            prompts,
            max_new_tokens=sampling.max_new_tokens,
            generator=torch.Generator().manual_seed(sampling.seed),
            temperature=sampling.temperature,
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            kv_cache=self.kv_cache,
        )
        return Rollout(out.tokens, out.completion_mask, out.logprobs)

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """No-op: the source IS the training model (the stream is not consumed, so do not
        pass a collective export here; ``refit_required`` is ``False``)."""
