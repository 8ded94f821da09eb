"""The rollout-source protocol (contract: ``docs/rollout.md``) and the embedded megatron sampler
as one. Shapes: ``B`` sequences, ``P`` prompt columns (left-padded), ``N`` new tokens."""

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
    """How one `RolloutSource.generate` call samples (the same prompts, weights and seed give the
    same tokens); a completion ends with (and includes) the first of ``stop_token_ids``, then
    ``pad_token_id``. ``top_k``/``top_p``: vLLM's filters, in its order (``None``/``1.0``: off)."""

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
        """The trainer's sampling parameters whose logprobs are this draw's (filtered)."""
        return TrainingSamplingParams(self.temperature, self.top_k, self.top_p)


class Rollout(NamedTuple):
    """Prompts plus sampled completions, identical on every rank that asked for them: row ``i``
    is ``P - prompt_lengths[i]`` pads, its prompt, its completion (to the stop token), pads.

    Attributes:
        tokens: ``[B, P+N]`` int64.
        completion_mask: ``[B, P+N]`` 1 at the completion's positions, 0 elsewhere.
        generation_logprobs: ``[B, P+N]`` fp32 ``log_softmax(logits / T)`` at completions, else 0.
        prompt_lengths: ``[B]`` int64 real prompt tokens.
        routed_experts: ``[B, P+N, L, K]`` int64 top-``K`` experts per MoE layer, or ``None``."""

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
    """Anything that samples completions of a policy (``refit_required``: own weights)."""

    # True: the source holds a copy of the weights that the trainer refreshes with update_weights
    # after every optimizer step; False: it generates with the training model (never refit)
    refit_required: ClassVar[bool]

    def generate(
        self, prompts: Tensor, sampling: SamplingConfig, prompt_lengths: Tensor | None = None
    ) -> Rollout:
        """Sample after each of the left-padded ``prompts [B, P]`` (``prompt_lengths [B]``;
        ``None``: all ``P``); collective over the source's group, same prompts everywhere."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Refit from ``(hf_name, full tensor)`` pairs (`HFBridge.export_hf_weights`), on every
        training rank; the source must consume the (collective) stream to the end."""
        ...


def check_prompts(prompts: Tensor, prompt_lengths: Tensor | None = None) -> Tensor:
    """Check ``prompts [B, P]`` and ``prompt_lengths [B]``; ``[B]`` int64 lengths (``None``: ``P``).

    Raises:
        ValueError: ``prompts`` not integer ``[B, P]``; lengths not ints in ``[1, P]``."""
    # called before any collective, so a bad batch fails on its own rank, not in a broadcast
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
    """``tokens [B, P+N]`` (the prompts, then ``pad_token_id``) and fp32 zero ``logprobs [B, P+N]``,
    which a generating rank fills from column ``P`` on and broadcasts."""
    # every rank of the group makes them, so the broadcast has its shapes everywhere
    batch, prompt_width = prompts.shape
    width = prompt_width + sampling.max_new_tokens
    tokens = torch.full((batch, width), sampling.pad_token_id, dtype=torch.long)
    tokens[:, :prompt_width] = prompts
    return tokens, torch.zeros(batch, width, dtype=torch.float32)


def stop_completions(
    tokens: Tensor, logprobs: Tensor, prompt_width: int, sampling: SamplingConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """End each completion of ``tokens``/``logprobs [B, P+N]`` at its first stop token:
    ``(tokens, completion_mask, logprobs)`` ``[B, P+N]``, pad/0/0 after it."""
    # causal: what was sampled after the stop token never influenced the kept tokens
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
    """The embedded sampler (`generate`) as a `RolloutSource`: it runs the training chunk itself,
    so refitting is a no-op."""

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
        """`generate` seeded by ``sampling.seed``, ended at stop tokens, a MoE's routing recorded.

        Raises:
            ValueError: prompts of different lengths."""
        lengths = check_prompts(prompts, prompt_lengths)
        # the embedded sampler has no attention mask for left padding (the "hf" backend has)
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
        """No-op: the source IS the training model (the stream is not consumed)."""
