"""Cost of Lightning around megatron-core: ms per optimizer step, Trainer vs the bare loop.

Run: ``.venv/bin/python benchmarks/strategy_overhead.py [--steps N] [--pairs P] [--layouts
TP=2,PP=2,DP=2]``. For each layout on two CPU gloo ranks, the same tiny GPT (4 layers, hidden
256), global batch 16 x 64 tokens in micro-batches of 4 and Adam with clipping, trained by the
bare megatron loop of ``lightning_mcore_rl.testing.training`` and by
``Trainer(strategy=MCoreRLStrategy(...))`` (progress bar and CSV logging on, every step logged),
interleaved in one process pair: bare, Trainer, bare, Trainer, ... (``P`` pairs, ``N`` steps each).

Time per step is the median over steps 5..N of the wall time between consecutive step starts
(the slowest rank), so the Trainer's figure includes data loading, hooks, logging and the
optimizer wrapper. The ratio of each pair is Trainer / bare; the table shows their median. On a
loaded machine megatron's own schedule varies by more than the overhead between two runs, so the
table also gives the overhead itself: the time outside megatron's schedule (``step -
schedule``, below) of the Trainer minus that of the bare loop (the rank with the largest
difference, median of pairs), and the ratio it implies for an equal schedule time. Each process
first runs a short bare warm-up (its first run is slower), not reported.

The breakdown (each rank, medians in ms) splits each step at megatron's forward-backward schedule
(``schedule``: the function ``get_forward_backward_func()`` returns, timed by a wrapper) and
megatron's optimizer step (``optimizer``); ``fixed`` = step - schedule - optimizer is what the
loop adds around megatron. For the Trainer, ``fixed`` is split further by callback hooks:
``pre`` (batch start -> schedule: grad zeroing, batch validation + its agreement all-reduce,
split), ``post`` (schedule -> end of the training step: the statistics reduction), ``log``
(``TrainingStatistics.on_optimizer_step``) and ``loop`` (the rest: Lightning's loop, progress
bar, logger, data loading).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.callbacks import TrainingStatistics
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state, run_on_ranks
from lightning_mcore_rl.testing.training import build_training, forward_backward, optimizer_step

GLOBAL_BATCH, MBS, SEQ, VOCAB, WARMUP = 16, 4, 64, 128, 4
MODEL: dict[str, Any] = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8}
LAYOUTS = {"TP=2": (2, 1), "PP=2": (1, 2), "DP=2": (1, 1)}
SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)

Marks = dict[str, list[float]]
"""Per-step timestamps (``perf_counter``) by event name."""


class _Rows(Dataset):
    def __init__(self, steps: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, VOCAB, (GLOBAL_BATCH * steps, SEQ + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.rows[i, :-1], "labels": self.rows[i, 1:]}


class _Module(MCoreRLModule):
    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        return tiny_gpt(tiny_gpt_config(**MODEL), vocab_size=VOCAB, vp_stage=vp_stage)

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0)


class _Clock(Callback):
    """Step start, end of the training step (closure) and step end of every Trainer step."""

    def __init__(self, marks: Marks) -> None:
        self.marks = marks

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks["start"].append(time.perf_counter())

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.marks["closure_end"].append(time.perf_counter())


class _TimedStatistics(TrainingStatistics):
    """The default statistics callback, with its logging hook timed."""

    def __init__(self, marks: Marks) -> None:
        super().__init__()
        self.marks = marks

    def on_optimizer_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.marks["optimizer_end"].append(time.perf_counter())
        super().on_optimizer_step(trainer, pl_module)
        self.marks["log_end"].append(time.perf_counter())


def _time_schedules(marks: Marks) -> None:
    """Wrap megatron's three schedule functions so every call marks its start and end (both
    loops look them up by name through ``get_forward_backward_func()`` at each step)."""
    from megatron.core.pipeline_parallel import schedules

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            marks["schedule_start"].append(time.perf_counter())
            try:
                return fn(*args, **kwargs)
            finally:
                marks["schedule_end"].append(time.perf_counter())

        wrapper.__wrapped_schedule__ = fn  # type: ignore[attr-defined]
        return wrapper

    for name in SCHEDULES:
        fn = getattr(schedules, name)
        setattr(schedules, name, timed(getattr(fn, "__wrapped_schedule__", fn)))


def _median(values: list[float]) -> float:
    return statistics.median(values[WARMUP:]) * 1e3


def _spans(marks: Marks, start: str, end: str) -> list[float]:
    return [b - a for a, b in zip(marks[start], marks[end], strict=False)]


def _steps(starts: list[float]) -> list[float]:
    return [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _phases(marks: Marks, optimizer_start: str) -> dict[str, float]:
    """Median ms of each phase (per step: ``outside`` = step - schedule, ``fixed`` = outside -
    optimizer)."""
    step = _steps(marks["start"])
    schedule = _spans(marks, "schedule_start", "schedule_end")
    optimizer = _spans(marks, optimizer_start, "optimizer_end")
    outside = [s - a for s, a in zip(step, schedule, strict=True)]
    fixed = [s - b for s, b in zip(outside, optimizer, strict=True)]
    phases = {"step": step, "schedule": schedule, "optimizer": optimizer, "outside": outside,
              "fixed": fixed}  # fmt: skip
    if "log_end" in marks:  # the Trainer's run
        phases.update(
            pre=_spans(marks, "start", "schedule_start"),
            post=_spans(marks, "schedule_end", "closure_end"),
            log=_spans(marks, "optimizer_end", "log_end"),
            loop=[b - a for a, b in zip(marks["log_end"], marks["start"][1:], strict=True)],
        )
    return {name: _median(values) for name, values in phases.items()}


def _bare(tp: int, pp: int, steps: int) -> dict[str, float]:
    marks: Marks = defaultdict(list)
    _time_schedules(marks)
    init_megatron_state(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    setup = build_training(clip_grad=1.0, **MODEL)
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    data = _Rows(steps).rows
    for step in range(steps):
        marks["start"].append(time.perf_counter())
        rows = data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH].chunk(dp)[dp_rank]
        batches = [
            {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous()}
            for mb in rows.split(MBS)
        ]
        forward_backward(setup, batches)
        marks["optimizer_start"].append(time.perf_counter())
        optimizer_step(setup)
        marks["optimizer_end"].append(time.perf_counter())
    marks["start"].append(time.perf_counter())
    destroy_megatron_state()
    return _phases(marks, "optimizer_start")


def _lightning(tp: int, pp: int, steps: int, log_dir: str) -> dict[str, float]:
    marks: Marks = defaultdict(list)
    _time_schedules(marks)
    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=MBS
        ),
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=CSVLogger(log_dir),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[_Clock(marks), _TimedStatistics(marks)],
    )
    dp = world // (tp * pp)
    trainer.fit(_Module(), DataLoader(_Rows(steps), batch_size=GLOBAL_BATCH // dp))
    marks["start"].append(time.perf_counter())
    return _phases(marks, "closure_end")


def _outside(phases: dict[str, float]) -> float:
    """Median ms per step outside megatron's schedule (``step - schedule``: the optimizer step
    and the loop's fixed cost). Not ``fixed`` alone: a pipeline's last stage waits for the first one's
    last backward in megatron's grad-norm all-reduce (bare) or in the statistics broadcast
    (Trainer), so that wait moves between the two parts."""
    return phases["outside"]


def _rank(rank: int, tp: int, pp: int, steps: int, pairs: int) -> list[dict[str, Any]]:
    _bare(tp, pp, WARMUP + 2)  # warm-up: the first run of a process is slower (not reported)
    runs = []
    for _ in range(pairs):
        torch.manual_seed(0)
        bare = _bare(tp, pp, steps)
        with tempfile.TemporaryDirectory() as log_dir:
            trainer = _lightning(tp, pp, steps, log_dir)
        destroy_megatron_state()
        runs.append({"bare": bare, "trainer": trainer})
    return runs


def _fmt(values: dict[str, float], keys: tuple[str, ...]) -> str:
    return " | ".join(f"{values[k]:.1f}" if k in values else "" for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=int(os.environ.get("OVERHEAD_STEPS", 30)))
    parser.add_argument("--pairs", type=int, default=int(os.environ.get("OVERHEAD_PAIRS", 3)))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    unknown = sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    if args.pairs < 1:
        parser.error(f"--pairs must be >= 1, got {args.pairs}")
    if args.steps <= WARMUP + 1:
        parser.error(f"--steps must be > {WARMUP + 1} (the first {WARMUP} steps are warm-up)")
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; {args.steps} steps x {args.pairs} interleaved pairs; "
          f"uptime at start: {load}")  # fmt: skip
    summary, breakdown = [], []
    for name in args.layouts.split(","):
        tp, pp = LAYOUTS[name]
        results = run_on_ranks(_rank, 2, tp, pp, args.steps, args.pairs, timeout=1800)
        ratios, bares, trainers, extras, fixed_ratios = [], [], [], [], []
        for i in range(args.pairs):
            bare = max(r[i]["bare"]["step"] for r in results)  # the slowest rank
            trainer = max(r[i]["trainer"]["step"] for r in results)
            extra = max(_outside(r[i]["trainer"]) - _outside(r[i]["bare"]) for r in results)
            bares.append(bare)
            trainers.append(trainer)
            ratios.append(trainer / bare)
            extras.append(extra)
            fixed_ratios.append(1 + extra / bare)
            for rank, result in enumerate(results):
                for run in ("bare", "trainer"):
                    row = _fmt(result[i][run], KEYS)
                    breakdown.append(f"| {name} | {i} | {rank} | {run} | {row} |")
        pairs = " / ".join(f"{r:.2f}" for r in ratios)
        summary.append(
            f"| {name} | {statistics.median(bares):.1f} | {statistics.median(trainers):.1f} | "
            f"{statistics.median(ratios):.2f} | {pairs} | {statistics.median(extras):.1f} | "
            f"{statistics.median(fixed_ratios):.3f} |"
        )
    print(
        "\n| layout | bare ms/step | Trainer ms/step | ratio (median of pairs) | pair ratios | "
        "overhead ms (outside the schedule, Trainer - bare) | 1 + overhead / bare step |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    print("\nBreakdown, median ms per step of each rank:\n")
    print(f"| layout | pair | rank | run | {' | '.join(KEYS)} |")
    print("|---|---|---|---|" + "---|" * len(KEYS))
    print("\n".join(breakdown))


KEYS = ("step", "schedule", "optimizer", "outside", "fixed", "pre", "post", "log", "loop")

if __name__ == "__main__":
    main()
