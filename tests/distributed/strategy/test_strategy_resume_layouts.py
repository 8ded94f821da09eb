"""``fit(ckpt_path=...)`` of a checkpoint saved under another parallel layout continues like an
uninterrupted run at the new layout (model, Adam moments and step, LambdaLR, ``global_step``),
and a layout change the saved optimizer format cannot follow raises on every rank before any
rank loads. The tiny GPT's seeded init is layout-invariant (``models/tiny_gpt.py``: full weights
drawn on every rank, then sliced), so all layouts start from the same weights."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from _strategy_resume_layout_runs import (
    LayoutChange,
    LayoutResumes,
    resume_from_rank,
    resume_layouts_rank,
)
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks

# 4 layers: PP=2 x VPP=2 needs one layer per virtual stage; 2 microbatches per step at PP=2
NEW = RunSpec(num_layers=4, steps=6, rows=48, global_batch=4)  # TP1 x DP2 on 2 ranks
SAVED_AT = 3
TOL = 1e-5


def _assert_continues(results: list[LayoutResumes], name: str) -> None:
    for rank_result in results:
        ref, change = rank_result.reference, rank_result.changes[name]
        assert ref is not None and change.resumed is not None, change.error
        if change.saved is not None:  # its first steps equal the new layout's (same init)
            for got, want in zip(change.saved.train_loss, ref.train_loss[:SAVED_AT], strict=True):
                assert abs(got - want) <= TOL
        resumed = change.resumed
        assert len(resumed.train_loss) == NEW.steps - SAVED_AT
        for got, want in zip(resumed.train_loss, ref.train_loss[SAVED_AT:], strict=True):
            assert abs(got - want) <= TOL, (name, resumed.train_loss, ref.train_loss)
        for got, want in zip(resumed.grad_norms, ref.grad_norms[SAVED_AT:], strict=True):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), (name, resumed.grad_norms)
        assert resumed.lrs == ref.lrs[SAVED_AT:]  # LambdaLR continues at step 4
        assert change.global_step == NEW.steps
        assert change.adam_steps == [float(NEW.steps)]  # Adam's step count continued


@pytest.fixture(scope="module")
def model_parallel_to_dp2(tmp_path_factory: pytest.TempPathFactory) -> list[LayoutResumes]:
    """ONE spawned pair: the TP1 x DP2 reference, then TP=2, PP=2 and PP=2 x VPP=2 checkpoints
    (step 3) each resumed at TP1 x DP2 to step 6."""
    saved = replace(NEW, steps=SAVED_AT)
    changes = {
        "tp2": LayoutChange(replace(saved, tp=2), NEW),
        "pp2": LayoutChange(replace(saved, pp=2), NEW),
        "pp2_vpp2": LayoutChange(replace(saved, pp=2, vpp=2), NEW),
    }
    root = str(tmp_path_factory.mktemp("layouts"))
    return run_on_ranks(resume_layouts_rank, 2, NEW, changes, root, timeout=180)


def test_tp2_checkpoint_continues_at_tp1_dp2(model_parallel_to_dp2: list[LayoutResumes]):
    _assert_continues(model_parallel_to_dp2, "tp2")


def test_pp2_checkpoint_continues_at_pp1_dp2(model_parallel_to_dp2: list[LayoutResumes]):
    _assert_continues(model_parallel_to_dp2, "pp2")


def test_pp2_vpp2_checkpoint_continues_at_pp1_dp2(model_parallel_to_dp2: list[LayoutResumes]):
    _assert_continues(model_parallel_to_dp2, "pp2_vpp2")


DO = replace(NEW, distributed_optimizer=True)
DO_SAVED = replace(DO, steps=SAVED_AT)
ONE_STEP = replace(NEW, steps=1)


@pytest.fixture(scope="module")
def optimizer_formats(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[LayoutResumes], str]:
    """ONE spawned pair: the distributed-optimizer TP1 x DP2 reference, ``fully_reshardable``
    TP=2 and PP=2 x VPP=2 checkpoints resumed at TP1 x DP2 (the strategy's own default format is
    ``dp_reshardable``: the saved format is loaded), a ``dp_reshardable`` DP=2 checkpoint kept
    for the DP=1 resume, and the changes that must raise: ``dp_reshardable`` DP=2 -> TP=2,
    distributed optimizer -> megatron's regular one, ``32-true`` -> ``bf16-mixed``."""
    changes = {
        "fully_tp2": LayoutChange(replace(DO_SAVED, tp=2, optimizer_sharding="fully_reshardable"),
                                  DO),
        "fully_pp2_vpp2": LayoutChange(
            replace(DO_SAVED, pp=2, vpp=2, optimizer_sharding="fully_reshardable"), DO
        ),
        "dp2": LayoutChange(DO_SAVED, DO),
        "dp_reshardable_to_tp2": LayoutChange(replace(DO_SAVED, steps=1), replace(DO, tp=2)),
        "optimizer_off": LayoutChange(replace(DO_SAVED, steps=1), NEW),
        "to_bf16": LayoutChange(ONE_STEP, replace(NEW, bf16=True)),
    }  # fmt: skip
    root = str(tmp_path_factory.mktemp("formats"))
    return run_on_ranks(resume_layouts_rank, 2, DO, changes, root, timeout=180), root


def test_fully_reshardable_distributed_optimizer_continues_from_tp2_at_dp2(optimizer_formats):
    _assert_continues(optimizer_formats[0], "fully_tp2")


def test_fully_reshardable_distributed_optimizer_continues_from_pp2_vpp2_at_dp2(
    optimizer_formats,
):
    _assert_continues(optimizer_formats[0], "fully_pp2_vpp2")


def test_dp_reshardable_distributed_optimizer_continues_from_dp2_at_dp1(optimizer_formats):
    """DP alone may change under ``dp_reshardable`` (megatron reshards its buckets over DP)."""
    _assert_continues(optimizer_formats[0], "dp2")  # and at the saved layout
    path = f"{optimizer_formats[1]}/dp2/step={SAVED_AT}.ckpt"
    _assert_continues(run_on_ranks(resume_from_rank, 1, DO, DO, path, timeout=120), "resumed")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("dp_reshardable_to_tp2", r"'dp_reshardable' format under another layout "
         r"\(tensor_model_parallel_size: 1 -> 2; saved TP=1 PP=1 VPP=None CP=1 DP=2, now "
         r"TP=2 PP=1 VPP=None CP=1 DP=1\).*"
         r'optimizer_sharding="fully_reshardable"'),
        ("optimizer_off", r"another `use_distributed_optimizer` \(use_distributed_optimizer: "
         r"True -> False\)"),
        ("to_bf16", r"another `precision` \(precision: 32-true -> bf16-mixed\)"),
    ],
)  # fmt: skip
def test_a_change_the_saved_optimizer_format_cannot_follow_raises_on_every_rank(
    optimizer_formats, name: str, message: str
):
    """Raised by the layout check every rank runs on the saved layout before any loads (the
    spawned pair finished: no rank was left in a collective)."""
    for rank_result in optimizer_formats[0]:
        change = rank_result.changes[name]
        assert change.resumed is None
        assert change.error.startswith("ValueError: "), change.error
        assert re.search(message, change.error), change.error
