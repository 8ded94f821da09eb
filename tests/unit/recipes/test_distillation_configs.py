"""The distillation recipe without a process group: the shipped configs distill_topk_tiny.yaml and
distill_full_tiny.yaml parse and instantiate (no run), the module's options are validated at
construction, and the rollout rows become the loss's batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.cli import build_cli
from lightning_mcore_rl.losses import DistillationLossFn, OPDFullLossConfig, OPDFullLossFn
from lightning_mcore_rl.recipes import (
    DistillationModule,
    HFModelSpec,
    PromptDataModule,
    TeacherSpec,
    TinyGPTSpec,
)

CONFIGS = Path(__file__).parents[3] / "examples" / "configs"
RECIPES = {"distill_topk_tiny.yaml": DistillationLossFn, "distill_full_tiny.yaml": OPDFullLossFn}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_config_instantiates(name: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the CLI writes config.yaml into the logger's directory
    text = (CONFIGS / name).read_text()
    assert (
        text.startswith("# ") and f"# Launch: lmrl fit --config examples/configs/{name}\n" in text
    )
    cli = build_cli(["--config", str(CONFIGS / name)], run=False)
    module, data = cli.model, cli.datamodule
    assert isinstance(cli.trainer.strategy, MCoreRLStrategy)
    assert isinstance(module, DistillationModule) and isinstance(data, PromptDataModule)
    assert isinstance(module.loss_fn, RECIPES[name])
    assert module.task == data.task and cli.trainer.max_steps == data.num_steps
    assert module.model_spec == TinyGPTSpec(seed=1)
    assert module.teacher_spec == TeacherSpec(model=TinyGPTSpec(seed=0))
    assert module.policy.vocab_size == module.teacher_model.vocab_size == data.task.vocab_size
    if name == "distill_topk_tiny.yaml":
        assert module.topk == 8 and module.loss_fn.cfg.zero_outside_topk
    else:
        assert module.payload == "hidden_states"


def test_teacher_checkpoint_and_loss_override_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        [
            "--config", str(CONFIGS / "distill_topk_tiny.yaml"),
            "--model.init_args.teacher.checkpoint=runs/grpo/step=40.ckpt",
            "--model.init_args.teacher.model.num_layers=3",
            "--model.init_args.topk_loss.kl_type=forward",
            "--model.init_args.topk=4",
        ],
        run=False,
    )  # fmt: skip
    module = cli.model
    assert module.teacher_spec.checkpoint == "runs/grpo/step=40.ckpt"
    assert module.teacher_spec.checkpoint_prefix == ""
    assert module.teacher_spec.model == TinyGPTSpec(num_layers=3, seed=0)
    assert module.loss_fn.cfg.kl_type == "forward" and module.loss_fn.cfg.zero_outside_topk
    assert module.topk == 4


def test_defaults_are_not_shared_between_instances():
    first, second = DistillationModule(), DistillationModule()
    first.rollout.group_size = 8
    first.model_spec.num_layers = 5
    first.teacher_spec.model.num_layers = 6
    assert second.rollout.group_size == 4 and second.model_spec.num_layers == 2
    assert second.teacher_spec.model.num_layers == 2
    none = DistillationModule(task=None, model=None, teacher=None, rollout=None, topk_loss=None)
    assert isinstance(none.loss_fn, DistillationLossFn) and none.teacher_spec == TeacherSpec()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocabulary": "dense"}, r"`vocabulary` must be one of \['topk', 'full'\], got 'dense'"),
        ({"payload": "probs"}, r"`payload` must be one of \['logits', 'hidden_states'\], got"),
        ({"topk": 0}, r"`topk` must be in \[1, V=16\], got 0"),
        ({"topk": 17}, r"`topk` must be in \[1, V=16\], got 17"),
        (
            {"full_loss": OPDFullLossConfig(reference_policy_kl_penalty=0.1)},
            r"no reference policy: `full_loss.reference_policy_kl_penalty` must be 0, got 0.1",
        ),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistillationModule(**kwargs)


def _hf_dir(directory: Path, vocab_size: int) -> HFModelSpec:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return HFModelSpec(path=str(directory))


def test_an_hf_model_sets_the_shared_vocabulary(tmp_path):
    small, large = _hf_dir(tmp_path / "v32", 32), _hf_dir(tmp_path / "v48", 48)
    module = DistillationModule(teacher=TeacherSpec(model=small), topk=32)
    assert module.policy.vocab_size == module.teacher_model.vocab_size == 32  # the tiny student
    with pytest.raises(ValueError, match=r"vocab_size 48 \(model\) and 32 \(teacher\)"):
        DistillationModule(model=large, teacher=TeacherSpec(model=small))


def test_rollout_rows_become_the_distillation_batch():
    from lightning_mcore_rl.recipes.grpo import rollout_batch
    from lightning_mcore_rl.rollout import Rollout

    tokens = torch.tensor([[3, 5, 2, 3], [1, 1, 2, 0]])  # [B=2, P+N=4], P = 2
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]])
    batch = rollout_batch(Rollout(tokens, mask, torch.zeros(2, 4), torch.tensor([2, 2])))
    assert torch.equal(batch["input_ids"], tokens)
    assert batch["input_lengths"].tolist() == [4, 4]
    assert batch["token_mask"].dtype == torch.float32 and torch.equal(
        batch["token_mask"], mask.float()
    )
    assert batch["sample_mask"].tolist() == [1.0, 1.0]
