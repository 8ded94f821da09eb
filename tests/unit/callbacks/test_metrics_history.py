"""``MetricsHistory`` with a plain single-process ``LightningModule``: 0-based logger steps,
validation values only on the step validation ran after, files on exception, optional plot."""

from __future__ import annotations

import csv
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_mcore_rl.callbacks import MetricsHistory


class CountingModule(LightningModule):
    """Logs ``metric = 10 * batch_idx`` every training step and ``val_metric = 100 * step``
    (``step`` = optimizer steps done) in validation; raises in training step ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.fail_at = fail_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise RuntimeError(f"boom at step {batch_idx}")
        self.log("metric", 10.0 * batch_idx)
        return (self.weight * batch).sum()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_metric", 100.0 * self.global_step)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.ones(8, 1), batch_size=1)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.ones(2, 1), batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: LightningModule, callback: MetricsHistory, **kwargs) -> Trainer:
    trainer = cpu_trainer(
        devices=1,
        max_steps=4,
        val_check_interval=2,
        num_sanity_val_steps=1,
        callbacks=[callback],
        **kwargs,
    )
    trainer.fit(module)
    return trainer


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


EXPECTED = [
    {"step": "0", "metric": "0.0", "val_metric": ""},
    {"step": "1", "metric": "10.0", "val_metric": "200.0"},  # validation after 2 optimizer steps
    {"step": "2", "metric": "20.0", "val_metric": ""},
    {"step": "3", "metric": "30.0", "val_metric": "400.0"},
]


def test_rows_use_logger_steps_and_val_values_only_where_validation_ran(tmp_path):
    callback = MetricsHistory(tmp_path / "out", plot_keys=("metric", "val_metric"))
    _fit(CountingModule(), callback)
    assert _read_csv(tmp_path / "out" / "metrics.csv") == EXPECTED
    assert (tmp_path / "out" / "metrics.png").stat().st_size > 0
    assert [row["step"] for row in callback.rows] == [0, 1, 2, 3]


def test_steps_match_what_lightning_loggers_receive(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    callback = MetricsHistory(tmp_path / "out", plot_keys=())
    trainer = cpu_trainer(
        devices=1,
        max_steps=4,
        val_check_interval=2,
        logger=CSVLogger(tmp_path, name="logs", version=0),
        log_every_n_steps=1,
        callbacks=[callback],
    )
    trainer.fit(CountingModule())
    logged = _read_csv(tmp_path / "logs" / "version_0" / "metrics.csv")
    by_lightning = {(r["step"], k): r[k] for r in logged for k in ("metric", "val_metric") if r[k]}
    ours = {(r["step"], k): r[k] for r in EXPECTED for k in ("metric", "val_metric") if r[k]}
    assert by_lightning == ours


def test_exception_writes_the_steps_so_far_once(tmp_path):
    callback = MetricsHistory(tmp_path / "out", plot_keys=("metric",))
    with pytest.raises(RuntimeError, match="boom at step 2"):
        _fit(CountingModule(fail_at=2), callback)
    path = tmp_path / "out" / "metrics.csv"
    assert _read_csv(path) == EXPECTED[:2]
    # a second write (no new values) is a no-op: the files are not rewritten
    path.write_text("sentinel")
    callback.write()
    assert path.read_text() == "sentinel"


def test_missing_matplotlib_warns_once_and_still_writes_the_csv(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` -> ImportError
    callback = MetricsHistory(tmp_path / "out", plot_keys=("metric",))
    with pytest.warns(UserWarning, match=r"pip install lightning-mcore-rl\[plot\]") as record:
        _fit(CountingModule(), callback)
        callback._rows[99] = {"step": 99, "metric": 1.0}  # new values: a second write
        callback.write()
    assert sum("matplotlib is not installed" in str(w.message) for w in record) == 1
    rows = _read_csv(tmp_path / "out" / "metrics.csv")
    assert rows[:4] == EXPECTED and rows[4]["step"] == "99"
    assert not (tmp_path / "out" / "metrics.png").exists()


def test_sanity_check_and_standalone_validation_are_not_recorded(tmp_path):
    callback = MetricsHistory(tmp_path / "out", plot_keys=())
    trainer = _fit(CountingModule(), callback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(trainer.lightning_module, verbose=False)
    assert [row.get("val_metric") for row in callback.rows] == [None, 200.0, None, 400.0]
