"""``TrainingStatistics`` acceptance: what real loggers receive from a 2-rank fit of the
``MCoreRLModule(loss_fn=ClippedPGLossFn)`` path, read back from their files.

* W&B (offline ``run-*.wandb`` protobuf log) and TensorBoard (event file): every metric exactly
  once per optimizer step, at steps 0..N-1, equal to the logged value; the run config (layout,
  precision, loss settings) as hyperparameters.
* When: step N's row reaches the loggers after step N+1 started (its slowest-rank ``step_time``
  rides on step N+1's agreement collective), the last one at the end of training; the values
  other than the timings are in ``trainer.callback_metrics`` right after the step.
* CSV: a ``TrainingStatistics`` subclass's extra metric is logged; an explicit default instance
  replaces the module's (one callback, each key once per step).
* Throughput counted once per data-parallel replica (TP=2 and DP=2), response lengths from the
  batches' ``token_mask``, identical on both ranks.

That every logged ClippedPG metric equals one loss call on the whole global batch under DP=2,
PP=2 and TP=2 (on all ranks) is asserted on ``trainer.callback_metrics`` by
``test_strategy_loss_metrics.py``; not repeated here.

One spawned 2-rank process pair runs all three fits (module-scoped fixture).
"""

from __future__ import annotations

import csv
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml  # type: ignore[import-untyped]
from _statistics_runs import DP2, PG_CFG, STEPS, TP2, FitRecord, StepRecord, statistics_rank

from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.testing import run_on_ranks

STEPS_LOGGED = list(range(STEPS))
# Keys the loggers add next to the callback's: Lightning's ``epoch``, W&B's own bookkeeping.
LIGHTNING_KEYS = {"epoch"}
WANDB_KEYS = {"trainer/global_step", "_step", "_runtime", "_timestamp"}


def _expected_keys() -> set[str]:
    """Every key ``TrainingStatistics`` logs for a ClippedPG step with a ``token_mask``."""
    metrics = set(ClippedPGLossFn(PG_CFG).metric_normalizations) - {"loss"}
    return (
        {"train_loss", "grad_norm", "step_time", "tokens_per_sec", "samples_per_sec"}
        | {"response_length_mean", "response_length_max"}
        | {f"train_{name}" for name in metrics}
    )


EXPECTED = _expected_keys()
TIMING = {"step_time", "tokens_per_sec", "samples_per_sec"}
"""Logged to the loggers (one step late), not put in ``trainer.callback_metrics``."""

Runs = tuple[list[dict[str, FitRecord]], Path]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("statistics")
    with pytest.MonkeyPatch.context() as env:  # offline, quiet, inside tmp: never the network
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.setenv("WANDB_DIR", str(root))
        results = run_on_ranks(statistics_rank, 2, str(root), timeout=180)
    return results, root


# ---------------------------------------------------------------- readers


def _leveldb_records(data: bytes) -> Iterator[bytes]:
    """The records of a W&B transaction log: a 7-byte ``:W&B`` header, then LevelDB log blocks
    of 32 KiB, each record chunk ``crc32 (4) | length (2) | type (1)``, types 1 FULL, 2 FIRST,
    3 MIDDLE, 4 LAST; a block tail under 7 bytes (or a zero header) is padding."""
    block, header = 32768, 7
    assert data[:4] == b":W&B", data[:7]
    pos, pending = header, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        pos += header
        if kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            yield pending
            pending = b""


def _wandb_run(root: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(history rows, config)`` of the single offline run under ``root``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = root.glob("wandb/wandb/offline-run-*/run-*.wandb")
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for raw in _leveldb_records(path.read_bytes()):
        record = pb.Record.FromString(raw)  # type: ignore[attr-defined]
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {"/".join([i.key, *i.nested_key]).strip("/"): json.loads(i.value_json)
                 for i in record.history.item}
            )  # fmt: skip
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return history, config


def _csv_rows(path: Path) -> list[dict[str, float]]:
    with path.open() as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _steps(rank0: FitRecord) -> list[StepRecord]:
    assert len(rank0.steps) == STEPS and rank0.global_step == STEPS
    return rank0.steps


def _logged(fit: FitRecord) -> list[dict[str, float]]:
    """Every step's row as the loggers received it (the recording logger, on every rank)."""
    logged = fit.logged
    assert sorted(logged) == STEPS_LOGGED
    return [logged[step] for step in STEPS_LOGGED]


def _assert_once_per_step(rows: list[dict[str, Any]], step_key: str, keys: set[str]) -> None:
    assert [row[step_key] for row in rows] == STEPS_LOGGED
    for row in rows:
        assert keys <= set(row), keys - set(row)


# ---------------------------------------------------------------- loggers


def test_wandb_gets_every_metric_once_per_step_and_the_run_config(runs: Runs) -> None:
    results, root = runs
    steps = _steps(results[0]["tp2"])
    logged = _logged(results[0]["tp2"])
    history, config = _wandb_run(root)
    # Lightning's WandbLogger logs `trainer/global_step` (= Lightning's step, 0..N-1) with each
    # row; W&B's own `_step` counts the rows and agrees because each step is one `log` call.
    assert [row["trainer/global_step"] for row in history] == STEPS_LOGGED
    assert [row["_step"] for row in history] == STEPS_LOGGED
    for row, step, sent in zip(history, steps, logged, strict=True):
        assert set(row) == EXPECTED | LIGHTNING_KEYS | WANDB_KEYS
        assert {k: row[k] for k in EXPECTED} == {k: sent[k] for k in EXPECTED}
        assert {k: row[k] for k in EXPECTED - TIMING} == {
            k: step.metrics[k] for k in EXPECTED - TIMING
        }
    # the config: the strategy's sizes, precision and the loss settings
    assert config == json.loads(json.dumps(results[0]["tp2"].run_config))
    assert {k: config[f"strategy/{k}"] for k in ("world_size", "tensor_model_parallel_size",
            "pipeline_model_parallel_size", "data_parallel_size", "context_parallel_size",
            "micro_batch_size", "precision")} == {
        "world_size": 2, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
        "data_parallel_size": 1, "context_parallel_size": 1, "micro_batch_size": TP2.mbs,
        "precision": "32-true",
    }  # fmt: skip
    assert config["loss/class"] == "ClippedPGLossFn"
    assert {k: config[f"loss/{k}"] for k in PG_CFG} == PG_CFG


def test_tensorboard_gets_every_scalar_once_per_step_and_the_hparams(runs: Runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )
    from tensorboard.plugins.hparams import plugin_data_pb2  # type: ignore[import-untyped]

    results, root = runs
    logged = _logged(results[0]["tp2"])
    run_dir = root / "tb" / "run"
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    # Lightning's TensorBoardLogger adds `epoch` per step and `hp_metric` (-1, once, step 0).
    assert set(events.Tags()["scalars"]) == EXPECTED | LIGHTNING_KEYS | {"hp_metric"}
    for key in EXPECTED | LIGHTNING_KEYS:
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == STEPS_LOGGED, key
        values = [row[key] for row in logged]
        assert [e.value for e in scalars] == [float(np.float32(v)) for v in values], key
    assert [(e.step, e.value) for e in events.Scalars("hp_metric")] == [(0, -1.0)]
    config = results[0]["tp2"].run_config
    assert yaml.safe_load((run_dir / "hparams.yaml").read_text()) == config
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["strategy/tensor_model_parallel_size"].number_value == 2
    assert hparams["strategy/data_parallel_size"].number_value == 1
    assert hparams["strategy/precision"].string_value == "32-true"
    assert hparams["loss/class"].string_value == "ClippedPGLossFn"
    assert hparams["loss/ratio_clip_max"].number_value == pytest.approx(PG_CFG["ratio_clip_max"])
    assert set(hparams) == set(config)


# ---------------------------------------------------------------- CSV: subclass, explicit instance


@pytest.mark.parametrize(
    ("run", "folder", "callback", "extra"),
    [
        ("tp2", "tp2", "TrainingStatistics", set()),
        ("dp2", "dp2_subclass", "TokensPerSample", {"tokens_per_sample"}),
        ("explicit", "tp2_explicit", "TrainingStatistics", set()),
    ],
)
def test_csv_gets_each_key_once_per_step_from_one_callback(
    runs: Runs, run: str, folder: str, callback: str, extra: set[str]
) -> None:
    results, root = runs
    for rank in results:
        assert rank[run].statistics_callbacks == [callback]  # replaced, never added twice
    steps = _steps(results[0][run])
    logged = _logged(results[0][run])
    keys = EXPECTED | extra
    rows = _csv_rows(root / folder / "metrics.csv")
    assert set().union(*rows) == keys | LIGHTNING_KEYS | {"step"}
    _assert_once_per_step(rows, "step", keys)
    for row, step, sent in zip(rows, steps, logged, strict=True):
        assert {k: row[k] for k in keys} == {k: sent[k] for k in keys}
        assert {k: row[k] for k in keys - TIMING} == {k: step.metrics[k] for k in keys - TIMING}
        assert not TIMING & set(step.metrics)  # the loggers' only


def test_subclass_metric_and_explicit_instance_values(runs: Runs) -> None:
    results, _ = runs
    for step0, step1 in zip(results[0]["dp2"].steps, results[1]["dp2"].steps, strict=True):
        tokens = step0.tokens + step1.tokens  # two DP replicas: different rows
        assert step0.metrics["tokens_per_sample"] == pytest.approx(tokens / (2 * step0.samples))
    # the explicit default instance logs what the module's own one does (same data, same model)
    for auto, explicit in zip(results[0]["tp2"].steps, results[0]["explicit"].steps, strict=True):
        assert explicit.input_ids == auto.input_ids
        for key in EXPECTED - TIMING:
            assert explicit.metrics[key] == auto.metrics[key], key


def test_the_progress_bar_shows_each_steps_train_loss(runs: Runs) -> None:
    """``TrainingStatistics(prog_bar=("train_loss",))`` (the default): the value the progress
    bar reads is each step's ``train_loss`` as a float, on every rank; the fits without a
    progress bar get nothing there."""
    results, _ = runs
    for rank in results:
        for step in rank["dp2"].steps:
            assert step.progress_bar == {"train_loss": step.metrics["train_loss"]}
            assert isinstance(step.progress_bar["train_loss"], float)
        assert all(step.progress_bar == {} for step in rank["tp2"].steps)


# ---------------------------------------------------------------- throughput, response lengths


@pytest.mark.parametrize("run", ["tp2", "dp2"])
def test_throughput_counts_the_global_batch_once(runs: Runs, run: str) -> None:
    results, _ = runs
    rows0, rows1 = _logged(results[0][run]), _logged(results[1][run])
    assert rows0 == rows1  # every rank sends its loggers the same rows, timings included
    for step0, step1, m in zip(results[0][run].steps, results[1][run].steps, rows0, strict=True):
        assert step0.metrics == step1.metrics  # and holds the same callback metrics
        if run == "tp2":  # TP peers read the same rows: the global batch is one of them
            assert step0.input_ids == step1.input_ids
            parts = [step0]
        else:
            assert step0.input_ids != step1.input_ids
            parts = [step0, step1]
        tokens = sum(p.tokens for p in parts)
        samples = sum(p.samples for p in parts)
        lengths = [n for p in parts for n in p.response_lengths]
        assert samples == (TP2 if run == "tp2" else DP2).global_batch
        assert m["step_time"] > 0
        assert math.isclose(m["tokens_per_sec"] * m["step_time"], tokens, rel_tol=1e-9), (
            m["tokens_per_sec"] * m["step_time"],
            tokens,
        )
        assert math.isclose(m["samples_per_sec"] * m["step_time"], samples, rel_tol=1e-9)
        assert m["response_length_mean"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-12)
        assert m["response_length_max"] == max(lengths)


@pytest.mark.parametrize("run", ["tp2", "dp2"])
def test_each_row_is_logged_once_after_the_next_step_started(runs: Runs, run: str) -> None:
    """Step N's row carries step N's slowest ``step_time``, agreed in step N+1's first pass: it
    reaches the loggers after step N+1 started (and before step N+2 starts), the last one at
    the end of training."""
    results, _ = runs
    for rank in results:
        events = [(kind, step) for kind, step, _ in rank[run].events]
        assert [step for kind, step in events if kind == "start"] == STEPS_LOGGED
        # after each step start, the previous step's row; the last row after the last step
        expected = [("start", 0)]
        for n in STEPS_LOGGED[1:]:
            expected += [("start", n), ("log", n - 1)]
        assert events == [*expected, ("log", STEPS - 1)]
