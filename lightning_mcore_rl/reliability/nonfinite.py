"""The non-finite policy: skip (or stop at) a training step whose inputs, loss, gradients or
update are not finite, the same decision on every rank (`NonFiniteGuard`)."""

# The guard's three hooks into the step: `check_batch` (the input agreement, before the model
# runs), `check_loss` (the training pass's loss) and `check_update` (megatron's step, consulting
# an `UpdateChecks` between its gradient norm and its update). The strategy marks a fit's start
# and end and a training step's start; no other object writes the guard's fields.

# A skipped step changes no parameter or optimizer state: megatron's update is not run, which is
# megatron's own `update_successful=False` outcome. Inputs: an invalid batch on any rank makes
# every rank raise; a non-finite float skips the step, named on the rank that holds it.
# Gradients: megatron's global norm, computed once between `prepare_grads` and the clipping
# (strategy/optimizer.py:megatron_step), is NaN/inf when any gradient on any rank is. The update:
# certified for torch's Adam/AdamW by a bound (update_bound.py), else previewed for torch's
# Adam/AdamW/SGD (update_preview.py: not run when it fails), else
# snapshotted and undone (update_check.py). A gradient norm of exactly 0 for
# `collapse_warning_steps` steps in a row warns: the model learns nothing.

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar

import torch

from lightning_mcore_rl.reliability.agreement import (
    INVALID,
    NONFINITE,
    OK,
    RankInput,
    StepBoundary,
    agreed_verdict,
    gather_inputs,
    gather_rejections,
    rejected_ranks,
)
from lightning_mcore_rl.reliability.update_bound import certify_update
from lightning_mcore_rl.reliability.update_check import (
    UpdateSnapshot,
    update_failure,
    update_measures,
)
from lightning_mcore_rl.reliability.update_preview import preview_measures, previewable

NonFinitePolicy = Literal["skip", "raise"]
_R = TypeVar("_R", bound="StepResult")
NONFINITE_POLICIES: tuple[str, ...] = ("skip", "raise")


class NonFiniteError(ValueError):
    """A non-finite input, loss or gradient under `nonfinite="raise"`, or too many consecutive
    skipped steps under `nonfinite="skip"`."""


class BatchRejectedError(ValueError):
    """Another rank rejected its batch; this rank stops too, its message carrying the rejecting
    ranks' reasons (`batch_rejection`), instead of waiting in the step's collectives."""


def batch_rejection(error: BaseException | None, group: Any, where: str = "") -> BaseException:
    """What a rank raises once the agreement showed that some rank rejected its batch: its own
    `error` (`None`: its batch was fine), else a `BatchRejectedError` naming each rejecting rank
    and its reason (collective over `group`; `where`: context, e.g. `" in DPOModule"`)."""
    reasons = gather_rejections(error, group)
    if error is not None:
        # rank 0 prints a BatchRejectedError, so this rank prints the cause itself (`rank_local`:
        # rank_errors.py) rather than a "see rank 0's traceback" pointer
        if 0 not in reasons:
            with contextlib.suppress(AttributeError):  # an exception type with __slots__
                error.rank_local = True  # type: ignore[attr-defined]
        return error
    listing = "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(reasons.items()))
    return BatchRejectedError(
        f"Another rank rejected its batch{where} ({listing}); this rank stops too instead of "
        "waiting in the step (the rejecting rank's traceback shows where)."
    )


class StepResult(Protocol):
    """What megatron's step returned (`strategy/optimizer.py:MegatronStepResult`)."""

    @property
    def update_successful(self) -> bool: ...

    @property
    def grad_norm(self) -> float | None: ...


class NonFiniteWarning(UserWarning):
    """A training step was skipped because of a non-finite value."""


class CollapseWarning(UserWarning):
    """The gradient norm was exactly 0 for `collapse_warning_steps` consecutive steps."""


def check_policy(nonfinite: Any, max_consecutive_skips: Any) -> None:
    """Validate `ReliabilityConfig`'s `nonfinite` and `max_consecutive_skips`."""
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


def check_update_options(
    verify_updates: Any, max_update_ratio: Any, collapse_warning_steps: Any
) -> None:
    """Validate `ReliabilityConfig`'s `verify_updates`, `max_update_ratio` and
    `collapse_warning_steps`."""
    if not isinstance(verify_updates, bool):
        raise TypeError(f"`verify_updates` must be a bool, got {verify_updates!r}.")
    if max_update_ratio is not None:
        if isinstance(max_update_ratio, bool) or not isinstance(max_update_ratio, (int, float)):
            raise TypeError(
                f"`max_update_ratio` must be a number or None, got "
                f"{type(max_update_ratio).__name__}."
            )
        if not math.isfinite(max_update_ratio) or max_update_ratio <= 0:
            raise ValueError(
                f"`max_update_ratio` must be a finite number > 0 or None, got {max_update_ratio}."
            )
    steps = collapse_warning_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
        raise TypeError(
            f"`collapse_warning_steps` must be an int or None, got {type(steps).__name__}."
        )
    if steps is not None and steps < 1:
        raise ValueError(f"`collapse_warning_steps` must be >= 1 or None, got {steps}.")


class NonFiniteGuard:
    """Per-run state of the non-finite policy (counts survive across `fit` calls).

    Args:
        policy: `"skip"` the step on every rank (stop after `max_consecutive_skips` in a row) or
            `"raise"` `NonFiniteError` at the first one.
        max_consecutive_skips: consecutive skipped steps tolerated under `"skip"`.
        verify_updates: check every update (`UpdateChecks`): a failing one is not run, or undone.
        max_update_ratio: an update norm above this multiple of the parameters' norm fails.
        collapse_warning_steps: warn after this many steps in a row with a gradient norm of 0.
    """

    def __init__(
        self,
        policy: NonFinitePolicy = "skip",
        max_consecutive_skips: int = 10,
        *,
        verify_updates: bool = True,
        max_update_ratio: float | None = 1e3,
        collapse_warning_steps: int | None = 5,
    ) -> None:
        check_policy(policy, max_consecutive_skips)
        check_update_options(verify_updates, max_update_ratio, collapse_warning_steps)
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.verify_updates = verify_updates
        self.max_update_ratio = max_update_ratio
        self.collapse_warning_steps = collapse_warning_steps
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.zero_grad_steps = 0
        self.step_skipped = False
        self.fit_steps = 0  # training steps of the current fit (begin_fit), skipped ones too
        self.fit_skipped_steps = 0
        self.last_skip_cause = ""
        self._loss: torch.Tensor | None = None

    @classmethod
    def from_config(cls, reliability: Any) -> NonFiniteGuard:
        """The guard of a `ReliabilityConfig`."""
        return cls(
            reliability.nonfinite,
            reliability.max_consecutive_skips,
            verify_updates=reliability.verify_updates,
            max_update_ratio=reliability.max_update_ratio,
            collapse_warning_steps=reliability.collapse_warning_steps,
        )

    # ---------------------------------------------------------------- per fit

    def begin_fit(self) -> None:
        """A new fit: `check_fit_end` judges this fit's steps only."""
        # the run's totals and the consecutive-skip streak carry on
        self.fit_steps = 0
        self.fit_skipped_steps = 0

    def check_fit_end(self) -> None:
        """At the end of a fit that was not stopped: a fit that updated, then ended in a streak
        of skips, warns (`NonFiniteWarning`).

        Raises:
            NonFiniteError: every one of this fit's training steps was skipped.
        """
        if self.fit_steps == 0 or self.consecutive_skips == 0:
            return
        # such a fit trained nothing and only ended before `max_consecutive_skips` because it was
        # short (e.g. 5 steps at lr=1e4, each update rejected); the skips are agreed, so every
        # rank raises
        if self.fit_skipped_steps == self.fit_steps:
            raise NonFiniteError(
                f"Every training step of this fit was skipped ({self.fit_skipped_steps} of "
                f"{self.fit_steps}; the last: {self.last_skip_cause}): the weights never "
                f"changed. The fit ended before `max_consecutive_skips="
                f"{self.max_consecutive_skips}` would have stopped it. Fix the data or the "
                "learning rate (a too large one makes every update fail the update check)."
            )
        warnings.warn(
            f"The fit ended with {self.consecutive_skips} consecutive skipped training steps "
            f"(the last: {self.last_skip_cause}); the weights are those of the last update "
            f"before them ({self.fit_steps - self.fit_skipped_steps} of this fit's "
            f"{self.fit_steps} steps updated).",
            NonFiniteWarning,
            stacklevel=2,
        )

    # ---------------------------------------------------------------- per step

    def begin_step(self) -> None:
        """A new training step: nothing skipped and no loss noted yet."""
        self.step_skipped = False
        self.fit_steps += 1
        self._loss = None

    def check_loss(self, loss: torch.Tensor) -> None:
        """The training pass's loss (identical on every rank), judged when `check_update` starts."""
        self._loss = loss

    def check_batch(
        self,
        finding: Any,
        error: BaseException | None,
        summary: Any = None,
        *,
        training: bool,
        replica: int = 0,
        boundary: StepBoundary | None = None,
        device: torch.device | str = "cpu",
        group: Any = None,
    ) -> bool:
        """The input agreement: ONE all-gather over `group` (on `device`) of this rank's verdict
        and batch `summary` (`agreement.py`), carrying the training step's `boundary`; True:
        skip this step (on every rank).

        Args:
            finding: the rank's first non-finite entry (`train/validation.py:NonFinite`) or None.
            error: the rank's validation error, re-raised after the collective.
            training: a training pass (forward-only passes never skip).
            replica: this rank's data-parallel rank.

        Raises:
            The rank's own validation error; `BatchRejectedError` (another rank rejected its
            batch); `BatchMismatchError` (row counts, or one replica's batches, differ);
            `NonFiniteError` under `"raise"` or past the limit.
        """
        local = INVALID if error is not None else (NONFINITE if finding and training else OK)
        entry = RankInput(local, replica)
        if summary is not None:
            entry = RankInput(local, replica, summary.rows, summary.width, summary.fingerprint)
        if boundary is not None:
            entry = boundary.stamp(entry)
        table = gather_inputs(entry, device, group)
        if boundary is not None:
            boundary.settle(table)
        rejecting = rejected_ranks(table)
        if len(rejecting) == len(table) and error is not None:
            raise error  # every rank rejected: each raises its own, rank 0's names the cause
        if rejecting:
            raise batch_rejection(error, group)  # every rank: the reasons are gathered
        verdict = agreed_verdict(table)
        if verdict == NONFINITE:
            where = (
                f"non-finite input {finding.describe()} on this rank"
                if finding is not None
                else "a non-finite input on another data-parallel rank"
            )
            self._skip(where)
            return True
        return False

    def check_update(
        self,
        run: Callable[[UpdateChecks], _R],
        *,
        device: torch.device | str = "cpu",
        group: Any = None,
    ) -> _R | None:
        """The optimizer step: `None` (megatron's step not run) when the step is already skipped
        or its loss is not finite; else `run(checks)`, megatron's step consulting an
        `UpdateChecks` whose all-reduce runs on `device` over `group`."""
        if self.step_skipped:
            return None
        loss = self._loss
        if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
            self._skip(f"a non-finite loss ({float(loss)})")
            return None
        result = run(UpdateChecks(self, device, group))
        # an unsuccessful update is a skipped step; a norm of exactly 0 counts towards collapse
        if result.update_successful:
            self.consecutive_skips = 0
        elif not self.step_skipped:
            self._skip("megatron's optimizer (update_successful=False)")
        self._note_grad_norm(result.grad_norm)
        return result

    def _note_grad_norm(self, grad_norm: float | None) -> None:
        if grad_norm is None or grad_norm != 0.0:
            self.zero_grad_steps = 0
            return
        self.zero_grad_steps += 1
        if self.zero_grad_steps == self.collapse_warning_steps:
            warnings.warn(
                f"The gradient norm has been exactly 0 for {self.zero_grad_steps} consecutive "
                "steps: the model learns nothing (a saturated model, e.g. after a too large "
                "learning rate, or no learning signal: every advantage 0). Check the learning "
                "rate and the rewards; `ReliabilityConfig(collapse_warning_steps=...)` sets "
                "when this warns.",
                CollapseWarning,
                stacklevel=3,
            )

    # ---------------------------------------------------------------- helpers

    def _skip(self, cause: str) -> None:
        if self.policy == "raise":
            raise NonFiniteError(
                f"Training step stopped by `nonfinite='raise'`: {cause}. Use "
                "`MCoreRLStrategy(reliability=ReliabilityConfig(nonfinite='skip'))` to skip such "
                "steps instead."
            )
        if not self.step_skipped:  # one step may be judged more than once: count it once
            self.fit_skipped_steps += 1
        self.step_skipped = True
        self.last_skip_cause = cause
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


class UpdateChecks:
    """What megatron's step asks between its gradient norm and its update, for one optimizer
    step of `guard` (a failing check skips the step); collectives on `device` over `group`."""

    def __init__(self, guard: NonFiniteGuard, device: torch.device | str, group: Any) -> None:
        self._guard = guard
        self._device = device
        self._group = group
        self._grad_norm: float | None = None  # megatron's, once `grad_norm_fails` saw it

    def grad_norm_fails(self, grad_norm: float) -> bool:
        """True (skip) if megatron's global gradient norm is NaN/inf."""
        # NaN/inf: a non-finite gradient on any rank, or a norm that overflows
        if math.isfinite(grad_norm):
            self._grad_norm = grad_norm  # bounds every clipped gradient entry: update_bound.py
            return False
        self._guard._skip(f"a non-finite gradient (megatron's global grad norm: {grad_norm})")
        return True

    def reject_before_update(self, optimizer: Any) -> bool:
        """Before megatron's update (gradients clipped): True (not run, the step skipped) when
        the previewed update leaves a NaN/inf weight or state entry on any rank or exceeds
        `max_update_ratio` (one all-reduce); False, nothing run, if it cannot be previewed."""
        guard = self._guard
        # torch's Adam/AdamW/SGD only (update_preview.py); others get `snapshot`/`reject_update`
        if not guard.verify_updates or not previewable(optimizer):
            return False
        # Adam/AdamW: a bound proves most updates pass from one read of the parameters, gradients
        # and moments (update_bound.py); the exact preview runs only where it cannot
        ratio = guard.max_update_ratio
        # this step's norm only: never a stale one (None: the certificate reads the gradients)
        grad_norm, self._grad_norm = self._grad_norm, None
        if certify_update(optimizer, self._device, self._group, ratio, grad_norm):
            return False
        cause = update_failure(
            preview_measures(optimizer, self._device, self._group), guard.max_update_ratio
        )
        if cause is None:
            return False
        guard._skip(f"{cause}; the update was not applied (parameters and optimizer state kept)")
        return True

    def snapshot(self, optimizer: Any, params: Any) -> UpdateSnapshot | None:
        """Before megatron's update: what it writes, copied (`None`: updates not verified, or
        verified by `reject_before_update`)."""
        if not self._guard.verify_updates or previewable(optimizer):
            return None
        return UpdateSnapshot.take(optimizer, params)

    def reject_update(self, snapshot: UpdateSnapshot | None) -> bool:
        """After megatron's update: True (undone from `snapshot`, the step skipped) when it left
        a NaN/inf weight or state entry on any rank or exceeded `max_update_ratio` (one
        all-reduce)."""
        if snapshot is None:
            return False
        cause = update_failure(
            update_measures(snapshot, self._device, self._group), self._guard.max_update_ratio
        )
        if cause is None:
            return False
        snapshot.restore()
        self._guard._skip(
            f"{cause}; the update was undone (parameters and optimizer state restored)"
        )
        return True


__all__ = [
    "NONFINITE_POLICIES",
    "BatchRejectedError",
    "CollapseWarning",
    "NonFiniteError",
    "NonFiniteGuard",
    "NonFinitePolicy",
    "NonFiniteWarning",
    "StepResult",
    "UpdateChecks",
    "batch_rejection",
    "check_policy",
    "check_update_options",
]
