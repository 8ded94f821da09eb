"""Rank function of the checkpoint-integrity test: a real 2-rank ``Trainer.fit`` saves a
checkpoint, then damaged copies of it are resumed with ``fit(ckpt_path="last")`` or loaded by
the fitted strategy."""

from __future__ import annotations

import os
import resource
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _reliability_runs import LMRows, Losses, TinyLM, _sampler, _trainer
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.reliability.checksums import MANIFEST
from lightning_mcore_rl.strategy import MicrobatchConfig, ResumableLoader

SHARD = "__0_1.distcp"  # rank 0 writes both shard files of the DP=2 tiny GPT checkpoint
FLIP_AT = 500_000  # a byte inside the tensor data of SHARD (773968 bytes)


def _flip(path: Path) -> None:
    """XOR one byte with 0x01: the size stays, one bit of one value changes."""
    with open(path / SHARD, "r+b") as f:
        f.seek(FLIP_AT)
        byte = f.read(1)[0]
        f.seek(FLIP_AT)
        f.write(bytes([byte ^ 0x01]))


def _truncate(path: Path) -> None:
    os.truncate(path / SHARD, (path / SHARD).stat().st_size // 2)


def _garbage_common(path: Path) -> None:
    """Same size, bytes that are no pickle (a fixed pattern: the message is reproducible)."""
    size = (path / "common.pt").stat().st_size
    (path / "common.pt").write_bytes(bytes((i * 131 + 7) % 256 for i in range(size)))


def _old_and_damaged(path: Path) -> None:
    """A checkpoint saved before checksums (no manifest), truncated shard and garbage common.pt."""
    (path / MANIFEST).unlink()
    _truncate(path)
    _garbage_common(path)


RESUMED: dict[str, Callable[[Path], None] | None] = {
    "flip": _flip,
    "dangling": None,  # last.ckpt: a symlink to a checkpoint that no longer exists
    "intact": lambda path: None,
}
"""Cases resumed by a new ``fit(ckpt_path="last")``."""

LOADED: dict[str, Callable[[Path], None]] = {
    "truncate": _truncate,
    "garbage_common": _garbage_common,
    "old": _old_and_damaged,
}
"""Cases loaded by the fitted strategy's ``load_checkpoint`` (the hook ``fit`` calls; no new
model is built for them)."""


def _fit(ckpt_dir: Path, steps: int, ckpt_path: str | None, losses: Losses) -> Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2,
                            save_top_k=-1, save_last=True)  # fmt: skip
    strategy = MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=2))
    trainer = _trainer(steps, strategy, callbacks=[saver, losses],
                       enable_checkpointing=True, gradient_clip_val=None)  # fmt: skip
    data = LMRows(48)
    loader = ResumableLoader(DataLoader(data, batch_size=2, sampler=_sampler(data)))
    trainer.fit(TinyLM(), loader, ckpt_path=ckpt_path)
    return trainer


def _attempt(load: Callable[[], Any]) -> dict[str, Any]:
    """``load()``'s error (type name, message) and the manifest warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load()
            error = None
        except Exception as err:  # noqa: BLE001 - the error is the result
            error = (type(err).__name__, str(err))
    told = [str(w.message) for w in caught if MANIFEST in str(w.message)]
    return {"error": error, "warnings": told}


def _damaged_copy(rank: int, source: Path, case_dir: Path, damage: Callable | None) -> Path:
    """Rank 0 makes ``case_dir/last.ckpt`` (a damaged copy of ``source``, or with no damage
    function a symlink to a checkpoint that is not there); then a barrier."""
    last = case_dir / "last.ckpt"
    if rank == 0:
        case_dir.mkdir()
        if damage is None:
            last.symlink_to(case_dir / "step=2.ckpt")
        else:
            shutil.copytree(source, last)
            damage(last)
    dist.barrier()
    return last


def integrity_rank(rank: int, root: str) -> dict[str, Any]:
    """Fit 4 steps (checkpoints at steps 2 and 4); each case damages a copy of step 2 as
    ``last.ckpt``."""
    source, full = Path(root) / "run" / "step=2.ckpt", Losses()
    fitted = _fit(source.parent, 4, None, full)
    out: dict[str, Any] = {"full": full.steps}
    for name, damage in RESUMED.items():
        losses = Losses()
        last = _damaged_copy(rank, source, Path(root) / name, damage)
        out[name] = _attempt(lambda d=last.parent, seen=losses: _fit(d, 4, "last", seen))
        out[name]["steps"] = losses.steps
    for name, damage in LOADED.items():
        last = _damaged_copy(rank, source, Path(root) / name, damage)
        out[name] = _attempt(lambda p=last: fitted.strategy.load_checkpoint(p))
    out["cpu_s"] = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    return out
