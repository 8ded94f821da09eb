"""The two Lightning warnings every recipe run printed (an empty ``val_dataloader`` list, torch
2.13's ``LeafSpec`` deprecation inside Lightning's pytree helper) are filtered, from Lightning's
own call sites; an empty ``DataLoader`` still warns."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities._pytree import _tree_flatten
from lightning.pytorch.utilities.data import has_len_all_ranks
from torch.utils.data import DataLoader

from lightning_mcore_rl._compat import filter_expected_warnings


def _shown(call, filtered: bool = True) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if filtered:
            filter_expected_warnings()
        call()
    return [str(w.message) for w in record]


def test_lightnings_per_run_warnings_are_filtered():
    strategy = SingleDeviceStrategy(torch.device("cpu"))
    no_validation = lambda: has_len_all_ranks([], strategy)  # noqa: E731 - a recipe's `[]`
    flatten = lambda: _tree_flatten([])  # noqa: E731 - what EvaluationLoop.setup_data runs
    assert any("Total length of `list`" in m for m in _shown(no_validation, filtered=False))
    assert any("LeafSpec" in m for m in _shown(flatten, filtered=False))
    assert _shown(no_validation) == []
    assert _shown(flatten) == []
    empty_loader = lambda: has_len_all_ranks(DataLoader([]), strategy)  # noqa: E731
    assert any("Total length of `DataLoader`" in m for m in _shown(empty_loader))
