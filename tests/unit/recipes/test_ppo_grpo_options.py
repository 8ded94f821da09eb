"""GRPO's advantage/reference options and PPO's pieces without a process group: argument
errors, the combined loss against its two parts, the value split and shift, the YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.cli import build_cli
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    MseValueLossConfig,
    MseValueLossFn,
)
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.recipes import (
    GRPOModule,
    PPOLossFn,
    PPOModule,
    PromptDataModule,
    RolloutSpec,
)
from lightning_mcore_rl.recipes.ppo import prepare_policy_value_input, shift_values

CONFIGS = Path(__file__).parents[3] / "examples" / "configs"


def test_bad_options_raise_naming_the_argument():
    with pytest.raises(ValueError, match=r"`advantage_estimator` must be one of \['grpo', 're"):
        GRPOModule(advantage_estimator="rloo")
    with pytest.raises(ValueError, match=r"`reference_model` must be one of"):
        GRPOModule(reference_model="copy")
    kl_in_reward = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, use_kl_in_reward=True)
    with pytest.raises(ValueError, match="only 'reinforce_plus_plus' folds the KL"):
        GRPOModule(loss=kl_in_reward)
    GRPOModule(loss=kl_in_reward, advantage_estimator="reinforce_plus_plus")
    PPOModule(loss=kl_in_reward)  # GAE folds it into the token rewards
    with pytest.raises(ValueError, match=r"`gae_lambda` must be in \[0, 1\], got 1.5"):
        PPOModule(gae_lambda=1.5)
    with pytest.raises(ValueError, match="`vf_coef` must be > 0, got 0"):
        PPOModule(vf_coef=0)
    with pytest.raises(ValueError, match="`rollout.backend` must be 'megatron', got 'hf'"):
        PPOModule(rollout=RolloutSpec(backend="hf"))


def _batch() -> BatchedDataDict:
    gen = torch.Generator().manual_seed(0)
    b, s = 3, 5
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 1, 0, 0]], dtype=torch.float32)
    return BatchedDataDict(
        input_ids=torch.randint(0, 6, (b, s), generator=gen),
        token_mask=mask,
        sample_mask=torch.ones(b),
        advantages=torch.randn(b, s, generator=gen) * mask,
        generation_logprobs=-torch.rand(b, s, generator=gen),
        prev_logprobs=-torch.rand(b, s, generator=gen),
        values=torch.randn(b, s, generator=gen),
        returns=torch.randn(b, s, generator=gen),
    )


def test_ppo_loss_is_the_policy_loss_plus_the_weighted_value_loss():
    data = _batch()
    curr = -torch.rand(3, 4, generator=torch.Generator().manual_seed(1))
    values = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    n_s, n_t = torch.tensor(3.0), data["token_mask"][:, 1:].sum()
    pg = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
    vf = MseValueLossFn(MseValueLossConfig(cliprange=0.2))
    loss, metrics = PPOLossFn(pg, vf, vf_coef=0.5)(
        data, n_s, n_t, next_token_logprobs=curr, values=values
    )
    want_pg, pg_metrics = pg(data, n_s, n_t, next_token_logprobs=curr)
    want_vf, vf_metrics = vf(data, n_s, n_t, logits=values)
    torch.testing.assert_close(loss, want_pg + 0.5 * want_vf, rtol=0, atol=1e-7)
    assert metrics["policy_loss"] == want_pg and metrics["value_loss"] == want_vf
    assert metrics["vf_clipfrac"] == vf_metrics["vf_clipfrac"]
    assert metrics["probs_ratio"] == pg_metrics["probs_ratio"]
    assert set(metrics) <= set(PPOLossFn(pg, vf).metric_normalizations)


def test_value_column_is_split_unscaled_and_right_shifted():
    # [B, S, V + 1] output after the forward step divided it by T = 2 in place: the logits go to
    # the policy loss's logprobs, the last column * T shifted right by one is the values
    data = _batch()
    gen = torch.Generator().manual_seed(3)
    logits, raw = torch.randn(3, 5, 6, generator=gen), torch.randn(3, 5, generator=gen)
    output = torch.cat([logits, raw[..., None]], dim=-1) / 2.0
    pg = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
    loss_fn = PPOLossFn(pg, MseValueLossFn())
    inputs, _ = prepare_policy_value_input(
        output, data, loss_fn, 0, None, None, sampling_params=TrainingSamplingParams(2.0)
    )
    want = torch.log_softmax(logits / 2.0, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:, None])
    torch.testing.assert_close(inputs["next_token_logprobs"], want.squeeze(-1))
    torch.testing.assert_close(inputs["values"][:, 1:], raw[:, :-1])
    assert torch.equal(inputs["values"][:, 0], torch.zeros(3))
    assert torch.equal(shift_values(torch.tensor([[1.0, 2.0, 3.0]])), torch.tensor([[0, 1.0, 2]]))


def test_ppo_config_instantiates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = CONFIGS / "ppo_tiny.yaml"
    assert "Launch: lmrl fit --config examples/configs/ppo_tiny.yaml" in path.read_text()
    cli = build_cli(["--config", str(path)], run=False)
    assert isinstance(cli.trainer.strategy, MCoreRLStrategy)
    assert isinstance(cli.model, PPOModule) and isinstance(cli.datamodule, PromptDataModule)
    assert cli.model.gae_lambda == 0.95 and cli.model.loss_fn.value_loss.cfg.cliprange == 0.2
    assert cli.trainer.max_steps == cli.datamodule.num_steps
