"""``lmrl`` (LightningCLI): the strategy by registry name and by class path + init args, no
Lightning optimizer arguments, the ``export`` subcommand, and the expected-warning filters."""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta

import pytest

import lightning_mcore_rl.cli as cli_module
from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl._compat import filter_expected_warnings
from lightning_mcore_rl.cli import ConfigError, build_cli
from lightning_mcore_rl.strategy import ReliabilityConfig

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
      microbatching:
        micro_batch_size: 2
      ddp:
        use_distributed_optimizer: true
        overlap_grad_reduce: true
      checkpoint:
        optimizer_sharding: fully_reshardable
      reliability:
        timeout: 0:01:30
        nonfinite: raise
        max_consecutive_skips: 3
        process_group_backend: gloo
      logprobs:
        use_fused_linear_logprobs: true
        logprob_chunk_size: 64
"""
    )
    cli = build_cli([*BASE, f"--config={config}"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MCoreRLStrategy)
    assert strategy.microbatching.micro_batch_size == 2 and strategy.use_distributed_optimizer
    assert strategy.ddp_config.overlap_grad_reduce is True
    assert strategy.checkpoint_config.optimizer_sharding == "fully_reshardable"
    assert strategy.reliability == ReliabilityConfig(timedelta(seconds=90), "raise", 3, "gloo")
    guard = strategy.nonfinite_guard
    assert (guard.policy, guard.max_consecutive_skips) == ("raise", 3)
    assert strategy.use_fused_linear_logprobs and strategy.policy_config().logprob_chunk_size == 64
    assert strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.parametrize(
    "form",
    [
        "lightning_mcore_rl.MCoreRLStrategy",
        "MCoreRLStrategy",
        "lightning_mcore_rl.strategy.MCoreRLStrategy",
    ],
)
def test_cli_strategy_class_on_the_command_line_takes_init_args(form):
    cli = build_cli(
        [
            *BASE,
            f"--trainer.strategy={form}",
            "--trainer.strategy.tensor_model_parallel_size=2",
            "--trainer.strategy.microbatching.micro_batch_size=4",
        ],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MCoreRLStrategy)
    assert strategy.parallel.tp == 2 and strategy.microbatching.micro_batch_size == 4


def test_cli_offers_no_lightning_optimizer_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--trainer.max_steps" in help_text
    assert "--optimizer" not in help_text and "--lr_scheduler" not in help_text
    with pytest.raises(ConfigError, match="unrecognized arguments: --optimizer"):
        build_cli([*BASE, "--optimizer=torch.optim.Adam"], run=False)


def test_lmrl_export_dispatches_before_lightning_cli(capsys, monkeypatch):
    monkeypatch.setattr(cli_module, "build_cli", _unexpected_build_cli)
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["export", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: lmrl export" in out and "--hf-source" in out and "--ckpt" in out
    # from the console script's argv too
    monkeypatch.setattr(sys, "argv", ["lmrl", "export", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    assert exit_info.value.code == 0 and "--hf-source" in capsys.readouterr().out


def test_lmrl_export_passes_its_arguments_to_export_main(monkeypatch):
    import lightning_mcore_rl.strategy.export as export

    calls = []
    monkeypatch.setattr(export, "main", lambda argv: calls.append(argv) or 0)
    argv = ["export", "--ckpt", "c", "--hf-source", "h", "--out", "o"]
    assert cli_module.main(argv) == 0
    assert calls == [argv[1:]]


def test_lmrl_fit_still_goes_to_lightning_cli(monkeypatch):
    calls = []
    monkeypatch.setattr(cli_module, "build_cli", lambda args: calls.append(args))
    assert cli_module.main(["fit", "--config", "x.yaml"]) is None
    assert calls == [["fit", "--config", "x.yaml"]]


def _unexpected_build_cli(*args, **kwargs):
    raise AssertionError("`lmrl export` must not reach LightningCLI")


def _shown(message: str, category: type[Warning], module: str) -> list[str]:
    """Messages that reach the user when ``module`` warns ``message``."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        filter_expected_warnings()
        warnings.warn_explicit(message, category, "file.py", 1, module=module)
    return [str(w.message) for w in record]


@pytest.mark.parametrize(
    ("message", "category", "module"),
    [
        (
            "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
            UserWarning,
            "megatron.core.optimizer",
        ),
        (
            "Transformer Engine and Apex are not installed. Falling back to local "
            "implementations of multi_tensor_applier and multi_tensor_scale",
            UserWarning,
            "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
        ),
        (
            "Apex is not installed. Falling back to Torch Norm",
            UserWarning,
            "megatron.core.models.backends",
        ),
        (
            "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
            UserWarning,
            "megatron.core.transformer.transformer_config",
        ),
        (
            "Warning: tp_group is None, using default tp group.",
            DeprecationWarning,
            "megatron.core.tensor_parallel.layers",
        ),
    ],
)
def test_filter_expected_warnings_hides_megatrons_no_te_apex_warnings(message, category, module):
    assert _shown(message, category, module) == []


@pytest.mark.parametrize(
    ("message", "category", "module"),
    [
        ("something unrelated", UserWarning, "megatron.core.optimizer"),  # megatron, other message
        (
            "Apex is not installed. Falling back to Torch Norm",
            UserWarning,
            "my_project",
        ),  # elsewhere
        ("old API", DeprecationWarning, "lightning.pytorch"),  # another package's deprecation
        (
            "When using async grad allreduce it is recommended to set the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
            UserWarning,
            "megatron.core.tensor_parallel.layers",
        ),  # a GPU hint: hidden only with cpu=True
    ],
)
def test_filter_expected_warnings_keeps_other_warnings(message, category, module):
    assert _shown(message, category, module) == [message]


def test_filter_expected_warnings_cpu_hides_cuda_hints():
    message = (
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        filter_expected_warnings(cpu=True)
        filter_expected_warnings(cpu=True)  # idempotent: no duplicate filters
        ignored = [f for f in warnings.filters if f[0] == "ignore"]
        assert len(ignored) == len(set(ignored))
        warnings.warn_explicit(
            message, UserWarning, "layers.py", 738, module="megatron.core.tensor_parallel.layers"
        )
    assert record == []


def test_main_installs_the_warning_filters(monkeypatch):
    calls = []
    monkeypatch.setattr(cli_module, "filter_expected_warnings", lambda: calls.append(True))
    monkeypatch.setattr(cli_module, "build_cli", lambda args: None)
    cli_module.main(["fit"])
    assert calls == [True]
