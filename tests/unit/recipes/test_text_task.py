"""The text path of the RL recipes without a process group: stop tokens, prompt checks, the
right-aligned training rows of a left-padded rollout and the text task's decoding and scoring,
each against hand-written values."""

from __future__ import annotations

import pytest
import torch
from helpers.unit import word_level_tokenizer

from lightning_mcore_rl.recipes import GRPOModule, PromptBatch, TextRewardTask, TinyGPTSpec
from lightning_mcore_rl.recipes.grpo import rollout_batch
from lightning_mcore_rl.rewards import NumericAnswerReward
from lightning_mcore_rl.rollout import Rollout, SamplingConfig
from lightning_mcore_rl.rollout.source import check_prompts, stop_completions

WORDS = ["<unk>", "<pad>", "<s>", "</s>", "what", "is", "1", "2", "3", "4", "the", "answer"]
STOP = SamplingConfig(max_new_tokens=3, stop_token_ids=(3,), pad_token_id=1)


def test_completions_end_at_their_first_stop_token():
    tokens = torch.tensor([[5, 6, 3, 7, 3], [5, 6, 7, 8, 9], [5, 6, 8, 3, 3]])  # P = 2, N = 3
    logprobs = torch.tensor([[0.0, 0, -1, -2, -3], [0, 0, -4, -5, -6], [0, 0, -7, -8, -9]])
    out_tokens, mask, out_logprobs = stop_completions(tokens, logprobs, 2, STOP)
    assert out_tokens.tolist() == [[5, 6, 3, 1, 1], [5, 6, 7, 8, 9], [5, 6, 8, 3, 1]]
    assert mask.tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 0]]
    assert out_logprobs.tolist() == [[0, 0, -1, 0, 0], [0, 0, -4, -5, -6], [0, 0, -7, -8, 0]]
    # no stop ids: every sampled token is kept, prompt tokens equal to a stop id are untouched
    kept_tokens, kept_mask, _ = stop_completions(tokens, logprobs, 2, SamplingConfig(3))
    assert (
        torch.equal(kept_tokens, tokens) and kept_mask[:, 2:].all() and not kept_mask[:, :2].any()
    )


def test_prompt_lengths_are_checked():
    prompts = torch.zeros(2, 4, dtype=torch.long)
    assert check_prompts(prompts).tolist() == [4, 4]
    assert check_prompts(prompts, torch.tensor([1, 4])).tolist() == [1, 4]
    with pytest.raises(ValueError, match=r"`prompt_lengths` must lie in \[1, P=4\], got \[0, 4\]"):
        check_prompts(prompts, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"`prompt_lengths` must be integer \[B=2\]"):
        check_prompts(prompts, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="`prompts` must be integer"):
        check_prompts(prompts.float())


def test_left_padded_rollout_rows_are_right_aligned():
    # P = 3 columns (row 0: 2 real prompt tokens, row 1: 3), N = 3; row 0 stopped after 2 tokens
    tokens = torch.tensor([[1, 7, 8, 9, 3, 1], [6, 7, 8, 9, 9, 9]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]])
    logprobs = torch.tensor([[0.0, 0, 0, -1, -2, 0], [0, 0, 0, -3, -4, -5]])
    batch = rollout_batch(Rollout(tokens, mask, logprobs, torch.tensor([2, 3])))
    assert batch["input_ids"].tolist() == [[7, 8, 9, 3, 0, 0], [6, 7, 8, 9, 9, 9]]
    assert batch["input_lengths"].tolist() == [4, 6]
    assert batch["token_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert batch["generation_logprobs"].tolist() == [[0, 0, -1, -2, 0, 0], [0, 0, 0, -3, -4, -5]]
    assert batch["sample_mask"].tolist() == [1.0, 1.0]


def _prompt_batch(padding_side: str = "left") -> PromptBatch:
    return PromptBatch(
        input_ids=torch.tensor([[1, 4, 5], [4, 5, 6]]),
        input_lengths=torch.tensor([2, 3]),
        prompts=["what is", "what is 1"],
        metadata=[{"answer": "2"}, {"answer": "4"}],
        indices=torch.tensor([0, 1]),
        padding_side=padding_side,  # type: ignore[arg-type]
    )


def test_text_task_decodes_and_scores_each_completion_with_its_prompts_metadata():
    tokenizer = word_level_tokenizer(WORDS, chat_template="")
    task = TextRewardTask(reward=NumericAnswerReward(), max_prompt_length=3)
    ids, lengths = task.prompts(_prompt_batch())
    assert ids.shape == (2, 3) and lengths.tolist() == [2, 3]
    # G = 2 completions per prompt, group-major; EOS (3) and pads (1) are skipped when decoding
    tokens = torch.tensor(
        [
            [1, 4, 5, 10, 11, 7, 3],  # "the answer 2" -> 2: correct
            [1, 4, 5, 8, 3, 1, 1],  # "3": wrong
            [4, 5, 6, 9, 3, 1, 1],  # "4": correct
            [4, 5, 6, 10, 11, 3, 1],  # "the answer": no number
        ]
    )
    mask = torch.tensor(
        [[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0]]
    )
    out = Rollout(tokens, mask, torch.zeros(4, 7), torch.tensor([2, 2, 3, 3]))
    rewards = task.rewards(_prompt_batch(), out, 2, tokenizer)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_text_task_rejects_bad_batches_and_rewards():
    task = TextRewardTask(reward=NumericAnswerReward(), max_prompt_length=2)
    with pytest.raises(
        ValueError, match=r"3 tokens wide, above TextRewardTask\(max_prompt_length=2"
    ):
        task.prompts(_prompt_batch())
    with pytest.raises(ValueError, match="must be left-padded"):
        TextRewardTask(NumericAnswerReward(), 8).prompts(_prompt_batch("right"))
    with pytest.raises(TypeError, match="takes PromptBatch batches"):
        task.prompts(torch.zeros(2, 2, dtype=torch.long))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`reward` must be a reward function"):
        TextRewardTask(reward="numeric", max_prompt_length=2)  # type: ignore[arg-type]

    def nan_reward(prompts, completions, metadata):
        return torch.full((len(completions),), float("nan"))

    out = Rollout(torch.ones(2, 4, dtype=torch.long), torch.tensor([[0, 0, 1, 1]] * 2),
                  torch.zeros(2, 4), torch.tensor([2, 2]))  # fmt: skip
    batch = PromptBatch(torch.ones(1, 2, dtype=torch.long), torch.tensor([2]), ["what"],
                        [{"answer": "1"}], torch.tensor([0]))  # fmt: skip
    tokenizer = word_level_tokenizer(WORDS, chat_template="")
    with pytest.raises(ValueError, match="must return 2 finite rewards"):
        TextRewardTask(nan_reward, 8).rewards(batch, out, 2, tokenizer)


def test_a_text_task_needs_a_hugging_face_policy():
    with pytest.raises(ValueError, match="needs an HFModelSpec model, got TinyGPTSpec"):
        GRPOModule(task=TextRewardTask(NumericAnswerReward(), 8), model=TinyGPTSpec())


def test_a_config_names_the_text_task_and_its_rewards(tmp_path, monkeypatch):
    """``lmrl fit`` configs instantiate ``TextRewardTask`` with built-in rewards by class_path
    (a weighted sum of two), and the module sizes the policy by the tokenizer."""
    from lightning_mcore_rl.cli import build_cli
    from lightning_mcore_rl.rewards import FormatReward, WeightedReward

    word_level_tokenizer(WORDS, chat_template="").save_pretrained(tmp_path / "model")
    (tmp_path / "p.jsonl").write_text('{"prompt": "what is", "answer": "2"}\n')
    config = f"""
model:
  class_path: lightning_mcore_rl.recipes.GRPOModule
  init_args:
    model: {{path: {tmp_path / "model"}}}
    task:
      class_path: lightning_mcore_rl.recipes.TextRewardTask
      init_args:
        max_prompt_length: 6
        reward:
          class_path: lightning_mcore_rl.rewards.WeightedReward
          init_args:
            rewards:
              - class_path: lightning_mcore_rl.rewards.NumericAnswerReward
              - class_path: lightning_mcore_rl.rewards.FormatReward
                init_args: {{pattern: "the answer"}}
            weights: [1.0, 0.5]
    rollout: {{backend: hf, max_new_tokens: 4}}
data:
  class_path: lightning_mcore_rl.recipes.PromptFileDataModule
  init_args: {{train_files: {tmp_path / "p.jsonl"}, tokenizer: {tmp_path / "model"}}}
trainer: {{accelerator: cpu, devices: 1, logger: false}}
"""
    (tmp_path / "text.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(tmp_path / "text.yaml")], run=False)
    task = cli.model.task
    assert isinstance(task, TextRewardTask) and task.max_prompt_length == 6
    assert isinstance(task.reward, WeightedReward)
    assert isinstance(task.reward.rewards[1], FormatReward)
    assert cli.model.policy.vocab_size == len(WORDS)
    assert cli.model.policy.max_sequence_length == 6 + 4


def test_a_completion_that_ends_with_its_stop_token_is_not_truncated():
    from lightning_mcore_rl.recipes.grpo import rollout_scores

    # P = 1, N = 3: stopped early, stopped on the last token, ran out without a stop
    tokens = torch.tensor([[5, 6, 3, 1], [5, 6, 7, 3], [5, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1]])
    out = Rollout(tokens, mask, torch.zeros(3, 4), torch.tensor([1, 1, 1]))
    scores = rollout_scores(out, torch.tensor([1.0, 0.5, 0.0]), 3, (3,))
    assert scores["lengths"].tolist() == [2, 3, 3]
    assert scores["truncated"].tolist() == [False, False, True]
    assert scores["correct"].tolist() == [True, False, False]
    assert rollout_scores(out, torch.zeros(3), 3)["truncated"].tolist() == [False, True, True]
