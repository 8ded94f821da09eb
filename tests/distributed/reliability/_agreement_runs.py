"""Rank functions of the agreement and update-check tests: real ``Trainer.fit`` runs (the tiny
GPT of :mod:`_reliability_runs` and the GRPO recipe) with the batches, rewards, learning rates
and optimizer state made wrong by hand on one rank or all."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _reliability_runs import (
    GRPO,
    VOCAB,
    Rollouts,
    S,
    Snapshots,
    _trainer,
    bitwise_equal,
    count_collectives,
    rollout_batch,
    uncount,
)
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule
from lightning_mcore_rl.rollout import ModularCountingTask
from lightning_mcore_rl.strategy import MegatronDDPConfig, MicrobatchConfig, ReliabilityConfig

MAX_POSITIONS = 64  # tiny_gpt's default max_sequence_length (learned positions)


def _error(call: Any) -> tuple[str, int, float]:
    """``(type: message, collectives, seconds)`` of ``call()`` (``""`` if it did not raise)."""
    counts = count_collectives()
    start = time.monotonic()
    try:
        call()
        message = ""
    except Exception as err:  # noqa: BLE001 - the message is the result
        message = f"{type(err).__name__}: {err}"
    finally:
        uncount(counts)
    return message, counts["n"], time.monotonic() - start


def mismatch_rank(rank: int) -> dict[str, Any]:
    """TP=2 (one replica of two ranks): a 1-step fit builds the model, then the real strategy
    step gets (a) the same batch on both ranks, (b) different data of the same shape, (c)
    different row counts, (d) different widths, (e) rows wider than the position table, (f)
    those on rank 1 only."""
    trainer = _trainer(
        1,
        MCoreRLStrategy(
            tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=1)
        ),
    )
    module = GRPO()
    trainer.fit(module, DataLoader(Rollouts(4), batch_size=2))
    wide = rollout_batch(2, seed=3)
    extra = MAX_POSITIONS + 1 - S
    for key, value in wide.items():
        if value.dim() == 2:
            wide[key] = torch.cat([value, torch.zeros(2, extra, dtype=value.dtype)], dim=1)
    cases = {
        "same": rollout_batch(2, seed=5),
        "data": rollout_batch(2, seed=5 + rank),
        "rows": rollout_batch(2 + 2 * rank, seed=5),
        "width": {
            k: v[:, : S - rank] if v.dim() == 2 else v for k, v in rollout_batch(2, seed=5).items()
        },  # fmt: skip
        "positions": wide,
    }
    out = {name: _error(lambda b=batch: module.forward_backward(b)) for name, batch in
           cases.items()}  # fmt: skip
    # (f) rows wider than the position table on rank 1 only: rank 0's error must carry the cause
    counts = count_collectives()
    try:
        module.forward_backward(wide if rank == 1 else rollout_batch(2, seed=5))
        error, local = "", False
    except Exception as err:  # noqa: BLE001 - the message is the result
        error, local = f"{type(err).__name__}: {err}", getattr(err, "rank_local", False)
    finally:
        uncount(counts)
    out["positions_rank1"] = (error, local, counts["n"])
    return out


def dp_rows_rank(rank: int) -> dict[str, Any]:
    """DP=2 under ``Trainer.fit``: rank 0's loader yields 4 rows a step, rank 1's 2 (the
    strategy's timeout 120 s: the error must come long before it)."""
    strategy = MCoreRLStrategy(
        microbatching=MicrobatchConfig(micro_batch_size=1),
        reliability=ReliabilityConfig(timeout=timedelta(seconds=120)),
    )
    trainer = _trainer(2, strategy)
    loader = DataLoader(Rollouts(8), batch_size=4 if rank == 0 else 2)
    return dict(zip(("error", "collectives", "seconds"),
                    _error(lambda: trainer.fit(GRPO(), loader)), strict=True))  # fmt: skip


# ---------------------------------------------------------------------- the GRPO recipe


_REWARD_CALLS = {"n": 0}


@dataclass(frozen=True)
class NaNRewardTask(ModularCountingTask):
    """The counting task, but at its second call (step 1) rank 1 scores completion 2 NaN."""

    def rewards(self, tokens: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
        rewards = super().rewards(tokens, completion_mask)
        _REWARD_CALLS["n"] += 1
        if _REWARD_CALLS["n"] == 2 and dist.get_rank() == 1:
            rewards[2] = float("nan")
        return rewards


class RecipeSnapshots(Snapshots):
    """:class:`Snapshots` (parameters + Adam state at the start and the end of each step: the
    end is where ``ModelCheckpoint`` saves) plus, per step: skipped? and the grad norm."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[bool, float | None]] = []
        self.corrupt_adam_at: int | None = None

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, idx: int) -> None:
        if idx == self.corrupt_adam_at and dist.get_rank() == 1:
            state = trainer.strategy.megatron_optimizer.optimizer.state
            moments = next(iter(state.values()))
            moments["exp_avg_sq"].view(-1)[:4] = -1.0  # a flipped sign bit: sqrt -> NaN
        super().on_train_batch_start(trainer, module, batch, idx)

    def on_train_batch_end(self, trainer: Trainer, module: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, module, *args)
        last = trainer.strategy.last_optimizer_step
        self.steps.append((bool(trainer.strategy.nonfinite_guard.step_skipped),
                           None if last is None else last.grad_norm))  # fmt: skip


def _recipe_fit(
    module: GRPOModule, steps: int, tp: int, snaps: RecipeSnapshots, **reliability: Any
) -> dict[str, Any]:
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=tp, microbatching=MicrobatchConfig(micro_batch_size=16),
        reliability=ReliabilityConfig(**reliability),
    )  # fmt: skip
    trainer = _trainer(steps, strategy, callbacks=[snaps], limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, datamodule=PromptDataModule(num_steps=steps))
            error = ""
        except Exception as err:  # noqa: BLE001 - the message is the result
            error = f"{type(err).__name__}: {err}"
    return {
        "error": error,
        "steps": snaps.steps,
        "unchanged": [bitwise_equal(b, a) for b, a in zip(snaps.before, snaps.after,
                                                           strict=False)],  # fmt: skip
        "first_is_last": bitwise_equal(snaps.before[0], snaps.after[-1]) if snaps.after else None,
        "skipped_logged": [m.get("skipped_steps") for m in snaps.logged],
        "global_step": trainer.global_step,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught
                     if "Skipped" in str(w.message) or "Non-finite rewards" in str(w.message)],
    }  # fmt: skip


def nan_reward_rank(rank: int) -> dict[str, Any]:
    """GRPO, DP=2, 3 steps: rank 1's step-1 rollout has one NaN reward."""
    return _recipe_fit(GRPOModule(task=NaNRewardTask()), 3, 1, RecipeSnapshots())


def huge_lr_rank(rank: int) -> dict[str, Any]:
    """GRPO, TP=2 (the main job's layout), lr=1e8, ``max_consecutive_skips=2``."""
    return _recipe_fit(GRPOModule(lr=1e8), 4, 2, RecipeSnapshots(), max_consecutive_skips=2)


def corrupt_adam_rank(rank: int) -> dict[str, Any]:
    """The tiny GPT's GRPO step, DP=2: after step 0, rank 1's Adam ``exp_avg_sq`` gets 4
    negative entries (rank 0's replica is intact); ``max_consecutive_skips=1``."""
    snaps = RecipeSnapshots()
    snaps.corrupt_adam_at = 1
    strategy = MCoreRLStrategy(
        microbatching=MicrobatchConfig(micro_batch_size=1),
        reliability=ReliabilityConfig(max_consecutive_skips=1),
    )
    trainer = _trainer(4, strategy, callbacks=[snaps])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        message, _, _ = _error(lambda: trainer.fit(GRPO(), DataLoader(Rollouts(16), batch_size=2)))
    return {
        "error": message,
        "steps": snaps.steps,
        "unchanged": [
            bitwise_equal(b, a) for b, a in zip(snaps.before, snaps.after, strict=False)
        ],  # fmt: skip
    }


# ---------------------------------------------------------------------- bf16 updates


class NotPreviewedAdamW(torch.optim.AdamW):
    """Stands in for an inner optimizer the update preview does not know (Transformer Engine's
    fused Adam, which cannot run here): the update check copies the state and undoes."""


class EveryCopy(Callback):
    """Per step: skipped?, and the model's (bf16) parameters, megatron's fp32 main parameters
    and the Adam state bitwise unchanged over it? ``swap``: the inner optimizers become
    :class:`NotPreviewedAdamW` at fit start."""

    def __init__(self, swap: bool) -> None:
        self.swap = swap
        self.steps: list[tuple[bool, bool]] = []
        self.before: list[torch.Tensor] = []

    def _inner(self, trainer: Trainer) -> list[Any]:
        optimizer = trainer.strategy.megatron_optimizer
        return [m.optimizer for m in getattr(optimizer, "chained_optimizers", [optimizer])]

    def _state(self, trainer: Trainer) -> list[torch.Tensor]:
        params = [p.detach().clone() for c in trainer.strategy.model_chunks for p in c.parameters()]
        for inner in self._inner(trainer):
            params += [p.detach().clone() for g in inner.param_groups for p in g["params"]]
            params += [v.clone() for s in inner.state.values() for v in s.values()
                       if torch.is_tensor(v)]  # fmt: skip
        return params

    def on_train_start(self, trainer: Trainer, module: Any) -> None:
        if self.swap:
            for inner in self._inner(trainer):
                inner.__class__ = NotPreviewedAdamW

    def on_train_batch_start(self, trainer: Trainer, *_: Any) -> None:
        self.before = self._state(trainer)

    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        skipped = bool(trainer.strategy.nonfinite_guard.step_skipped)
        self.steps.append((skipped, bitwise_equal(self.before, self._state(trainer))))


class HugeLR(GRPO):
    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(self.parallel_groups, calculate_per_token_loss=True, bf16=True)
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e8, adam_eps=1e-4, weight_decay=0.0)


def bf16_huge_lr_rank(rank: int) -> dict[str, Any]:
    """DP=2 under ``bf16-mixed``, lr=1e8, 2 steps, three fits: the distributed optimizer
    (previewed), plain DDP (previewed), plain DDP with :class:`NotPreviewedAdamW` (snapshot)."""
    out = {}
    for name, distributed, swap in (("zero", True, False), ("ddp", False, False),
                                    ("snapshot", False, True)):  # fmt: skip
        record = EveryCopy(swap)
        strategy = MCoreRLStrategy(
            microbatching=MicrobatchConfig(micro_batch_size=1),
            ddp=MegatronDDPConfig(use_distributed_optimizer=distributed),
            reliability=ReliabilityConfig(max_consecutive_skips=3),
        )
        trainer = _trainer(2, strategy, callbacks=[record], precision="bf16-mixed")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # 2 steps, both rejected, under max_consecutive_skips=3: the fit's end raises
            loader = DataLoader(Rollouts(8), batch_size=2)
            message, _, _ = _error(lambda t=trainer, d=loader: t.fit(HugeLR(), d))
        out[name] = {
            "steps": record.steps,
            "warnings": [str(w.message) for w in caught if "Skipped" in str(w.message)],
            "error": message,
        }
    return out


# ---------------------------------------------------------------------- collapse


class ZeroAdvantages(Callback):
    def __init__(self) -> None:
        self.grad_norms: list[float | None] = []

    def on_train_batch_end(self, trainer: Trainer, module: Any, *args: Any) -> None:
        last = trainer.strategy.last_optimizer_step
        self.grad_norms.append(None if last is None else last.grad_norm)


def collapse_rank(rank: int, steps: int, after: int) -> dict[str, Any]:
    """DP=2, every advantage 0 and no KL: the policy-gradient loss has gradient exactly 0;
    ``ReliabilityConfig(collapse_warning_steps=after)``."""
    data = Rollouts(4 * steps)
    data.data["advantages"].zero_()
    module = GRPO()
    module.loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    record = ZeroAdvantages()
    strategy = MCoreRLStrategy(
        microbatching=MicrobatchConfig(micro_batch_size=1),
        reliability=ReliabilityConfig(collapse_warning_steps=after),
    )
    trainer = _trainer(steps, strategy, callbacks=[record])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=2))
    return {
        "grad_norms": record.grad_norms,
        "warnings": [str(w.message) for w in caught if w.category.__name__ == "CollapseWarning"],
    }
