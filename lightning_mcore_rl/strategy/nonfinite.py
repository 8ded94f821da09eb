"""The non-finite policy: skip (or stop at) a step whose inputs, loss or gradients are not finite.

Trainer-free; the strategy owns one :class:`NonFiniteGuard` and the optimizer adapter consults
it. Every rank takes the same decision, so a skipped step is skipped everywhere (no parameter or
optimizer-state change: megatron's update is not run, which is megatron's own
``update_successful=False`` outcome):

* inputs (:meth:`NonFiniteGuard.check_inputs`, before the model runs): the host-side
  :func:`~lightning_mcore_rl.train.validation.validate_batch` verdict of each rank — an invalid
  batch on any rank makes every rank raise, a non-finite float (advantages, logprobs, masks...)
  skips the step, naming the key and first bad position on the rank that holds it;
* the loss (:meth:`NonFiniteGuard.skip_before_update`, after the backward; identical on every
  rank) and the gradients (:meth:`NonFiniteGuard.skip_on_grad_norm`): megatron's own global
  gradient norm, computed once by the optimizer adapter's step
  (:func:`~lightning_mcore_rl.strategy.optimizer.megatron_step`) between ``prepare_grads`` and
  the clipping — NaN/inf in any gradient on any rank, or a norm that overflows, skips the step
  before anything is clipped or updated.
"""

from __future__ import annotations

import math
import warnings
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
    """Validate ``ReliabilityConfig``'s ``nonfinite`` and ``max_consecutive_skips``."""
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
        self.device: torch.device | str = "cpu"
        self.group: Any = None  # the strategy's world group (None: the default group)
        self._loss: torch.Tensor | None = None

    # ---------------------------------------------------------------- per step

    def begin_step(self, device: torch.device | str, group: Any = None) -> None:
        """A new training step (collectives of :meth:`check_inputs` on ``device``, over
        ``group``: the strategy's world group, bounded by its timeout)."""
        self.device = device
        self.group = group
        self.step_skipped = False
        self._loss = None

    def note_loss(self, loss: torch.Tensor) -> None:
        """The step's loss (identical on every rank), checked in :meth:`skip_before_update`."""
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
        verdict = _all_reduce_max(local, self.device, self.group)
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

    def skip_before_update(self) -> bool:
        """Before megatron's optimizer step: True if the step must not update (skipped on
        input, or a non-finite loss; the loss is identical on every rank, so is the verdict)."""
        if self.step_skipped:
            return True
        loss = self._loss
        if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
            self._skip(f"a non-finite loss ({float(loss)})")
            return True
        return False

    def skip_on_grad_norm(self, grad_norm: float) -> bool:
        """Between megatron's gradient norm and its update: True (skip) if the norm is NaN/inf
        — any non-finite gradient on any rank, or a norm that overflows."""
        if math.isfinite(grad_norm):
            return False
        self._skip(f"a non-finite gradient (megatron's global grad norm: {grad_norm})")
        return True

    def after_update(self, update_successful: bool) -> None:
        """After megatron's step: ``update_successful=False`` counts as a skipped step."""
        if update_successful:
            self.consecutive_skips = 0
        elif not self.step_skipped:
            self._skip("megatron's optimizer (update_successful=False)")

    # ---------------------------------------------------------------- helpers

    def _skip(self, cause: str) -> None:
        if self.policy == "raise":
            raise NonFiniteError(
                f"Training step stopped by `nonfinite='raise'`: {cause}. Use "
                "`MCoreRLStrategy(reliability=ReliabilityConfig(nonfinite='skip'))` to skip such "
                "steps instead."
            )
        self.step_skipped = True
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips > self.max_consecutive_skips:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive training steps skipped by "
                f"`nonfinite='skip'` (max_consecutive_skips={self.max_consecutive_skips}); the "
                f"last one: {cause}. Fix the data or the learning rate, or raise "
                "`MCoreRLStrategy(reliability=ReliabilityConfig(max_consecutive_skips=...))`."
            )
        warnings.warn(
            f"Skipped the training step (no parameter or optimizer-state change): {cause}; "
            f"{self.skipped_steps} skipped so far, {self.consecutive_skips} in a row "
            f"(nonfinite='skip', max_consecutive_skips={self.max_consecutive_skips}).",
            NonFiniteWarning,
            stacklevel=3,
        )


def _all_reduce_max(value: int, device: torch.device | str, group: Any) -> int:
    flag = torch.tensor([value], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
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
