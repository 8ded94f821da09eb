"""The shipped SFT, DPO and reward-model configs parse and instantiate (no run), open with their
launch command, and keep the model's vocabulary and length equal to the data's."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.cli import build_cli
from lightning_mcore_rl.losses import DPOLossFn, NLLLossFn, PreferenceLossFn
from lightning_mcore_rl.recipes import (
    DPOModule,
    PreferenceDataModule,
    RewardModelModule,
    SFTDataModule,
    SFTModule,
)

CONFIGS = Path(__file__).parents[3] / "examples" / "configs"
RECIPES = {
    "sft_tiny.yaml": (SFTModule, SFTDataModule, NLLLossFn),
    "dpo_tiny.yaml": (DPOModule, PreferenceDataModule, DPOLossFn),
    "rm_tiny.yaml": (RewardModelModule, PreferenceDataModule, PreferenceLossFn),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_config_instantiates(name: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the CLI writes config.yaml into the logger's directory
    path = CONFIGS / name
    assert path.read_text().startswith("# ")
    assert f"# Launch: lmrl fit --config examples/configs/{name}\n" in path.read_text()
    cli = build_cli(["--config", str(path)], run=False)
    module_type, data_type, loss_type = RECIPES[name]
    assert isinstance(cli.trainer.strategy, MCoreRLStrategy)
    assert isinstance(cli.model, module_type) and isinstance(cli.model.loss_fn, loss_type)
    assert isinstance(cli.datamodule, data_type)
    data, model = cli.datamodule, cli.model.policy
    assert model.vocab_size == data.task.vocab_size
    assert model.max_sequence_length == data.task.prompt_length + data.max_new_tokens
    assert cli.trainer.max_steps == data.num_steps


def test_every_shipped_config_is_named_by_a_test():
    # grpo_*.yaml: test_example_configs.py instantiates them all; any other by its file name
    texts = [path.read_text() for path in Path(__file__).parents[2].rglob("test_*.py")]
    others = [path.name for path in CONFIGS.glob("*.yaml") if not path.name.startswith("grpo_")]
    missing = [name for name in others if not any(name in text for text in texts)]
    assert not missing, f"no test names the configs {missing}"


def test_sft_config_packs_rows_into_token_budget_microbatches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(CONFIGS / "sft_tiny.yaml")], run=False)
    batching = cli.trainer.strategy.microbatching
    assert batching.sequence_packing and batching.max_tokens_per_microbatch == 64


def test_dpo_loss_settings_override_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [
        "--config",
        str(CONFIGS / "dpo_tiny.yaml"),
        "--model.init_args.loss.sft_loss_weight=0.5",
        "--model.init_args.model.num_layers=3",
    ]
    cli = build_cli(args, run=False)
    cfg = cli.model.loss_fn.cfg
    assert cfg.sft_loss_weight == 0.5 and cfg.reference_policy_kl_penalty == 0.1
    assert cli.model.model_spec.num_layers == 3 and cli.model.model_spec.hidden_size == 64


def test_reward_model_module_takes_the_tiny_gpt_or_an_hf_checkpoint():
    from lightning_mcore_rl.recipes import HFModelSpec

    module = RewardModelModule(model=HFModelSpec(path="x"))  # read when the chunks are built
    assert module.model_spec == HFModelSpec(path="x")
    with pytest.raises(TypeError, match=r"\(`HFModelSpec`\), got dict"):
        RewardModelModule(model={"num_layers": 2})  # type: ignore[arg-type]
