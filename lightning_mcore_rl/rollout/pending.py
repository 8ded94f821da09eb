"""Rollouts started now and collected later (asynchronous RL), and `OneRankRolloutSource`, the
base of the HF and vLLM sources. Shapes: ``B`` sequences, ``P`` prompt columns, ``N`` new tokens."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.rollout.source import (
    Rollout,
    SamplingConfig,
    check_prompts,
    rollout_buffers,
    stop_completions,
)


@runtime_checkable
class PendingRollout(Protocol):
    """A rollout being sampled: ``wait`` blocks this rank until its part is done (no
    collective); ``result`` returns the `Rollout` (collective over the source's group, once)."""

    def wait(self) -> None: ...

    def result(self) -> Rollout: ...


class ReadyRollout:
    """A `PendingRollout` already sampled (a source that samples in the foreground)."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    def wait(self) -> None:
        """Nothing to wait for."""

    def result(self) -> Rollout:
        """The rollout."""
        return self.rollout


@runtime_checkable
class BackgroundRolloutSource(Protocol):
    """A rollout source whose ``submit`` returns at once (no collective) while it samples."""

    def submit(
        self, prompts: Tensor, sampling: SamplingConfig, prompt_lengths: Tensor | None = None
    ) -> PendingRollout:
        """Start sampling as `RolloutSource.generate` would, with the weights at submission
        (refit only after the handle's ``wait()``)."""
        ...


class _Draw:
    """``fn`` run now or in a daemon thread, without autograd; its error kept for the result."""

    def __init__(self, fn: Callable[[], Tensor | None], background: bool, name: str) -> None:
        self.fn = fn
        self.value: Tensor | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        threads = torch.get_num_threads()
        if background:
            self.thread = threading.Thread(target=self._run, args=(threads,), name=name)
            self.thread.daemon = True
            self.thread.start()
        else:
            self._run(threads)

    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)  # a new thread starts with the process default
        try:
            with torch.no_grad():
                self.value = self.fn()
        except Exception as error:  # reported on every rank of the group by result()
            self.error = error

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()


class _Broadcast:
    """The `PendingRollout` of a `OneRankRolloutSource` (``draw`` ``None`` off the generator)."""

    def __init__(
        self,
        source: OneRankRolloutSource,
        tokens: Tensor,
        logprobs: Tensor,
        lengths: Tensor,
        sampling: SamplingConfig,
        draw: _Draw | None,
    ) -> None:
        self.source, self.tokens, self.logprobs = source, tokens, logprobs
        self.lengths, self.sampling, self.draw = lengths, sampling, draw
        self.taken = False

    def wait(self) -> None:
        if self.draw is not None:
            self.draw.wait()

    def result(self) -> Rollout:
        """Wait for the draw, then broadcast its outcome, the tokens, logprobs and routing.

        Raises:
            RuntimeError: the generator's sampling failed (on every rank); called twice.
            EngineDiedError: or another error with ``names_failed_process``, on every rank."""
        if self.taken:
            raise RuntimeError("PendingRollout.result() was already called.")
        self.taken = True
        self.wait()
        source, draw = self.source, self.draw
        routed = None if draw is None else draw.value
        status: list[Any] = [None, None, None]  # [error, routing shape, named failure]
        if draw is not None:
            named = getattr(draw.error, "names_failed_process", False)
            status = [
                None if draw.error is None else f"{type(draw.error).__name__}: {draw.error}",
                None if routed is None else tuple(routed.shape),
                draw.error if named else None,  # pickled to the group: the same error everywhere
            ]
        dist.broadcast_object_list(status, src=source.src, group=source.group)
        if status[2] is not None:  # the generator raises its own (with its traceback)
            raise status[2] if draw is None or draw.error is None else draw.error
        if status[0] is not None:
            raise RuntimeError(
                f"{type(source).__name__}: rank {source.src} could not sample: {status[0]}"
            ) from (None if draw is None else draw.error)
        dist.broadcast(self.tokens, src=source.src, group=source.group)
        dist.broadcast(self.logprobs, src=source.src, group=source.group)
        if status[1] is not None:
            if routed is None:
                routed = torch.empty(status[1], dtype=torch.long)
            dist.broadcast(routed, src=source.src, group=source.group)
        prompt_width = self.tokens.shape[1] - self.sampling.max_new_tokens
        tokens, mask, logprobs = stop_completions(
            self.tokens, self.logprobs, prompt_width, self.sampling
        )
        return Rollout(tokens, mask, logprobs, self.lengths, routed)


class OneRankRolloutSource(ABC):
    """A source whose generator, the first rank of ``group``, samples and broadcasts the
    rollout; subclasses set ``group``, ``src`` (its global rank), ``is_generator``, ``_draw``."""

    group: Any
    src: int

    @property
    @abstractmethod
    def is_generator(self) -> bool:
        """Whether this rank samples."""

    @abstractmethod
    def _draw(
        self, tokens: Tensor, logprobs: Tensor, lengths: Tensor, sampling: SamplingConfig
    ) -> Tensor | None:
        """On the generator: fill ``tokens``/``logprobs [B, P+N]`` from column ``P`` on, in place;
        the ``[B, P+N, L, K]`` routing of a MoE model, else ``None``."""

    def _start(
        self,
        prompts: Tensor,
        sampling: SamplingConfig,
        prompt_lengths: Tensor | None,
        background: bool,
    ) -> _Broadcast:
        lengths = check_prompts(prompts, prompt_lengths)
        tokens, logprobs = rollout_buffers(prompts, sampling)
        draw = None
        if self.is_generator:
            draw = _Draw(
                lambda: self._draw(tokens, logprobs, lengths, sampling),
                background,
                f"{type(self).__name__}-draw",
            )
        return _Broadcast(self, tokens, logprobs, lengths, sampling, draw)

    def generate(
        self, prompts: Tensor, sampling: SamplingConfig, prompt_lengths: Tensor | None = None
    ) -> Rollout:
        """Sample on the generator and broadcast (collective over ``group``).

        Raises:
            RuntimeError: the draw failed (on every rank of the group)."""
        return self._start(prompts, sampling, prompt_lengths, background=False).result()

    def submit(
        self, prompts: Tensor, sampling: SamplingConfig, prompt_lengths: Tensor | None = None
    ) -> PendingRollout:
        """`generate` with the draw in a background thread; the handle's ``result()`` broadcasts."""
        return self._start(prompts, sampling, prompt_lengths, background=True)
