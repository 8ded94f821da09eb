"""megatron's log lines every run would print are dropped (megatron-core 0.19's GPTModel
deprecation, once per model build); its other lines still show."""

from __future__ import annotations

import logging

import pytest

import lightning_mcore_rl  # noqa: F401 - importing installs the filters


def test_gpt_model_deprecation_line_is_dropped_and_others_kept(caplog: pytest.LogCaptureFixture):
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
        logger.warning("some other megatron warning")
    assert [r.getMessage() for r in caplog.records] == ["some other megatron warning"]
