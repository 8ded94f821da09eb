"""Rank functions of the reliability tests: real ``Trainer.fit`` runs of the tiny GPT on gloo
ranks with faults injected by hand (non-finite data and weights, a failing rank, interrupted
checkpoint replacement, rejected batches)."""

from __future__ import annotations

import errno
import os
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.strategy import MicrobatchConfig, ReliabilityConfig, ResumableLoader

VOCAB = 64
S = 12
PG_CFG = {"reference_policy_kl_penalty": 0.01, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2}
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "barrier", "broadcast_object_list", "all_gather_object", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "reduce", "gather", "scatter",
)  # fmt: skip


def rollout_batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, S + 1, (rows,), generator=g)
    positions = torch.arange(S)[None, :]
    real = positions < lengths[:, None]
    near = -torch.log(torch.tensor(float(VOCAB)))
    return {
        "input_ids": torch.randint(1, VOCAB, (rows, S), generator=g) * real,
        "input_lengths": lengths,
        "token_mask": (real & (positions >= 3)).float(),
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, S, generator=g),
        "prev_logprobs": near + 0.1 * torch.randn(rows, S, generator=g),
        "generation_logprobs": near + 0.1 * torch.randn(rows, S, generator=g),
        "reference_policy_logprobs": near + 0.1 * torch.randn(rows, S, generator=g),
    }


class Rollouts(Dataset):
    """GRPO rows; ``poison = {(row, key): value}`` puts a value at position 5 of a row."""

    def __init__(self, rows: int, poison: dict[tuple[int, str], float] | None = None) -> None:
        self.data = rollout_batch(rows, seed=0)
        for (row, key), value in (poison or {}).items():
            self.data[key][row, 5] = value

    def __len__(self) -> int:
        return len(self.data["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


class GRPO(MCoreRLModule):
    def __init__(self, fail_rank: int | None = None) -> None:
        super().__init__(loss_fn=ClippedPGLossFn(PG_CFG))
        self.fail_rank = fail_rank

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(self.parallel_groups, calculate_per_token_loss=True)
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, adam_eps=1e-4, weight_decay=0.0)

    def loss_post_processor(self, num_microbatches: int | None = None) -> Any:
        if self.fail_rank == dist.get_rank():
            raise RuntimeError("injected failure on this rank")
        return super().loss_post_processor(num_microbatches)


class Snapshots(Callback):
    """Parameters and optimizer state before/after each step, logged values after it."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []
        self.logged: list[dict[str, float]] = []
        self.poison_weight_at: int | None = None

    def _state(self, trainer: Trainer) -> list[torch.Tensor]:
        params = [p.detach().clone() for c in trainer.strategy.model_chunks for p in c.parameters()]
        state = trainer.strategy.megatron_optimizer.optimizer.state
        moments = [v.clone() for s in state.values() for v in s.values() if torch.is_tensor(v)]
        return params + moments

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, idx: int) -> None:
        if idx == self.poison_weight_at:
            with torch.no_grad():
                next(iter(trainer.strategy.model_chunks[0].parameters())).view(-1)[0] = torch.nan
        self.before.append(self._state(trainer))

    def on_train_batch_end(self, trainer: Trainer, module: Any, *args: Any) -> None:
        self.after.append(self._state(trainer))
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _trainer(steps: int, strategy: MCoreRLStrategy, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu", "devices": int(os.environ["WORLD_SIZE"]), "strategy": strategy,
        "max_steps": steps, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
        "log_every_n_steps": 1, "gradient_clip_val": 1.0,
    }  # fmt: skip
    options.update(kwargs)
    return Trainer(**options)


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().view(-1).view(torch.uint8)

    return len(a) == len(b) and all(
        torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True)
    )


def nonfinite_rank(rank: int) -> dict[str, Any]:
    """DP=2. (1) +inf advantages in ONE rank's step-1 rows: skipped everywhere, bitwise no change.
    (2) NaN weight (finite inputs): the gradient check skips; 2 consecutive -> error.
    (3) nonfinite="raise" with -inf prev_logprobs raises at the first one."""
    out: dict[str, Any] = {}
    # sampler shuffle=False, batch 2: rank 1 reads rows 1,3 | 5,7 | 9,11 -> row 7 is its step 1.
    data = Rollouts(12, poison={(7, "advantages"): float("inf")})
    snaps = Snapshots()
    trainer = _trainer(
        3, MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=1)), callbacks=[snaps]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(GRPO(), DataLoader(data, batch_size=2, sampler=_sampler(data)))
    out["skip_unchanged"] = [
        bitwise_equal(b, a) for b, a in zip(snaps.before, snaps.after, strict=True)
    ]
    out["skipped_logged"] = [m.get("skipped_steps") for m in snaps.logged]
    out["loss_logged"] = [m.get("train_loss") for m in snaps.logged]
    out["warnings"] = [
        str(w.message) for w in caught if "Skipped the training step" in str(w.message)
    ]
    out["global_step"] = trainer.global_step
    out["finite_after"] = all(bool(torch.isfinite(t).all()) for t in snaps.after[-1])

    snaps = Snapshots()
    snaps.poison_weight_at = 1
    strategy = MCoreRLStrategy(
        microbatching=MicrobatchConfig(micro_batch_size=1),
        reliability=ReliabilityConfig(max_consecutive_skips=2),
    )
    trainer = _trainer(5, strategy, callbacks=[snaps])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(GRPO(), DataLoader(Rollouts(12), batch_size=2))
        out["weight_error"] = ""
    except Exception as err:  # noqa: BLE001 - the message is the result
        out["weight_error"] = f"{type(err).__name__}: {err}"
    out["weight_unchanged"] = [
        bitwise_equal(b, a) for b, a in zip(snaps.before, snaps.after, strict=False)
    ]

    data = Rollouts(8, poison={(1, "prev_logprobs"): float("-inf")})
    trainer = _trainer(
        2,
        MCoreRLStrategy(
            microbatching=MicrobatchConfig(micro_batch_size=1),
            reliability=ReliabilityConfig(nonfinite="raise"),
        ),
    )
    try:
        trainer.fit(GRPO(), DataLoader(data, batch_size=2, sampler=_sampler(data)))
        out["raise_error"] = ""
    except Exception as err:  # noqa: BLE001
        out["raise_error"] = f"{type(err).__name__}: {err}"
    return out


def _sampler(data: Dataset) -> DistributedSampler:
    return DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                              shuffle=False)  # fmt: skip


def timeout_rank(rank: int, seconds: float) -> dict[str, Any]:
    """TP=2: rank 1 raises inside the step (after the input check, before the model) and then
    sleeps; rank 0 waits in megatron's TP all-reduce and must fail after ``seconds``."""
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2,
        microbatching=MicrobatchConfig(micro_batch_size=1),
        reliability=ReliabilityConfig(timeout=timedelta(seconds=seconds)),
    )
    trainer = _trainer(2, strategy)
    start = time.monotonic()
    error = ""
    try:
        trainer.fit(GRPO(fail_rank=1), DataLoader(Rollouts(8), batch_size=2))
    except BaseException as err:  # noqa: BLE001
        error = f"{type(err).__name__}: {err}"[:300]
    elapsed = time.monotonic() - start
    if rank == 1:
        time.sleep(seconds + 4)  # stays alive, never joins the collective
    return {"error": error, "elapsed": elapsed}


# ---------------------------------------------------------------------- last.ckpt window


class LMRows(Dataset):
    def __init__(self, rows: int) -> None:
        self.rows = torch.randint(
            0, VOCAB, (rows, S + 1), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.rows[i, :-1], "labels": self.rows[i, 1:]}


class TinyLM(MCoreRLModule):
    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        groups = self.parallel_groups
        return tiny_gpt(tiny_gpt_config(groups), groups=groups, vocab_size=VOCAB, seed=0,
                        vp_stage=vp_stage)  # fmt: skip

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, adam_eps=1e-4, weight_decay=0.0)


class Losses(Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float]] = []

    def on_train_batch_end(self, trainer: Trainer, module: Any, *args: Any) -> None:
        last = trainer.strategy.last_optimizer_step
        loss = float(trainer.callback_metrics["train_loss"])
        self.steps.append((trainer.global_step, loss, float(last.grad_norm)))


def _lm_fit(ckpt_dir: str, steps: int, ckpt_path: str | None) -> Losses:
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2,
                            save_top_k=-1, save_last=True)  # fmt: skip
    losses = Losses()
    strategy = MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=2))
    trainer = _trainer(steps, strategy, callbacks=[saver, losses],
                       enable_checkpointing=True, gradient_clip_val=None)  # fmt: skip
    data = LMRows(48)
    loader = ResumableLoader(DataLoader(data, batch_size=2, sampler=_sampler(data)))
    trainer.fit(TinyLM(), loader, ckpt_path=ckpt_path)
    return losses


def full_run_rank(rank: int, ckpt_dir: str) -> list[tuple[int, float, float]]:
    return _lm_fit(ckpt_dir, 6, None).steps


def resume_last_rank(rank: int, ckpt_dir: str) -> list[tuple[int, float, float]]:
    return _lm_fit(ckpt_dir, 6, "last").steps


# ---------------------------------------------------------------------- rejected batches


def count_collectives(monkeypatch_target: Any = dist) -> dict[str, int]:
    """Wrap torch.distributed's collectives with counters (restored by :func:`uncount`)."""
    counts = {"n": 0}
    originals = {}
    for name in COLLECTIVES:
        fn = getattr(monkeypatch_target, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def wrapper(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            counts["n"] += 1
            return _fn(*args, **kwargs)

        setattr(monkeypatch_target, name, wrapper)
    counts_obj: dict[str, Any] = counts
    counts_obj["_originals"] = originals  # type: ignore[assignment]
    return counts


def uncount(counts: dict[str, Any], target: Any = dist) -> None:
    for name, fn in counts["_originals"].items():
        setattr(target, name, fn)


BAD_CASES = 220


def fuzz_rank(rank: int) -> dict[str, Any]:
    """TP=2 (both ranks hold the same data): one fit step builds the model, then hypothesis
    (derandomized: the same cases on both ranks) feeds bad batches through the real strategy
    step; each must raise ValueError/TypeError naming the key after at most ONE collective (the
    agreement flag), and a good batch after them still trains."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=1)
    )
    trainer = _trainer(1, strategy)
    module = GRPO()
    trainer.fit(module, DataLoader(Rollouts(4), batch_size=2))
    results: list[tuple[str, str, int]] = []

    def bad_batch(kind: str, row: int, value: int) -> tuple[dict[str, Any], str]:
        batch: dict[str, Any] = rollout_batch(2, seed=value)
        if kind == "missing":
            key = ["input_ids", "sample_mask", "advantages", "prev_logprobs", "token_mask",
                   "generation_logprobs", "reference_policy_logprobs"][value % 7]  # fmt: skip
            del batch[key]
        elif kind == "oov":
            key = "input_ids"
            batch[key][row, value % S] = VOCAB + value if value % 2 else -1 - value
        elif kind == "lengths":
            key = "input_lengths"
            batch[key][row] = S + 1 + value if value % 2 else -value
        elif kind == "ragged":
            key = ["advantages", "prev_logprobs", "token_mask"][value % 3]
            batch[key] = batch[key][:, : S - 1 - value % 3]
        elif kind == "rows":
            key = ["advantages", "sample_mask", "input_lengths"][value % 3]
            batch[key] = batch[key][:1]
        elif kind == "dtype":
            key = ["input_ids", "input_lengths"][value % 2]
            batch[key] = batch[key].float() if value % 3 else batch[key].bool()
        elif kind == "mask":
            key = "token_mask"
            batch[key][row, value % S] = 0.5 + value
        else:  # empty
            key = "empty"
            batch = {} if value % 2 else {k: v[:0] for k, v in batch.items()}
        return batch, key

    @settings(max_examples=BAD_CASES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(
        kind=st.sampled_from(
            ["missing", "oov", "lengths", "ragged", "rows", "dtype", "mask", "empty"]
        ),  # fmt: skip
        row=st.integers(0, 1),
        value=st.integers(0, 40),
    )
    def case(kind: str, row: int, value: int) -> None:
        batch, key = bad_batch(kind, row, value)
        counts = count_collectives()
        try:
            module.forward_backward(batch)
            results.append((kind, "no error", counts["n"]))
        except (ValueError, TypeError) as err:
            results.append((key, f"{type(err).__name__}: {err}", counts["n"]))
        finally:
            uncount(counts)

    case()
    good = module.forward_backward(rollout_batch(2, seed=99))
    return {"results": results, "good_loss": float(good.loss)}


# ---------------------------------------------------------------------- training continues

# (step, DistributedSampler row, key, value): batch 2 per rank, 4 rows a step, shuffle=False, so
# rank r reads rows 4k+r, 4k+2+r at step k; row 4k+r is its batch index 0, 4k+2+r index 1.
CONTINUE_CASES = (
    (1, 7, "advantages", float("inf")),  # rank 1, `advantages`[1, 5]
    (3, 12, "prev_logprobs", float("nan")),  # rank 0, `prev_logprobs`[0, 5]
    (5, 21, "prev_logprobs", float("-inf")),  # rank 1, `prev_logprobs`[0, 5]
)
CONTINUE_STEPS = 7


class StepRecords(Snapshots):
    """:class:`Snapshots` plus, per step: skipped?, the logged loss, megatron's grad norm."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[bool, float | None, float | None]] = []

    def on_train_batch_end(self, trainer: Trainer, module: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, module, *args)
        strategy = trainer.strategy
        last = strategy.last_optimizer_step
        skipped = bool(strategy.nonfinite_guard.step_skipped)
        loss = None if skipped else float(trainer.callback_metrics["train_loss"])
        self.steps.append((skipped, loss, None if last is None else last.grad_norm))


def nonfinite_continue_rank(rank: int) -> dict[str, Any]:
    """DP=2, nonfinite="skip", no LR scheduler. The bad run reads 7 steps where steps 1, 3, 5
    each carry ONE non-finite input on ONE rank (:data:`CONTINUE_CASES`); the reference run
    reads only the good steps 0, 2, 4, 6 (the same rows). Returns both runs' records."""
    data = Rollouts(4 * CONTINUE_STEPS, poison={(row, key): value
                                                for _, row, key, value in CONTINUE_CASES})  # fmt: skip
    bad_steps = {step for step, *_ in CONTINUE_CASES}
    good_rows = [r for r in range(len(data)) if r // 4 not in bad_steps]
    out: dict[str, Any] = {}
    for name, dataset, steps in (
        ("reference", Subset(data, good_rows), CONTINUE_STEPS - len(bad_steps)),
        ("bad", data, CONTINUE_STEPS),
    ):
        records = StepRecords()
        trainer = _trainer(
            steps,
            MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=1)),
            callbacks=[records],
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(GRPO(), DataLoader(dataset, batch_size=2, sampler=_sampler(dataset)))
        out[name] = {
            "steps": records.steps,
            "after": records.after,
            "unchanged": [
                bitwise_equal(b, a) for b, a in zip(records.before, records.after, strict=True)
            ],
            "skipped_logged": [m.get("skipped_steps") for m in records.logged],
            "warnings": [
                str(w.message) for w in caught if "Skipped the training step" in str(w.message)
            ],
            "global_step": trainer.global_step,
        }
    return out


# ---------------------------------------------------------------------- full disk


def _tree_bytes(path: str) -> dict[str, bytes]:
    root = os.path.abspath(path)
    found: dict[str, bytes] = {}
    for folder, _, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            with open(full, "rb") as f:
                found[os.path.relpath(full, root)] = f.read()
    return found


class FullDisk(Callback):
    """A full disk cannot be produced here, so the ``OSError(ENOSPC)`` is injected where the bytes
    are written. Before step 2 (after the step-1 saves): snapshot the checkpoint directory, then
    (a) ``trainer.save_checkpoint`` over ``last.ckpt`` with ``torch.save`` (megatron's writer of
    ``common.pt``) failing; (b) for the rest of the fit, megatron's shard writer
    (``filesystem_async``, run in forked worker processes) gets files whose ``write`` writes part
    of the bytes and then fails, so ``ModelCheckpoint``'s step-2 save fails."""

    def __init__(self, ckpt_dir: str) -> None:
        self.ckpt_dir = ckpt_dir
        self.out: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, idx: int) -> None:
        if idx != 1:
            return
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        self.out["before"] = _tree_bytes(self.ckpt_dir)
        self.out["listing_before"] = sorted(os.listdir(self.ckpt_dir))
        real_save = torch.save

        def full_save(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        torch.save = full_save
        try:
            trainer.save_checkpoint(os.path.join(self.ckpt_dir, "last.ckpt"))
            self.out["save_error"] = None
        except OSError as err:
            self.out["save_error"] = (err.errno, str(err))
        finally:
            torch.save = real_save
        self.out["after_save"] = _tree_bytes(self.ckpt_dir)
        self.out["listing_after_save"] = sorted(os.listdir(self.ckpt_dir))

        class FullFile:
            def __init__(self, stream: Any) -> None:
                self.stream = stream

            def write(self, data: Any) -> int:
                self.stream.write(bytes(memoryview(data).cast("B")[:16]))  # part of the bytes
                raise OSError(errno.ENOSPC, "No space left on device")

            def __getattr__(self, name: str) -> Any:
                return getattr(self.stream, name)

            def __enter__(self) -> FullFile:
                return self

            def __exit__(self, *exc: Any) -> None:
                self.stream.close()

        def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            stream = open(file, mode, *args, **kwargs)  # noqa: SIM115 - closed by FullFile
            return FullFile(stream) if "w" in mode else stream

        filesystem_async.open = full_open  # type: ignore[attr-defined]


def full_disk_rank(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """One rank: ModelCheckpoint saves `step=1.ckpt` and `last.ckpt`; then the two injected full
    disks (:class:`FullDisk`); then `fit(ckpt_path="last")` resumes from the intact step 1."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1,
                            save_top_k=-1, save_last=True)  # fmt: skip
    fault = FullDisk(ckpt_dir)
    strategy = MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=2))
    trainer = _trainer(3, strategy, callbacks=[saver, fault],
                       enable_checkpointing=True, gradient_clip_val=None)  # fmt: skip
    try:
        trainer.fit(TinyLM(), DataLoader(LMRows(8), batch_size=2))
        fault.out["fit_error"] = None
    except BaseException as err:  # noqa: BLE001 - the error is the result
        errno_ = err.errno if isinstance(err, OSError) else None
        fault.out["fit_error"] = (type(err).__name__, errno_, str(err))
    finally:
        if "open" in vars(filesystem_async):
            del filesystem_async.open  # type: ignore[attr-defined]
    fault.out["after_fit"] = _tree_bytes(ckpt_dir)
    fault.out["listing_after_fit"] = sorted(os.listdir(ckpt_dir))
    losses = Losses()
    strategy = MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=2))
    trainer = _trainer(2, strategy, callbacks=[losses],
                       gradient_clip_val=None)  # fmt: skip
    trainer.fit(TinyLM(), DataLoader(LMRows(8), batch_size=2),
                ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))  # fmt: skip
    fault.out["resumed_steps"] = [s[0] for s in losses.steps]
    return fault.out
