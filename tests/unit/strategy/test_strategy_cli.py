"""``lmrl`` (LightningCLI): the strategy by registry name and by class_path + init_args."""

from __future__ import annotations

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.cli import build_cli

BASE = [
    "--model=lightning_mcore_rl.MCoreRLModule",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.logger=false",
]


def test_cli_strategy_by_registry_name():
    cli = build_cli([*BASE, "--trainer.strategy=mcore_rl"], run=False)
    assert isinstance(cli.trainer.strategy, MCoreRLStrategy)


def test_cli_strategy_from_yaml_class_path_with_nested_configs(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  precision: bf16-mixed
  strategy:
    class_path: lightning_mcore_rl.MCoreRLStrategy
    init_args:
      micro_batch_size: 2
      use_distributed_optimizer: true
      ddp:
        overlap_grad_reduce: true
      checkpoint:
        optimizer_sharding: fully_reshardable
"""
    )
    cli = build_cli([*BASE, f"--config={config}"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MCoreRLStrategy)
    assert strategy.micro_batch_size == 2 and strategy.use_distributed_optimizer
    assert strategy.ddp_config.overlap_grad_reduce is True
    assert strategy.checkpoint_config.optimizer_sharding == "fully_reshardable"
    assert strategy.precision_plugin.precision == "bf16-mixed"
