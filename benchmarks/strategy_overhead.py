"""Cost of Lightning around megatron-core: each Trainer step against a bare megatron step.

Run: ``.venv/bin/python benchmarks/strategy_overhead.py [--steps N] [--repeats R]
[--layouts TP=2,PP=2,DP=2] [--num-layers L --hidden-size H --seq-length S] [--no-logging]``.
For each layout on two CPU gloo ranks, ``R`` times: one ``Trainer(strategy=MCoreRLStrategy(...)).fit`` of ``N`` optimizer steps
(progress bar and CSV logging on, every step logged) on a tiny GPT (default 4 layers, hidden 256),
global batch 16 x ``S`` (default 64) tokens in micro-batches of 4, Adam with clipping. After each
Trainer step a callback runs one step of the bare megatron loop of
``lightning_mcore_rl.testing.training`` (its own copy of the model in megatron DDP, the same
schedule and megatron optimizer, the same rows, no Lightning): the two loops alternate step by
step, so both see the same state of the machine.

Why step by step: on this shared 2-core machine megatron's own step drifts by up to 10% between
two runs a minute apart, more than the overhead being measured, so whole-run comparisons (an
earlier version of this script) carried +-0.1 of noise. Alternating steps cancels that drift: the
figure is the median over steps of ``Trainer step / bare step`` (steps ``WARMUP..N``; the rank
with the larger median), with its interquartile range, and the ratio of the total times. A second,
identical copy of the bare loop (``control``) also runs after every Trainer step, bare and control
in alternating order: ``control / bare`` is what two identical loops differ by here (the method's
resolution; it should be 1). The same figures in process CPU time (``time.process_time``, every
thread of the rank: no time waited in a collective or descheduled by the machine's other load)
stand beside them, so the ratios hold on a busy machine.

A Trainer step is the time between two consecutive ``on_train_batch_start`` minus the bare steps
run in between and a barrier after them: it includes data loading, every hook, the logging, the
progress bar and Lightning's loop. The barrier (timed as ``sync``, counted in no loop) lines the
ranks up again after the bare steps: their last collective is megatron's gradient all-reduce, and
without the barrier the ranks' drift over the two unsynchronised optimizer steps that follow it
(~26 ms of compute) was waited for in the Trainer's first collective and counted as the
Trainer's fixed cost (before 2026-12-05). The breakdown (medians, ms, each rank) splits each step at megatron's
forward-backward schedule (``schedule``: the function ``get_forward_backward_func()`` returns,
timed by a wrapper) and megatron's optimizer step (``optimizer``); ``fixed`` = step - schedule -
optimizer is what each loop adds around megatron. For the Trainer, ``fixed`` is split further by
callback hooks: ``pre`` (batch start -> schedule: grad zeroing, batch validation + its agreement
all-reduce, split), ``post`` (schedule -> end of the training step: the statistics reduction),
``log`` (``TrainingStatistics.on_train_batch_end``) and ``loop`` (the rest: Lightning's loop,
progress bar, logger, data loading).

The fixed cost as its own figure: ``fixed cost`` = the Trainer's fixed minus the bare loop's (the
grad zeroing both do), median ms per step of each rank, printed with its parts: every function
of :data:`PARTS` (collectives, validation, logging, Lightning's own per-step broadcast, the data
fetch, the progress bar; the update check, which runs inside the optimizer span and so outside
``fixed``) is wrapped by a timer for the Trainer's steps and its median time per step printed
(the parts are medians: they do not add up exactly; a target missing from the code measured is
skipped, so the same script times the code before and after a change).
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
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.callbacks import TrainingStatistics
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state, run_on_ranks
from lightning_mcore_rl.testing.training import build_training, forward_backward, optimizer_step

GLOBAL_BATCH, MBS, VOCAB, WARMUP = 16, 4, 128, 4
LAYOUTS = {"TP=2": (2, 1), "PP=2": (1, 2), "DP=2": (1, 1)}
SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
BARE_LOOPS = ("bare", "control")
KEYS = ("step", "schedule", "optimizer", "fixed", "pre", "post", "log", "loop")


@dataclass(frozen=True)
class RunConfig:
    """What one benchmark run trains: the model and row length (``--num-layers``,
    ``--hidden-size``, ``--seq-length``; the defaults are the toy of the recorded runs) and whether
    the Trainer's statistics callback logs (``--no-logging``: what the logging costs)."""

    num_layers: int = 4
    hidden_size: int = 256
    seq_length: int = 64
    log: bool = True

    @property
    def model(self) -> dict[str, int]:
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_attention_heads": 8}  # fmt: skip


Marks = dict[str, list[float]]
"""Per-step timestamps (``perf_counter``) by event name; ``bare_``/``control_`` prefixed for the
two bare loops."""


class _Rows(Dataset):
    def __init__(self, steps: int, run: RunConfig) -> None:
        generator = torch.Generator().manual_seed(0)
        shape = (GLOBAL_BATCH * steps, run.seq_length + 1)
        self.rows = torch.randint(0, VOCAB, shape, generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.rows[i, :-1], "labels": self.rows[i, 1:]}


class _Module(MCoreRLModule):
    def __init__(self, run: RunConfig) -> None:
        super().__init__()
        self.run = run

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(self.parallel_groups, **self.run.model)
        return tiny_gpt(config, groups=self.parallel_groups, vocab_size=VOCAB, vp_stage=vp_stage,
                        max_sequence_length=self.run.seq_length)  # fmt: skip

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0)


class _Recorder:
    """Timestamps of the three loops; ``prefix`` names the loop running now (the schedule wrapper
    marks into it). ``parts``: seconds spent in each timed function (:data:`PARTS`) per Trainer
    step (index = the Trainer steps started so far - 1). ``cpu_marks``/``cpu_parts``: the same
    in this thread's CPU time (``time.thread_time``: a wait in a collective, or the process
    descheduled by the machine's load, takes none), so wall - CPU is what was waited.
    ``proc_marks``: the marks in the process's CPU time (``time.process_time``, every thread),
    the clock of the step-level CPU figures."""

    def __init__(self) -> None:
        self.marks: Marks = defaultdict(list)
        self.cpu_marks: Marks = defaultdict(list)
        self.proc_marks: Marks = defaultdict(list)
        self.prefix = ""
        self.parts: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.cpu_parts: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))

    def mark(self, name: str) -> None:
        self.marks[self.prefix + name].append(time.perf_counter())
        self.cpu_marks[self.prefix + name].append(time.thread_time())
        self.proc_marks[self.prefix + name].append(time.process_time())

    def add(self, part: str, seconds: float, cpu_seconds: float) -> None:
        step = len(self.marks["start"]) - 1
        if not self.prefix and step >= 0:
            self.parts[part][step] += seconds
            self.cpu_parts[part][step] += cpu_seconds


class _Clock(Callback):
    """The Trainer's step start and end of its training step (closure)."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def on_train_batch_start(self, *args: Any) -> None:
        self.recorder.mark("start")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.recorder.mark("closure_end")


class _TimedStatistics(TrainingStatistics):
    """The default statistics callback, with its logging hook timed (``log=False``: it logs
    nothing, for ``--no-logging``)."""

    def __init__(self, recorder: _Recorder, log: bool) -> None:
        super().__init__()
        self.recorder = recorder
        self.logs = log

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.recorder.mark("optimizer_end")
        if self.logs:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.recorder.mark("log_end")


class _BareSteps(Callback):
    """After every Trainer step, one step of the bare megatron loop (``bare``) and one of an
    identical second copy (``control``, in alternating order), on the groups the strategy built:
    each its own model, optimizer and copy of the rows. ``control / bare`` is what two identical
    loops differ by on this machine (the noise floor of the ``Trainer / bare`` figure)."""

    def __init__(self, recorder: _Recorder, steps: int, run: RunConfig) -> None:
        self.recorder = recorder
        self.rows = _Rows(steps, run).rows
        self.run = run
        self.step = 0
        self.setups: dict[str, Any] = {}

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        model = {**self.run.model, "max_sequence_length": self.run.seq_length}
        self.setups = {name: build_training(clip_grad=1.0, **model) for name in BARE_LOOPS}

    def on_train_batch_end(self, *args: Any) -> None:
        import torch.distributed as dist

        order = BARE_LOOPS if self.step % 2 == 0 else BARE_LOOPS[::-1]
        for name in order:
            self._bare_step(name)
        self.recorder.prefix = "sync_"  # the ranks lined up again, counted in no loop
        self.recorder.mark("start")
        dist.barrier()
        self.recorder.mark("end")
        self.recorder.prefix = ""
        self.step += 1

    def _bare_step(self, name: str) -> None:
        from megatron.core import parallel_state as ps

        recorder = self.recorder
        recorder.prefix = f"{name}_"
        recorder.mark("start")
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = self.rows[self.step * GLOBAL_BATCH : (self.step + 1) * GLOBAL_BATCH]
        batches = [
            {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous()}
            for mb in rows.chunk(dp)[dp_rank].split(MBS)
        ]
        forward_backward(self.setups[name], batches)
        recorder.mark("optimizer_start")
        optimizer_step(self.setups[name])
        recorder.mark("optimizer_end")
        recorder.mark("end")
        recorder.prefix = ""


def _time_schedules(recorder: _Recorder) -> None:
    """Wrap megatron's three schedule functions so every call marks its start and end (both
    loops look them up by name through ``get_forward_backward_func()`` at each step)."""
    from megatron.core.pipeline_parallel import schedules

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            recorder.mark("schedule_start")
            try:
                return fn(*args, **kwargs)
            finally:
                recorder.mark("schedule_end")

        wrapper.__wrapped_schedule__ = fn  # type: ignore[attr-defined]
        return wrapper

    for name in SCHEDULES:
        fn = getattr(schedules, name)
        setattr(schedules, name, timed(getattr(fn, "__wrapped_schedule__", fn)))


PARTS: tuple[tuple[str, str, str], ...] = (
    # (part, "module:attribute path" timed, what it is); a part nested in another says so. Targets
    # absent from the code measured are skipped (the same script times the code before and
    # after a change).
    ("lightning_sigterm", "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop."
     "_broadcast_sigterm_tensor", "Lightning's own per-step broadcast of rank 0's SIGTERM flag"),
    ("data", "lightning.pytorch.loops.fetchers:_PrefetchDataFetcher.__next__",
     "the data fetch and collate"),
    ("batch_start", "lightning_mcore_rl.strategy.strategy:MCoreRLStrategy.on_train_batch_start",
     "the strategy's batch start: grad zeroing (+ the SIGTERM agreement where it runs there)"),
    ("sigterm_agreement", "lightning_mcore_rl.reliability.signals:TerminationRequest.agree",
     "the SIGTERM agreement all-reduce"),
    ("input_check", "lightning_mcore_rl.train.step:_checked_inputs_skip",
     "host-side batch validation + the input agreement"),
    ("input_agreement", "lightning_mcore_rl.reliability.nonfinite:gather_inputs",
     "the input agreement all-gather (in input_check)"),
    ("split", "lightning_mcore_rl.train.step:split_lm_batch", "the microbatch split (LM path)"),
    ("statistics", "lightning_mcore_rl.train.step:reduce_step_statistics",
     "the step's statistics reduction (DP all-gather + all-reduce, PP broadcast)"),
    ("update_check", "lightning_mcore_rl.reliability.nonfinite:update_measures",
     "the update check after the update: norms + all-reduce (in the optimizer span)"),
    ("update_snapshot", "lightning_mcore_rl.reliability.nonfinite:UpdateSnapshot.take",
     "the update check's copy of the parameters and state (in the optimizer span)"),
    ("update_preview", "lightning_mcore_rl.reliability.nonfinite:preview_measures",
     "the update check before the update: its preview + all-reduce (in the optimizer span)"),
    ("lr_schedulers", "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop."
     "update_lr_schedulers", "Lightning's scheduler stepping"),
    ("step_time_max", "lightning_mcore_rl.callbacks.training_statistics:_slowest",
     "the step_time MAX all-reduce (in log)"),
    ("self_log", "lightning.pytorch.core.module:LightningModule.log",
     "every `self.log` call (in log; log_dict calls it per key)"),
    ("logger_connector", "lightning.pytorch.trainer.connectors.logger_connector."
     "logger_connector:_LoggerConnector.update_train_step_metrics",
     "Lightning's end-of-step metrics -> loggers"),
    ("csv_log_metrics", "lightning.pytorch.loggers.csv_logs:CSVLogger.log_metrics",
     "the CSV logger's log_metrics (by Lightning or directly)"),
    ("progress_bar", "lightning.pytorch.callbacks.progress.rich_progress:RichProgressBar."
     "on_train_batch_end", "the progress bar's refresh (rich)"),
    ("progress_bar", "lightning.pytorch.callbacks.progress.tqdm_progress:TQDMProgressBar."
     "on_train_batch_end", "the progress bar's refresh (tqdm)"),
)  # fmt: skip


def _time_parts(recorder: _Recorder) -> None:
    """Wrap each :data:`PARTS` target so the Trainer steps' time in it adds up per step (a
    benchmark-only patch, like the schedule wrapper)."""
    import importlib

    for part, target, _ in PARTS:
        module_name, path = target.split(":")
        owner: Any = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name, None)
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:
            continue
        fn = getattr(fn, "__wrapped_part__", fn)

        def timed(*args: Any, __fn: Any = fn, __part: str = part, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return __fn(*args, **kwargs)
            finally:
                recorder.add(__part, time.perf_counter() - start, time.thread_time() - cpu)

        functools.update_wrapper(timed, fn)
        timed.__wrapped_part__ = fn  # type: ignore[attr-defined]
        setattr(owner, attr, timed)


def _spans(marks: Marks, start: str, end: str) -> list[float]:
    return [b - a for a, b in zip(marks[start], marks[end], strict=False)]


def _per_step(
    marks: Marks, parts: dict[str, dict[int, float]]
) -> dict[str, dict[str, list[float]]]:
    """Seconds per step of each phase of the three loops (steps ``0..N-2``: a Trainer step ends
    at the next one's start, minus the bare steps and the barrier run in between)."""
    loops: dict[str, dict[str, list[float]]] = {
        name: {
            "step": _spans(marks, f"{name}_start", f"{name}_end"),
            "schedule": _spans(marks, f"{name}_schedule_start", f"{name}_schedule_end"),
            "optimizer": _spans(marks, f"{name}_optimizer_start", f"{name}_optimizer_end"),
        }
        for name in BARE_LOOPS
    }
    spans = [loops[n]["step"] for n in BARE_LOOPS] + [_spans(marks, "sync_start", "sync_end")]
    between = [sum(steps) for steps in zip(*spans, strict=True)]
    trainer_step = [
        b - a - bare
        for a, b, bare in zip(marks["start"][:-1], marks["start"][1:], between, strict=False)
    ]
    loops["trainer"] = {
        "step": trainer_step,
        "schedule": _spans(marks, "schedule_start", "schedule_end"),
        "optimizer": _spans(marks, "closure_end", "optimizer_end"),
        "pre": _spans(marks, "start", "schedule_start"),
        "post": _spans(marks, "schedule_end", "closure_end"),
        "log": _spans(marks, "optimizer_end", "log_end"),
    }
    n = len(trainer_step)
    for phases in loops.values():
        for name in phases:
            phases[name] = phases[name][:n]
        phases["fixed"] = [
            s - a - b
            for s, a, b in zip(phases["step"], phases["schedule"], phases["optimizer"], strict=True)
        ]
    trainer = loops["trainer"]
    trainer["loop"] = [  # the rest of the fixed cost: Lightning's loop, logger, progress bar
        f - a - b - c
        for f, a, b, c in zip(
            trainer["fixed"], trainer["pre"], trainer["post"], trainer["log"], strict=True
        )
    ]
    for part in dict.fromkeys(part for part, _, _ in PARTS):
        if part in parts:
            trainer[f"part:{part}"] = [parts[part].get(i, 0.0) for i in range(n)]
    return loops


def _fit(
    tp: int, pp: int, steps: int, run: RunConfig, log_dir: str
) -> dict[str, dict[str, list[float]]]:
    recorder = _Recorder()
    _time_schedules(recorder)
    _time_parts(recorder)
    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            microbatching=MicrobatchConfig(micro_batch_size=MBS),
        ),
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=CSVLogger(log_dir),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[
            _Clock(recorder),
            _TimedStatistics(recorder, run.log),
            _BareSteps(recorder, steps, run),
        ],
    )
    dp = world // (tp * pp)
    trainer.fit(_Module(run), DataLoader(_Rows(steps, run), batch_size=GLOBAL_BATCH // dp))
    destroy_megatron_state()
    loops = _per_step(recorder.marks, recorder.parts)
    cpu = _per_step(recorder.cpu_marks, recorder.cpu_parts)
    for name, phases in cpu.items():  # the CPU-time figures beside the wall-time ones
        loops[name].update({f"cpu:{key}": values for key, values in phases.items()})
    for name, phases in _per_step(recorder.proc_marks, {}).items():  # process CPU time
        loops[name].update({f"proc:{key}": values for key, values in phases.items()})
    return loops


def _rank(rank: int, tp: int, pp: int, steps: int, repeats: int, run: RunConfig) -> list[Any]:
    runs = []
    for _ in range(repeats):
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as log_dir:
            runs.append(_fit(tp, pp, steps, run, log_dir))
    return runs


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _ratios(num: list[float], den: list[float]) -> tuple[float, str]:
    """Median and interquartile range of the per-step ratios ``num / den``."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return median, f"{q1:.3f}-{q3:.3f}"


Parts = dict[str, list[float]]
"""Per rank: the median ms per step of each fixed-cost figure (:func:`_parts`)."""


def _parts(steps: dict[str, dict[str, list[float]]]) -> dict[str, tuple[float, float]]:
    """The fixed-cost figure of one rank and its breakdown, ``(wall, CPU)`` medians of the steps
    in ms: ``fixed cost`` = the Trainer's fixed minus the bare loop's (grad zeroing, which both
    do), and each timed part of :data:`PARTS` (medians: the parts do not add up exactly)."""
    trainer, bare = steps["trainer"], steps["bare"]

    def both(loop: dict[str, list[float]], key: str) -> tuple[float, float]:
        return _median_ms(loop[key]), _median_ms(loop[f"cpu:{key}"])

    def difference(prefix: str) -> float:
        fixed = zip(trainer[f"{prefix}fixed"], bare[f"{prefix}fixed"], strict=True)
        return _median_ms([t - b for t, b in fixed])

    out = {
        "fixed cost (Trainer fixed - bare fixed)": (difference(""), difference("cpu:")),
        "Trainer fixed": both(trainer, "fixed"),
        "bare fixed": both(bare, "fixed"),
    }
    for key in ("pre", "post", "log", "loop"):
        out[key] = both(trainer, key)
    for part in dict.fromkeys(part for part, _, _ in PARTS):
        if trainer.get(f"part:{part}"):
            out[part] = both(trainer, f"part:{part}")
    return out


def _summary(
    name: str, results: list[list[Any]]
) -> tuple[str, list[str], list[dict[str, tuple[float, float]]]]:
    """The layout's table row (the rank with the larger median ratio), its breakdown rows and
    each rank's fixed-cost parts."""
    rows, best, parts = [], None, []
    for rank, runs in enumerate(results):
        steps: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for run in runs:  # pool the steps of every repeat, warm-up steps dropped
            for loop, phases in run.items():
                for key, values in phases.items():
                    steps[loop][key].extend(values[WARMUP:])
        trainer, bare, control = (steps[k]["step"] for k in ("trainer", "bare", "control"))
        ratio, iqr = _ratios(trainer, bare)
        control_ratio, control_iqr = _ratios(control, bare)
        # the same figures in process CPU time (no waiting, no time descheduled by other load)
        cpu_trainer, cpu_bare, cpu_control = (
            steps[k]["proc:step"] for k in ("trainer", "bare", "control")
        )
        cpu_ratio, cpu_iqr = _ratios(cpu_trainer, cpu_bare)
        cpu_control_ratio, cpu_control_iqr = _ratios(cpu_control, cpu_bare)
        stats: dict[str, Any] = {
            "bare": _median_ms(bare),
            "trainer": _median_ms(trainer),
            "ratio": ratio,
            "iqr": iqr,
            "control": f"{control_ratio:.3f} ({control_iqr})",
            "extra": _median_ms([t - b for t, b in zip(trainer, bare, strict=True)]),
            "total": sum(trainer) / sum(bare),
            "n": len(trainer),
            "cpu_bare": _median_ms(cpu_bare),
            "cpu_trainer": _median_ms(cpu_trainer),
            "cpu_ratio": f"{cpu_ratio:.3f} ({cpu_iqr})",
            "cpu_control": f"{cpu_control_ratio:.3f} ({cpu_control_iqr})",
        }
        if best is None or stats["ratio"] > best["ratio"]:
            best = stats
        for loop in ("bare", "control", "trainer"):
            cells = " | ".join(
                f"{_median_ms(steps[loop][k]):.1f}" if steps[loop].get(k) else "" for k in KEYS
            )
            rows.append(f"| {name} | {rank} | {loop} | {cells} |")
        parts.append(_parts(steps))
    assert best is not None
    row = (
        f"| {name} | {best['bare']:.1f} | {best['trainer']:.1f} | {best['ratio']:.3f} | "
        f"{best['iqr']} | {best['extra']:.1f} | {best['total']:.3f} | {best['control']} | "
        f"{best['cpu_bare']:.1f} | {best['cpu_trainer']:.1f} | {best['cpu_ratio']} | "
        f"{best['cpu_control']} | {best['n']} |"
    )
    return row, rows, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=int(os.environ.get("OVERHEAD_STEPS", 40)))
    parser.add_argument("--repeats", type=int, default=int(os.environ.get("OVERHEAD_REPEATS", 2)))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    for name in ("num_layers", "hidden_size", "seq_length"):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=getattr(RunConfig(), name)
        )
    parser.add_argument(
        "--no-logging", action="store_true", help="the statistics callback logs nothing"
    )
    args = parser.parse_args()
    run = RunConfig(args.num_layers, args.hidden_size, args.seq_length, log=not args.no_logging)
    unknown = sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.steps <= WARMUP + 2:
        parser.error(f"--steps must be > {WARMUP + 2} (the first {WARMUP} steps are warm-up)")
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; {run}, global batch {GLOBAL_BATCH}; {args.steps} steps x "
          f"{args.repeats} fits per layout; "
          f"uptime at start: {load}")  # fmt: skip
    summary, breakdown, parts = [], [], {}
    for name in args.layouts.split(","):
        tp, pp = LAYOUTS[name]
        results = run_on_ranks(_rank, 2, tp, pp, args.steps, args.repeats, run, timeout=3600)
        row, rows, parts[name] = _summary(name, results)
        summary.append(row)
        breakdown.extend(rows)
    print(
        "\n| layout | bare ms/step | Trainer ms/step | Trainer ÷ bare (median of steps) | "
        "IQR of the step ratios | Trainer - bare ms (median of steps) | total Trainer time ÷ "
        "total bare time | control ÷ bare (median, IQR) | bare CPU ms/step | Trainer CPU ms/step "
        "| Trainer ÷ bare CPU (median, IQR) | control ÷ bare CPU (median, IQR) | steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    print("\nBreakdown, median ms per step of each rank:\n")
    print(f"| layout | rank | loop | {' | '.join(KEYS)} |")
    print("|---|---|---|" + "---|" * len(KEYS))
    print("\n".join(breakdown))
    _print_parts(parts)


def _print_parts(parts: dict[str, list[dict[str, tuple[float, float]]]]) -> None:
    """The fixed cost per step and its parts: one row per figure, one column per layout and
    rank, each cell ``wall (CPU)`` ms."""
    columns = [(name, rank) for name, ranks in parts.items() for rank in range(len(ranks))]
    figures = list(dict.fromkeys(k for ranks in parts.values() for r in ranks for k in r))
    what = {part: text.replace(" (rich)", "").replace(" (tqdm)", "") for part, _, text in PARTS}
    print("\nFixed cost per Trainer step and its parts, median ms of the steps, wall (CPU):\n")
    print("| figure | " + " | ".join(f"{n} rank {r}" for n, r in columns) + " | what |")
    print("|---|" + "---|" * (len(columns) + 1))
    for figure in figures:
        cells = " | ".join(
            "{:.2f} ({:.2f})".format(*parts[n][r][figure]) if figure in parts[n][r] else ""
            for n, r in columns
        )
        print(f"| {figure} | {cells} | {what.get(figure, '')} |")


if __name__ == "__main__":
    main()
