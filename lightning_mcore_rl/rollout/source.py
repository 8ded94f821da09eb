"""The rollout-source protocol: what an RL recipe needs from whatever generates its samples
(the embedded megatron sampler, a Hugging Face copy of the policy, or an inference engine such as
vLLM/SGLang), and the embedded sampler wrapped as one. The contract is in ``docs/rollout.md``.

Shapes: ``B`` sequences, ``P`` prompt columns (prompts left-padded to the longest), ``N`` new
tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import unwrap_model
from lightning_mcore_rl.rollout.sampler import generate


@dataclass(frozen=True)
class SamplingConfig:
    """How one :meth:`RolloutSource.generate` call samples.

    Attributes:
        max_new_tokens: ``N`` >= 1, the most tokens sampled per prompt.
        temperature: > 0; tokens are drawn from ``softmax(logits / temperature)``, after the
            filters below.
        seed: the seed of the draw; the same prompts, weights and seed give the same tokens.
        stop_token_ids: a completion ends with the first of these it samples (the stop token is
            part of the completion); none: every completion has ``N`` tokens.
        pad_token_id: the id put after a completion's stop token.
        top_k: keep the ``top_k`` largest scaled logits (ties kept; ``None``: no filter).
        top_p: then keep the smallest set of the largest whose probability reaches ``top_p``
            (``1.0``: no filter). vLLM's filters, in its order; the logprobs are those of the
            filtered, renormalised distribution (the trainer reproduces them with
            :meth:`training_params`).
    """

    max_new_tokens: int
    temperature: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}")
        self.training_params()  # checks temperature, top_k and top_p
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def training_params(self) -> TrainingSamplingParams:
        """The trainer's sampling parameters whose logprobs are this draw's."""
        return TrainingSamplingParams(self.temperature, self.top_k, self.top_p)


class Rollout(NamedTuple):
    """Prompts plus sampled completions, identical on every rank that asked for them.

    Row ``i`` is ``P - prompt_lengths[i]`` pad columns, its prompt, then its completion: the
    sampled tokens up to and including the first stop token, then ``pad_token_id``.

    Attributes:
        tokens: ``[B, P+N]`` int64.
        completion_mask: ``[B, P+N]`` 1 at the completion's positions, 0 elsewhere.
        generation_logprobs: ``[B, P+N]`` fp32 log-probability of each completion token under
            the temperature-scaled sampling distribution ``log_softmax(logits / T)``; 0 elsewhere
            (the stored-logprob convention of the losses' ``generation_logprobs``).
        prompt_lengths: ``[B]`` int64 real prompt tokens (``P`` for equal-length prompts).
        routed_experts: ``[B, P+N, L, K]`` int64, a MoE model's experts of every position at
            each of its ``L`` MoE layers (top-``K``, ascending ids), as the source routed it;
            ``None`` for a dense model or a source that does not record it.
    """

    tokens: Tensor
    completion_mask: Tensor
    generation_logprobs: Tensor
    prompt_lengths: Tensor
    routed_experts: Tensor | None = None

    @property
    def prompt_width(self) -> int:
        """``P``, the prompt columns: where the completions start (each has >= 1 token)."""
        return int(self.completion_mask[0].argmax())


@runtime_checkable
class RolloutSource(Protocol):
    """Anything that samples completions of a policy (contract: ``docs/rollout.md``).

    Attributes:
        refit_required: ``True`` when the source holds its own copy of the weights, which the
            trainer must refresh with :meth:`update_weights` after every optimizer step;
            ``False`` when it generates with the training model itself (never refit).
    """

    refit_required: ClassVar[bool]

    def generate(
        self, prompts: Tensor, sampling: SamplingConfig, prompt_lengths: Tensor | None = None
    ) -> Rollout:
        """Sample up to ``sampling.max_new_tokens`` tokens after each of ``prompts [B, P]``,
        left-padded: row ``i``'s prompt is its last ``prompt_lengths[i]`` columns (``None``:
        all ``P``).

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


def check_prompts(prompts: Tensor, prompt_lengths: Tensor | None = None) -> Tensor:
    """Check ``prompts [B, P]`` and ``prompt_lengths [B]`` before any collective.

    Returns:
        ``[B]`` int64 prompt lengths (all ``P`` when ``prompt_lengths`` is ``None``).

    Raises:
        ValueError: ``prompts`` not integer ``[B, P]``; ``prompt_lengths`` not ``[B]`` integers
            in ``[1, P]``.
    """
    if prompts.ndim != 2 or prompts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"`prompts` must be integer [B, P], got {prompts.dtype} {tuple(prompts.shape)}"
        )
    batch, width = prompts.shape
    if prompt_lengths is None:
        return torch.full((batch,), width, dtype=torch.long)
    if prompt_lengths.shape != (batch,) or prompt_lengths.is_floating_point():
        raise ValueError(
            f"`prompt_lengths` must be integer [B={batch}], got {prompt_lengths.dtype} "
            f"{tuple(prompt_lengths.shape)}"
        )
    if batch and not bool(((prompt_lengths >= 1) & (prompt_lengths <= width)).all()):
        raise ValueError(
            f"`prompt_lengths` must lie in [1, P={width}], got {prompt_lengths.tolist()}"
        )
    return prompt_lengths.long()


def rollout_buffers(prompts: Tensor, sampling: SamplingConfig) -> tuple[Tensor, Tensor]:
    """The buffers a generating rank fills from column ``P`` on and then broadcasts: ``tokens
    [B, P+N]`` (int64: the prompts, then ``pad_token_id``) and ``logprobs [B, P+N]`` (fp32
    zeros). Every rank of the group makes them, so the broadcast has its shapes everywhere."""
    batch, prompt_width = prompts.shape
    width = prompt_width + sampling.max_new_tokens
    tokens = torch.full((batch, width), sampling.pad_token_id, dtype=torch.long)
    tokens[:, :prompt_width] = prompts
    return tokens, torch.zeros(batch, width, dtype=torch.float32)


def stop_completions(
    tokens: Tensor, logprobs: Tensor, prompt_width: int, sampling: SamplingConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """End each completion at its first stop token.

    Args:
        tokens: ``[B, P+N]`` the prompts' ``P`` columns, then ``N`` sampled tokens.
        logprobs: ``[B, P+N]`` the sampled tokens' logprobs (0 on the prompt columns).
        prompt_width: ``P``.
        sampling: its ``stop_token_ids`` and ``pad_token_id``.

    Returns:
        ``(tokens, completion_mask, logprobs)`` ``[B, P+N]``: positions after a row's first
        stop token hold ``pad_token_id``, mask 0 and logprob 0 (causal, so what was sampled
        there never influenced the kept tokens).
    """
    mask = torch.zeros_like(tokens)
    mask[:, prompt_width:] = 1
    if sampling.stop_token_ids:
        sampled = tokens[:, prompt_width:]
        stop = torch.isin(sampled, torch.tensor(sampling.stop_token_ids, dtype=sampled.dtype))
        after = (stop.long().cumsum(dim=1) - stop.long()) > 0  # past the first stop token
        mask[:, prompt_width:] = (~after).long()
        tokens = tokens.clone()
        tokens[:, prompt_width:] = sampled.masked_fill(after, sampling.pad_token_id)
        logprobs = logprobs.masked_fill(mask.eq(0), 0.0)
    return tokens, mask, logprobs


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

    def generate(
        self, prompts: Tensor, sampling: SamplingConfig, prompt_lengths: Tensor | None = None
    ) -> Rollout:
        """``generate(model, prompts, ...)`` with a CPU generator seeded by ``sampling.seed``;
        completions end at their first stop token (:func:`stop_completions`). A MoE model's
        routing is recorded (``Rollout.routed_experts``).

        Raises:
            ValueError: prompts of different lengths (the embedded sampler has no attention
                mask for left padding; use the ``"hf"`` backend).
        """
        lengths = check_prompts(prompts, prompt_lengths)
        if bool((lengths != prompts.shape[1]).any()):
            raise ValueError(
                "MegatronRolloutSource samples equal-length prompts only (no attention mask for "
                f"left padding); got prompt_lengths {lengths.tolist()} for P={prompts.shape[1]}. "
                "Use the 'hf' rollout backend for prompts of different lengths."
            )
        config = unwrap_model(self.model).config
        # MoE routing is recorded (for replay and the mismatch metric) unless a capacity factor
        # can drop experts, which leaves nothing to record for the dropped slots
        record = bool(getattr(config, "num_moe_experts", None)) and (
            getattr(config, "moe_expert_capacity_factor", None) is None
        )
        out = generate(
            self.model,
            prompts,
            max_new_tokens=sampling.max_new_tokens,
            generator=torch.Generator().manual_seed(sampling.seed),
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            kv_cache=self.kv_cache,
            record_routing=record,
        )
        tokens, mask, logprobs = stop_completions(
            out.tokens, out.logprobs, prompts.shape[1], sampling
        )
        return Rollout(tokens, mask, logprobs, lengths, out.routed_experts)

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """No-op: the source IS the training model (the stream is not consumed, so do not
        pass a collective export here; ``refit_required`` is ``False``)."""
