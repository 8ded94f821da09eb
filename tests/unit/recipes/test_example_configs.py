"""Every shipped YAML config parses and instantiates (no run), and matches the example script."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.cli import build_cli
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule

CONFIGS = sorted((Path(__file__).parents[3] / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_instantiates(path: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the CLI writes config.yaml into the logger's directory
    text = path.read_text()
    assert text.startswith("# ") and "Launch: lmrl fit --config examples/configs/" in text
    cli = build_cli(["--config", str(path)], run=False)
    assert isinstance(cli.trainer.strategy, MCoreRLStrategy)
    assert isinstance(cli.model, GRPOModule)
    assert isinstance(cli.datamodule, PromptDataModule)
    assert cli.model.task.modulus == 4 and cli.model.rollout.group_size == 4
    assert cli.trainer.max_steps == cli.datamodule.num_steps


def test_grpo_module_rejects_kl_in_reward():
    from lightning_mcore_rl.losses import ClippedPGLossConfig

    with pytest.raises(ValueError, match="`use_kl_in_reward=True` is not supported"):
        GRPOModule(loss=ClippedPGLossConfig(use_kl_in_reward=True))


def test_prompt_datamodule_splits_prompts_over_data_parallel_ranks():
    from types import SimpleNamespace

    data = PromptDataModule(prompts_per_step=16, num_steps=3)
    data.trainer = SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2})
    )
    loader = data.train_dataloader()
    assert loader.batch_size == 8 and len(loader.dataset) == 48
    data.trainer.strategy.distributed_sampler_kwargs["num_replicas"] = 3
    with pytest.raises(ValueError, match=r"`prompts_per_step` \(16\) must be divisible by the"):
        data.train_dataloader()
