"""Every shipped YAML config parses and instantiates (no run), and matches the example script."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict
from pathlib import Path

import pytest

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.cli import ConfigError, build_cli
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule

CONFIGS = sorted((Path(__file__).parents[3] / "examples" / "configs").glob("grpo_*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_instantiates(path: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the CLI writes config.yaml into the logger's directory
    text = path.read_text()
    assert text.startswith("# ") and "Launch: lmrl fit --config examples/configs/" in text
    if "backend: vllm" in text and importlib.util.find_spec("vllm") is None:
        # refused at construction, naming the install (not at the first rollout)
        with pytest.raises(ConfigError, match=r"backend='vllm' needs vLLM.*bootstrap_vllm"):
            build_cli(["--config", str(path)], run=False)
        return
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


def test_print_config_shows_the_effective_recipe_settings(tmp_path, monkeypatch, capsys):
    import yaml

    from lightning_mcore_rl.recipes.grpo import DEFAULT_GRPO_LOSS, RolloutSpec, TinyGPTSpec

    monkeypatch.chdir(tmp_path)
    path = Path(__file__).parents[3] / "examples" / "configs" / "grpo_tiny.yaml"
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["--config", str(path), "--print_config"], run=False)
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    model = config["model"]["init_args"]
    assert model["loss"] == asdict(DEFAULT_GRPO_LOSS)  # no `loss: null`
    assert model["loss"]["reference_policy_kl_penalty"] == 0.0
    assert model["loss"]["ratio_clip_min"] == 0.2 and model["loss"]["ratio_clip_max"] == 0.2
    assert model["model"] == asdict(TinyGPTSpec())
    assert model["rollout"] == asdict(RolloutSpec())
    assert config["data"]["init_args"]["task"] == {
        "vocab_size": 16,
        "prompt_length": 8,
        "modulus": 4,
    }


def test_recipe_settings_override_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = Path(__file__).parents[3] / "examples" / "configs" / "grpo_tiny.yaml"
    cli = build_cli(
        [
            "--config",
            str(path),
            "--model.init_args.loss.ratio_clip_max=0.28",
            "--model.init_args.model.num_layers=3",
        ],
        run=False,
    )
    assert cli.model.loss_fn.cfg.ratio_clip_max == 0.28
    assert cli.model.loss_fn.cfg.ratio_clip_min == 0.2  # the rest keeps the defaults
    assert cli.model.kl_penalty == 0.0
    assert cli.model.model_spec.num_layers == 3 and cli.model.model_spec.hidden_size == 64


def test_grpo_module_defaults_are_not_shared_between_instances():
    first, second = GRPOModule(), GRPOModule()
    first.rollout.group_size = 8
    first.model_spec.num_layers = 5
    assert second.rollout.group_size == 4 and second.model_spec.num_layers == 2
    assert GRPOModule(loss=None, model=None, rollout=None, task=None).kl_penalty == 0.0


ALL_CONFIGS = sorted((Path(__file__).parents[3] / "examples").glob("**/*.yaml"))


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_configs_end_at_max_steps_alone(path: Path):
    # An epoch bound would end a resumed run (`--ckpt_path ... --trainer.max_steps=<more>`) at
    # the checkpoint's epoch, training nothing. No progress-bar callback either: it would clash
    # with `--trainer.enable_progress_bar=false`.
    import yaml

    trainer = yaml.safe_load(path.read_text())["trainer"]
    assert "max_epochs" not in trainer and trainer["max_steps"] > 0
    callbacks = trainer.get("callbacks") or []
    assert not any("ProgressBar" in c["class_path"] for c in callbacks)
