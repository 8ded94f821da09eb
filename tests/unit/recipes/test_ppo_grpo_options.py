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
from lightning_mcore_rl.recipes.grpo import prev_logprobs_skippable
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
    with pytest.raises(ValueError, match=r"`prev_logprobs_pass` must be one of \['auto', 'al"):
        GRPOModule(prev_logprobs_pass="never")  # type: ignore[arg-type]


NO_KL = {"reference_policy_kl_penalty": 0.0}
SEQ = {"token_level_loss": False}
TIS = {"use_importance_sampling_correction": True}


@pytest.mark.parametrize(
    ("loss", "staleness", "skipped"),
    [
        ({}, 0, True),  # the default GRPO loss with its reference KL: the KL reads ref only
        ({**NO_KL, "ratio_clip_c": 3.0, "entropy_coef": 0.01}, 0, True),
        ({**NO_KL, "force_on_policy_ratio": True}, 0, True),
        (NO_KL, 1, False),  # asynchronous: trained by newer weights than sampled it
        ({**NO_KL, **TIS}, 0, False),
        ({**NO_KL, "use_kl_in_reward": True}, 0, False),  # the advantages read prev_logprobs
        ({**NO_KL, **SEQ, "sequence_level_importance_ratios": True}, 0, False),  # GSPO
        ({**NO_KL, "disable_ppo_ratio": True}, 0, False),  # REINFORCE: -A c, not -A
        ({**NO_KL, "use_cispo": True}, 0, False),
    ],
)
def test_prev_logprobs_pass_skipped_only_where_it_cannot_matter(loss, staleness, skipped):
    config = ClippedPGLossConfig(**loss)
    rollout = RolloutSpec(max_staleness=staleness)
    assert prev_logprobs_skippable(config, rollout) is skipped
    # a KL in the reward needs the estimator that folds it in
    estimator = "reinforce_plus_plus" if config.use_kl_in_reward else "grpo"
    module = GRPOModule(loss=config, rollout=rollout, advantage_estimator=estimator)
    # a skipped pass: the loss takes the ratio's denominator from its own forward
    assert ("prev_logprobs" not in module.loss_fn.input_keys) is skipped
    assert module._needs_prev_logprobs() is not skipped
    assert GRPOModule(
        loss=config, rollout=rollout, advantage_estimator=estimator, prev_logprobs_pass="always"
    )._needs_prev_logprobs()
    # PPO keeps its pass (GAE and its loss read prev_logprobs)
    if staleness == 0 and not loss.get("use_cispo"):
        assert PPOModule(loss=config)._needs_prev_logprobs()


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
