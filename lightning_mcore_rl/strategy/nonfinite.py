"""The non-finite policy: skip (or stop at) a step whose inputs, loss or gradients are not finite.

Trainer-free; the strategy owns one :class:`NonFiniteGuard` and the optimizer adapter consults
it. Every decision is agreed by all ranks with ONE small all-reduce, so a skipped step is skipped
everywhere (no parameter, gradient-buffer-derived or optimizer-state change: megatron's
``step()`` is not called, which is megatron's own ``update_successful=False`` outcome):

* inputs (:meth:`NonFiniteGuard.check_inputs`, before the model runs): the host-side
  :func:`~lightning_mcore_rl.train.validation.validate_batch` verdict of each rank — an invalid
  batch on any rank makes every rank raise, a non-finite float (advantages, logprobs, masks...)
  skips the step, naming the key and first bad position on the rank that holds it;
* loss and gradients (:meth:`NonFiniteGuard.skip_update`, after the backward, before megatron's
  ``step()``): the sum of squares of every rank's DDP gradient buffers (fp32) and a flag for a
  non-finite loss, all-reduced once: NaN/inf in any gradient — or a norm that overflows, like
  megatron's — skips the step before megatron computes its norm, clips or updates anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

NonFinitePolicy = Literal["skip", "raise"]
NONFINITE_POLICIES: tuple[str, ...] = ("skip", "raise")

OK, NONFINITE, INVALID = 0, 1, 2
"""Input verdict codes, combined over ranks by MAX."""


class NonFiniteError(ValueError):
    """A non-finite input, loss or gradient under ``nonfinite="raise"``, or too many consecutive
    skipped steps under ``nonfinite="skip"``."""


class BatchRejectedError(ValueError):
    """Another rank rejected its batch (that rank raises the ``ValueError``/``TypeError`` naming
    the argument); this rank stops with it instead of waiting in the step's collectives."""


class NonFiniteWarning(UserWarning):
    """A training step was skipped because of a non-finite value."""


def check_policy(nonfinite: Any, max_consecutive_skips: Any) -> None:
    """Validate the strategy's ``nonfinite`` and ``max_consecutive_skips`` arguments."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"`nonfinite` must be one of {list(NONFINITE_POLICIES)}, got {nonfinite!r}."
        )
    if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int):
        raise TypeError(
            f"`max_consecutive_skips` must be an int, got {type(max_consecutive_skips).__name__}."
        )
    if max_consecutive_skips < 1:
        raise ValueError(f"`max_consecutive_skips` must be >= 1, got {max_consecutive_skips}.")


class NonFiniteGuard:
    """Per-run state of the non-finite policy (counts survive across ``fit`` calls).

    Args:
        policy: ``"skip"``: skip the step on every rank (logged as ``skipped_steps``), stop with
            :class:`NonFiniteError` after ``max_consecutive_skips`` consecutive skips;
            ``"raise"``: raise :class:`NonFiniteError` at the first one.
        max_consecutive_skips: consecutive skipped steps tolerated under ``"skip"``.
    """

    def __init__(self, policy: NonFinitePolicy = "skip", max_consecutive_skips: int = 10) -> None:
        check_policy(policy, max_consecutive_skips)
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.step_skipped = False
        self.chunks: Sequence[torch.nn.Module] = ()
        self.device: torch.device | str = "cpu"
        self._loss: torch.Tensor | None = None

    # ---------------------------------------------------------------- per step

    def begin_step(self, chunks: Sequence[torch.nn.Module], device: torch.device | str) -> None:
        """A new training step over ``chunks`` (their DDP grad buffers are checked)."""
        self.chunks, self.device = chunks, device
        self.step_skipped = False
        self._loss = None

    def note_loss(self, loss: torch.Tensor) -> None:
        """The step's loss (identical on every rank), checked in :meth:`skip_update`."""
        self._loss = loss

    def check_inputs(self, finding: Any, error: BaseException | None, *, training: bool) -> bool:
        """ONE all-reduce (MAX) of this rank's input verdict over all ranks.

        Args:
            finding: the rank's first non-finite entry
                (:class:`~lightning_mcore_rl.train.validation.NonFinite`) or ``None``.
            error: the rank's validation error, re-raised after the all-reduce.
            training: a training step (forward-only passes never skip).

        Returns:
            True: skip this step (every rank returns True).

        Raises:
            The rank's own validation error; :class:`BatchRejectedError` when only another rank
            rejected its batch; :class:`NonFiniteError` under ``"raise"`` or past the limit.
        """
        local = INVALID if error is not None else (NONFINITE if finding and training else OK)
        verdict = _all_reduce_max(local, self.device)
        if error is not None:
            raise error
        if verdict == INVALID:
            raise BatchRejectedError(
                "Another rank rejected its batch (see that rank's ValueError/TypeError naming "
                "the argument); this rank stops too instead of waiting in the step."
            )
        if verdict == NONFINITE:
            where = (
                f"non-finite input {finding.describe()} on this rank"
                if finding is not None
                else "a non-finite input on another data-parallel rank"
            )
            self._skip(where)
            return True
        return False

    def skip_update(self) -> bool:
        """Before megatron's ``step()``: True if the step must not update (skipped on input, or
        a non-finite loss/gradient found with ONE all-reduce over all ranks)."""
        if self.step_skipped:
            return True
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for chunk in self.chunks:
            for buffer in _grad_buffers(chunk):
                squares += torch.linalg.vector_norm(buffer.grad_data, dtype=torch.float32) ** 2
        loss = self._loss
        loss_bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        flags = torch.stack([squares, torch.tensor(float(loss_bad), device=squares.device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags)
        total, bad_loss = float(flags[0]), float(flags[1]) > 0
        if bad_loss:
            self._skip(f"a non-finite loss ({float(loss) if loss is not None else 'nan'})")
            return True
        if not torch.isfinite(torch.tensor(total)):
            self._skip(f"a non-finite gradient (sum of squares over all ranks: {total})")
            return True
        return False

    def after_update(self, update_successful: bool, grad_norm: float | None) -> None:
        """After megatron's ``step()``: its ``update_successful=False`` counts as a skipped step;
        a non-finite grad norm the pre-check could not see (it never is, short of an fp32
        overflow of the de-duplicated norm) is reported under the policy."""
        if not update_successful:
            self._skip("megatron's optimizer (update_successful=False)")
            return
        if grad_norm is not None and not torch.isfinite(torch.tensor(grad_norm)):
            self._skip(f"megatron's grad norm {grad_norm} (the update already ran)")
            return
        self.consecutive_skips = 0

    # ---------------------------------------------------------------- helpers

    def _skip(self, cause: str) -> None:
        if self.policy == "raise":
            raise NonFiniteError(
                f"Training step stopped by `nonfinite='raise'`: {cause}. Use "
                "`MCoreRLStrategy(nonfinite='skip')` to skip such steps instead."
            )
        self.step_skipped = True
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips > self.max_consecutive_skips:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive training steps skipped by "
                f"`nonfinite='skip'` (max_consecutive_skips={self.max_consecutive_skips}); the "
                f"last one: {cause}. Fix the data or the learning rate, or raise "
                "`MCoreRLStrategy(max_consecutive_skips=...)`."
            )
        warnings.warn(
            f"Skipped the training step (no parameter or optimizer-state change): {cause}; "
            f"{self.skipped_steps} skipped so far, {self.consecutive_skips} in a row "
            f"(nonfinite='skip', max_consecutive_skips={self.max_consecutive_skips}).",
            NonFiniteWarning,
            stacklevel=3,
        )


def _grad_buffers(chunk: torch.nn.Module) -> list[Any]:
    """Megatron DDP's gradient buffers (its ``buffers`` list shadows ``Module.buffers``)."""
    found: list[Any] = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, list):
            found.extend(value)
    return found


def _all_reduce_max(value: int, device: torch.device | str) -> int:
    flag = torch.tensor([value], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag[0])


__all__ = [
    "NONFINITE_POLICIES",
    "BatchRejectedError",
    "NonFiniteError",
    "NonFiniteGuard",
    "NonFinitePolicy",
    "NonFiniteWarning",
    "check_policy",
]
