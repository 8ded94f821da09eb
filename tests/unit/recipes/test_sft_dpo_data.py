"""The SFT/DPO recipes' toy data and host-side checks, by hand (no ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_mcore_rl.recipes import (
    CountingPreferenceDataset,
    CountingSFTDataset,
    DPOModule,
    PreferenceDataModule,
    SFTDataModule,
    SFTModule,
    collate_pairs,
)
from lightning_mcore_rl.recipes.common import check_rows
from lightning_mcore_rl.recipes.dpo import (
    check_pair_microbatching,
    check_preference_batch,
    shift_left,
)
from lightning_mcore_rl.recipes.toy_data import demonstration
from lightning_mcore_rl.rollout import ModularCountingTask

TASK = ModularCountingTask()  # V = 16, P = 8, m = 4


def test_demonstration_counts_modulo_m_from_the_last_prompt_token():
    prompts = torch.tensor([[3, 7], [9, 14]])
    # last tokens 7 and 14: residues 3 and 2; each next token is the next residue
    assert demonstration(TASK, prompts, 3).tolist() == [[0, 1, 2], [3, 0, 1]]


def test_sft_rows_mask_exactly_the_response_tokens():
    data = CountingSFTDataset(TASK, num_samples=64, max_new_tokens=8, seed=3)
    rows = data.rows
    lengths, mask, ids = rows["input_lengths"], rows["token_mask"], rows["input_ids"]
    assert ids.shape == (64, 16) and mask.shape == (64, 16)
    assert set(lengths.tolist()) == set(range(9, 17))  # P + 1 .. P + N
    positions = torch.arange(16)[None, :]
    expected = (positions >= 8) & (positions < lengths[:, None])
    assert torch.equal(mask.bool(), expected)
    assert torch.all(ids[positions.expand_as(ids) >= lengths[:, None]] == 0)  # right padding
    assert torch.all(TASK.rewards(ids, mask) == 1.0)
    assert torch.equal(data[5]["input_ids"], ids[5])


def test_preference_pairs_interleave_a_correct_and_a_rule_breaking_response():
    data = CountingPreferenceDataset(TASK, num_pairs=32, max_new_tokens=8, seed=1)
    batch = collate_pairs([data[i] for i in range(4)])
    assert batch["input_ids"].shape == (8, 16)
    chosen, rejected = batch["input_ids"][::2], batch["input_ids"][1::2]
    assert torch.equal(chosen[:, :8], rejected[:, :8])  # the same prompt
    assert torch.equal(batch["input_lengths"][::2], batch["input_lengths"][1::2])
    assert torch.equal(batch["token_mask"][::2], batch["token_mask"][1::2])
    full = collate_pairs([data[i] for i in range(32)])
    rewards = TASK.rewards(full["input_ids"], full["token_mask"])
    assert torch.all(rewards[::2] == 1.0) and torch.all(rewards[1::2] == 0.0)
    # both responses spread over the vocabulary: only the rule tells them apart
    responses = full["input_ids"][full["token_mask"].bool()]
    assert int(responses.max()) >= 3 * TASK.modulus
    easy = CountingPreferenceDataset(TASK, 32, 8, seed=1, chosen_demonstration=True)
    assert torch.all(easy.rows["input_ids"][:, 0, 8:] < TASK.modulus)  # the demonstrations
    assert torch.all(TASK.rewards(easy.rows["input_ids"][:, 0], easy.rows["token_mask"][:, 0]) == 1)


def test_shift_left_puts_the_next_tokens_logprob_at_each_position():
    stored = torch.tensor([[0.0, -1.0, -2.0, -3.0]])  # lp[:, t] = log p(x_t | x_<t)
    # DPOLossFn reads out[:, :-1]: out[:, t] = log p(x_{t+1} | x_<=t)
    assert shift_left(stored).tolist() == [[-1.0, -2.0, -3.0, 0.0]]


def _pairs(rows: int = 4) -> dict[str, torch.Tensor]:
    data = CountingPreferenceDataset(TASK, num_pairs=rows // 2, max_new_tokens=8)
    return collate_pairs([data[i] for i in range(rows // 2)])


def test_preference_batch_checks_name_the_key():
    check_preference_batch("DPOModule", _pairs(), 16)  # a good batch passes
    batch = _pairs()
    del batch["token_mask"]
    with pytest.raises(ValueError, match=r"DPOModule's batch is missing the key `token_mask`"):
        check_preference_batch("DPOModule", batch, 16)
    with pytest.raises(ValueError, match=r"rows are 16 tokens wide, above the model's "):
        check_preference_batch("DPOModule", _pairs(), 12)
    odd = {key: value[:3] for key, value in _pairs().items()}
    with pytest.raises(ValueError, match=r"needs an even number of rows; got 3\."):
        check_preference_batch("DPOModule", odd, 16)
    unequal = _pairs()
    unequal["sample_mask"][3] = 0.0
    with pytest.raises(ValueError, match=r"pair 1 \(rows 2, 3\) has 1.0 / 0.0"):
        check_preference_batch("DPOModule", unequal, 16)
    with pytest.raises(TypeError, match=r"DPOModule takes a mapping batch, got list"):
        check_rows("DPOModule", [], ("input_ids",), 16)  # type: ignore[arg-type]


def test_pair_microbatching_rejects_token_budgets_and_odd_microbatches():
    check_pair_microbatching("DPOModule", 8, None)
    with pytest.raises(ValueError, match=r"`max_tokens_per_microbatch=64` regroups rows by"):
        check_pair_microbatching("DPOModule", 1, 64)
    with pytest.raises(ValueError, match=r"`micro_batch_size` must be even, got 3\."):
        check_pair_microbatching("DPOModule", 3, None)


@pytest.mark.parametrize(
    ("data", "name", "size"),
    [
        (SFTDataModule(samples_per_step=16, num_steps=3), "samples_per_step", 48),
        (PreferenceDataModule(pairs_per_step=8, num_steps=3), "pairs_per_step", 24),
    ],
)
def test_datamodules_split_each_step_over_data_parallel_ranks(data, name: str, size: int):
    data.trainer = SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0})
    )
    loader = data.train_dataloader()
    assert len(loader.dataset) == size
    batch = next(iter(loader))
    expected_rows = 8  # SFT: 16 rows / 2 ranks; DPO: 8 pairs / 2 ranks = 4 pairs = 8 rows
    assert batch["input_ids"].shape == (expected_rows, 16)
    data.trainer.strategy.distributed_sampler_kwargs["num_replicas"] = 3
    with pytest.raises(
        ValueError, match=rf"`{name}` \(\d+\) must be divisible by the data-parallel"
    ):
        data.train_dataloader()


def test_recipe_defaults_are_not_shared_between_instances():
    first, second = SFTModule(), SFTModule()
    first.model_spec.num_layers = 5
    assert second.model_spec.num_layers == 2
    dpo = DPOModule(loss=None, model=None)
    assert dpo.loss_fn.cfg.reference_policy_kl_penalty == 0.05  # NeMo RL's beta
