"""Host-side checks of the reliability work, in-process: batch validation (fuzzed), argument
and Trainer-flag checks, the non-finite policy's arguments, checkpoint helpers."""

from __future__ import annotations

import errno
import math
import re
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.losses.config import ClippedPGLossConfig, DPOLossConfig, OPDFullLossConfig
from lightning_mcore_rl.reliability.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    NonFiniteWarning,
    check_policy,
)
from lightning_mcore_rl.strategy import checkpoint as ckpt
from lightning_mcore_rl.strategy.optimizer import check_trainer_flags
from lightning_mcore_rl.train.validation import BatchSpec, first_nonfinite, validate_batch

V, S = 32, 8
SPEC = BatchSpec(vocab_size=V, required=("token_mask", "advantages", "prev_logprobs"))


def _batch(rows: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, S + 1, (rows,), generator=g)
    real = torch.arange(S)[None] < lengths[:, None]
    return {
        "input_ids": torch.randint(0, V, (rows, S), generator=g) * real,
        "input_lengths": lengths,
        "token_mask": real.float(),
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, S, generator=g),
        "prev_logprobs": -torch.rand(rows, S, generator=g),
    }


def test_a_good_batch_passes_and_reports_the_first_nonfinite_entry():
    assert validate_batch(_batch(), SPEC) is None
    batch = _batch()
    batch["prev_logprobs"][2, 4] = float("-inf")
    finding = validate_batch(batch, SPEC)
    assert finding is not None and finding.describe() == "`prev_logprobs`[2, 4] = -inf"
    assert first_nonfinite({"x": torch.tensor([1.0, float("nan")])}).position == (1,)


MUTATIONS = ["missing", "oov", "negative", "lengths", "ragged", "rows", "dtype", "mask", "stray"]


@settings(max_examples=300, deadline=None, database=None)
@given(kind=st.sampled_from(MUTATIONS), row=st.integers(0, 2), value=st.integers(0, 100))
def test_fuzzed_bad_batches_raise_naming_the_key(kind, row, value):
    batch = _batch()
    key = {"missing": ["input_ids", "sample_mask", "token_mask", "advantages",
                       "prev_logprobs"][value % 5]}.get(kind)  # fmt: skip
    if kind == "missing":
        del batch[key]
    elif kind in ("oov", "negative"):
        key = "input_ids"
        batch[key][row, value % S] = V + value if kind == "oov" else -1 - value
    elif kind == "lengths":
        key = "input_lengths"
        batch[key][row] = S + 1 + value if value % 2 else -value
    elif kind == "ragged":
        key = ["advantages", "prev_logprobs", "token_mask"][value % 3]
        batch[key] = batch[key][:, : S - 1]
    elif kind == "rows":
        key = ["advantages", "sample_mask", "input_lengths"][value % 3]
        batch[key] = batch[key][:2]
    elif kind == "dtype":
        key = ["input_ids", "input_lengths"][value % 2]
        batch[key] = batch[key].float() if value % 3 else batch[key].bool()
    elif kind == "mask":
        key = ["token_mask", "sample_mask"][value % 2]
        batch[key].view(-1)[0] = 0.25 + value
    else:
        key = "token_mask"
        batch["input_lengths"][row] = 1
        batch[key][row, S - 1] = 1.0
    with pytest.raises((ValueError, TypeError), match=re.escape(f"`{key}`")):
        validate_batch(batch, SPEC)


def test_empty_and_lm_batches():
    with pytest.raises(ValueError, match="The batch is empty"):
        validate_batch({}, SPEC)
    with pytest.raises(ValueError, match="`input_ids` has 0 samples"):
        validate_batch({k: v[:0] for k, v in _batch().items()}, SPEC)
    with pytest.raises(TypeError, match="A batch must be a mapping"):
        validate_batch([1, 2], SPEC)
    lm = BatchSpec(lm=True, vocab_size=V)
    tokens = torch.randint(0, V, (2, S))
    assert validate_batch({"tokens": tokens, "labels": tokens}, lm) is None
    with pytest.raises(ValueError, match="missing the key `labels`"):
        validate_batch({"tokens": tokens}, lm)
    with pytest.raises(ValueError, match=r"`labels` holds id 32 at \[0, 1\], outside"):
        validate_batch(
            {"tokens": tokens, "labels": tokens.clone().index_fill_(1, torch.tensor([1]), V)}, lm
        )
    with pytest.raises(ValueError, match=r"`labels` must have shape \[2, 8\]"):
        validate_batch({"tokens": tokens, "labels": tokens[:, :4]}, lm)
    with pytest.raises(TypeError, match="`tokens` must be a torch.Tensor"):
        validate_batch({"tokens": [1], "labels": tokens}, lm)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tensor_model_parallel_size": True}, TypeError, "a bool is not a size"),
        ({"pipeline_model_parallel_size": 2.0}, TypeError, "`pipeline_model_parallel_size` must"),
        ({"virtual_pipeline_model_parallel_size": True}, TypeError, "got a bool"),
        ({"sequence_parallel": 1}, TypeError, "`sequence_parallel` must be a bool"),
        ({"ddp": {}}, TypeError, "`ddp` must be a MegatronDDPConfig"),
        ({"reliability": {}}, TypeError, "`reliability` must be a ReliabilityConfig"),
    ],
)
def test_strategy_arguments_are_typed_and_range_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        MCoreRLStrategy(**kwargs)


def test_trainer_and_loss_flags_are_range_checked():
    with pytest.raises(ValueError, match=r"`Trainer\(gradient_clip_val=-1\)` must be a finite"):
        check_trainer_flags(1, -1, None)
    with pytest.raises(ValueError, match="must be a finite number"):
        check_trainer_flags(1, float("nan"), None)
    with pytest.raises(TypeError, match="must be a number or None"):
        check_trainer_flags(1, "1", None)
    assert check_trainer_flags(1, 0, None) == 0.0
    for cls in (ClippedPGLossConfig, DPOLossConfig, OPDFullLossConfig):
        with pytest.raises(ValueError, match="`reference_policy_kl_penalty` must be >= 0"):
            cls(reference_policy_kl_penalty=-1)


def test_16_mixed_is_rejected_where_it_reaches_the_strategy():
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_mcore_rl.strategy.precision import to_mcore_precision

    # the plugin Lightning builds for Trainer(accelerator="gpu", precision="16-mixed")
    with pytest.raises(ValueError, match="got '16-mixed': fp16 with loss scaling"):
        to_mcore_precision(MixedPrecision("16-mixed", "cuda"))
    # on CPU Lightning's connector replaces the flag by "bf16-mixed" (its own warning) before
    # any strategy sees it: documented in to_mcore_precision and docs/strategy.md
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        trainer = Trainer(accelerator="cpu", devices=1, precision="16-mixed",
                          strategy=MCoreRLStrategy(), logger=False)  # fmt: skip
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


def test_policy_counts_raises_and_stops_after_the_limit():
    check_policy("raise", 1)
    guard = NonFiniteGuard("skip", max_consecutive_skips=2)
    with pytest.warns(UserWarning, match="Skipped the training step"):
        guard._skip("x")
        guard._skip("x")
    with pytest.raises(NonFiniteError, match=r"3 consecutive .*max_consecutive_skips=2"):
        guard._skip("x")
    assert guard.skipped_steps == 3
    with pytest.raises(NonFiniteError, match="nonfinite='raise'"):
        NonFiniteGuard("raise")._skip("x")
    guard = NonFiniteGuard("skip")
    with pytest.raises(ValueError, match="bad"):
        guard.check_batch(None, ValueError("bad"), training=True)


def test_a_fit_shorter_than_the_skip_limit_that_never_updated_fails_at_its_end():
    """Issue 37 item 7: 5 steps at lr=1e4, each update rejected, max_consecutive_skips=10: the
    fit ended untrained with exit 0. Its end now raises; an updated fit ending in skips warns."""
    guard = NonFiniteGuard("skip", max_consecutive_skips=10)

    def fit(norms: list[float]) -> None:
        guard.begin_fit()
        for norm in norms:
            guard.begin_step()
            guard.check_update(
                lambda checks, norm=norm: SimpleNamespace(
                    update_successful=not checks.grad_norm_fails(norm), grad_norm=norm
                )
            )
        guard.check_fit_end()

    with (
        pytest.warns(NonFiniteWarning, match="Skipped the training step"),
        pytest.raises(NonFiniteError, match=r"Every training step of this fit was skipped "
                      r"\(5 of 5; the last: a non-finite gradient \(megatron's global grad norm: "
                      r"inf\)\): the weights never changed\. The fit ended before "
                      r"`max_consecutive_skips=10`"),
    ):  # fmt: skip
        fit([math.inf] * 5)
    with pytest.warns(NonFiniteWarning) as caught:
        fit([1.0, 2.0, math.nan, math.inf])  # updated, then 2 skips: a warning at the end
    assert str(caught[-1].message).startswith(
        "The fit ended with 2 consecutive skipped training steps (the last: a non-finite "
        "gradient (megatron's global grad norm: inf)); the weights are those of the last update"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit([1.0, 2.0])  # a fit that trained, and one with no step, end quietly
        fit([])
    # each fit (a resumed one too) is judged on its own steps
    with pytest.warns(NonFiniteWarning), pytest.raises(NonFiniteError, match=r"\(1 of 1;"):
        fit([math.inf])


def test_full_disk_and_layout_messages(tmp_path: Path):
    err = OSError(errno.ENOSPC, "No space left on device")
    message = str(ckpt._disk_full_error(err, tmp_path / "x.ckpt"))
    assert ckpt._is_disk_full(RuntimeError("wrapped").with_traceback(None)) is False
    assert re.search(r"The disk is full: .* MiB free", message)
    # megatron's shard writer: torch's CheckpointException (a BaseException) holding the
    # worker's OSError only as text (its cause does not survive the workers' queue)
    from torch.distributed.checkpoint import CheckpointException

    worker = RuntimeError("Worker failure: [Errno 28] No space left on device")
    wrapped = CheckpointException("write", {0: (worker, None)})
    assert ckpt._disk_full_cause(wrapped) is worker
    assert ckpt._is_disk_full(CheckpointException("write", {})) is False
    assert ckpt._is_disk_full(RuntimeError("Worker failure: [Errno 5] I/O error")) is False
    saved = {"use_distributed_optimizer": True, "optimizer_sharding": "dp_reshardable",
             "data_parallel_size": 2, "tensor_model_parallel_size": 1,
             "pipeline_model_parallel_size": 1}  # fmt: skip
    current = {**saved, "data_parallel_size": 1, "tensor_model_parallel_size": 2}
    with pytest.raises(ValueError, match=r'optimizer_sharding="fully_reshardable"'):
        ckpt.check_layout(saved, current)
    ckpt.check_layout({**saved, "optimizer_sharding": "fully_reshardable"}, current)
    ckpt.check_layout(saved, {**saved, "data_parallel_size": 1})  # DP alone: megatron reshards


def test_recover_interrupted_and_last_guard(tmp_path: Path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mcore_rl.strategy.resume import guard_last_checkpoint

    for name in (".last.ckpt.old", ".last.ckpt.tmp", "step=1.ckpt"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text("{}")
    (tmp_path / ".last.ckpt.tmp" / "new").write_text("")
    assert ckpt.recover_interrupted(tmp_path) == [tmp_path / "last.ckpt"]
    assert (tmp_path / "last.ckpt" / "new").exists()  # the newest complete one
    (tmp_path / "last.ckpt").rename(tmp_path / "gone")
    shutil.rmtree(tmp_path / ".last.ckpt.old")  # nothing left to recover
    trainer = Trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path)], logger=False)

    def fit(model=None, ckpt_path=None):  # noqa: ANN001, ANN202
        return None

    with pytest.raises(FileNotFoundError, match=r"found no last checkpoint .*\(step=1.ckpt\)"):
        guard_last_checkpoint(fit, (), {"ckpt_path": "last"}, trainer)
    guard_last_checkpoint(fit, (), {"ckpt_path": None}, trainer)
