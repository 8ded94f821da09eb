"""The arithmetic word problems of ``examples/arithmetic``: seeded and deterministic, disjoint
splits, answers equal to the operation recomputed from the prompt's numbers, the trained
tokenizer's round trip and special ids, the tiny Llama's vocabulary and ids, and the numeric
verifier on the reference and a wrong response."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_mcore_rl.recipes.arithmetic import (
    SPECIAL_TOKENS,
    ArithmeticProblem,
    evaluate_hf,
    greedy_completions,
    make_splits,
    train_tokenizer,
    write_rl_rows,
    write_sft_rows,
    write_tiny_llama,
)
from lightning_mcore_rl.rewards import NumericAnswerReward

OPERATIONS = ("add", "subtract", "multiply")


def _recomputed(problem: ArithmeticProblem) -> int:
    """The answer from the prompt's words alone: its two numbers and the operation's verb."""
    a, b = (int(n) for n in re.findall(r"\d+", problem.prompt))
    if "bags with" in problem.prompt:
        return a * b
    if " gives " in problem.prompt and " to " in problem.prompt or " lost " in problem.prompt:
        return a - b
    return a + b


@pytest.fixture(scope="module")
def splits() -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    return make_splits(600, 100, seed=3, operations=OPERATIONS)


def test_splits_are_seeded_disjoint_and_correct(splits):
    train, val = splits
    assert (len(train), len(val)) == (600, 100)
    assert make_splits(600, 100, seed=3, operations=OPERATIONS) == splits  # deterministic
    assert make_splits(600, 100, seed=4, operations=OPERATIONS) != splits
    prompts = [p.prompt for p in train + val]
    assert len(set(prompts)) == 700  # distinct, so train and val share no prompt
    for problem in train + val:
        assert problem.answer == _recomputed(problem) >= 0, problem
        assert problem.response == str(problem.answer)
    kinds = {"bags with" in p.prompt for p in train}
    assert kinds == {True, False}  # multiplications and the others both drawn


def test_split_errors():
    with pytest.raises(ValueError, match="`num_train` and `num_val` must be >= 0"):
        make_splits(-1, 2)
    with pytest.raises(ValueError, match="`operations` must be a non-empty subset"):
        make_splits(2, 2, operations=("divide",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_operand` must be >= 1"):
        make_splits(2, 2, max_operand=0)
    with pytest.raises(ValueError, match="Only .* distinct problems"):
        make_splits(300, 0, operations=("multiply",), max_operand=2)  # 256 exist


def test_jsonl_rows(tmp_path, splits):
    train, _ = splits
    rl = [json.loads(line) for line in write_rl_rows(train[:3], tmp_path / "rl.jsonl").open()]
    sft = [json.loads(line) for line in write_sft_rows(train[:3], tmp_path / "sft.jsonl").open()]
    assert rl == [{"prompt": p.prompt, "answer": str(p.answer)} for p in train[:3]]
    assert sft == [{"prompt": p.prompt, "response": str(p.answer)} for p in train[:3]]


def test_tokenizer_round_trip_and_llama(tmp_path, splits):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, val = splits
    corpus = [p.prompt + " " + p.response for p in train]
    train_tokenizer(corpus, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    words = {w for text in corpus for w in text.split()}
    assert len(tok) == len(SPECIAL_TOKENS) + len(words)
    assert [tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id] == [0, 1, 2, 3]
    for problem in val[:20]:
        ids = tok(problem.prompt)["input_ids"]
        assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(problem.prompt.split())
        assert tok.decode(ids, skip_special_tokens=True) == problem.prompt
    assert tok("tom has 3 zebras")["input_ids"][-1] == tok.unk_token_id

    write_tiny_llama(tmp_path / "llama", tok, vocab_multiple=8)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"))
    config = model.config
    assert config.vocab_size % 8 == 0 and len(tok) <= config.vocab_size < len(tok) + 8
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (2, 3, 0)
    assert (tmp_path / "llama" / "model.safetensors").is_file()
    assert AutoTokenizer.from_pretrained(str(tmp_path / "llama")).get_vocab() == tok.get_vocab()
    with torch.no_grad():
        assert model(torch.tensor([[2, 5, 6]])).logits.shape == (1, 3, config.vocab_size)
    with pytest.raises(ValueError, match="must be divisible by `num_attention_heads`"):
        write_tiny_llama(tmp_path / "bad", tok, hidden_size=64, num_attention_heads=3)


def test_numeric_verifier_on_the_responses(splits):
    train, _ = splits
    problems = train[:8]
    meta = [{"answer": str(p.answer)} for p in problems]  # as the RL rows store it
    prompts = [p.prompt for p in problems]
    right = NumericAnswerReward()(prompts, [p.response for p in problems], meta)
    wrong = NumericAnswerReward()(prompts, [str(p.answer + 1) for p in problems], meta)
    assert right.tolist() == [1.0] * 8
    assert wrong.tolist() == [0.0] * 8


def test_greedy_completions_equal_a_plain_argmax_loop(tmp_path, splits):
    """Batched left-padded ``generate`` gives each prompt's unpadded greedy continuation (a
    random model: arbitrary tokens, so the strings are a real check); ``evaluate_hf`` is the
    mean verifier score of those strings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, val = splits
    train_tokenizer((p.prompt + " " + p.response for p in train + val), tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    write_tiny_llama(tmp_path / "llama", tok, seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama")).eval()
    problems = val[:6]
    expected = []
    for problem in problems:  # plain loop: one unpadded prompt, argmax, stop at EOS
        ids = tok(problem.prompt, return_tensors="pt")["input_ids"]
        new: list[int] = []
        with torch.no_grad():
            for _ in range(5):
                token = int(model(ids).logits[0, -1].argmax())
                if token == tok.eos_token_id:
                    break
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        expected.append(tok.decode(new, skip_special_tokens=True))
    prompts = [p.prompt for p in problems]
    got = greedy_completions(tmp_path / "llama", prompts, max_new_tokens=5, batch_size=4)
    assert got == expected
    assert any(got)  # not all empty
    meta = [{"answer": p.answer} for p in problems]
    score = float(NumericAnswerReward()(prompts, expected, meta).mean())
    assert evaluate_hf(tmp_path / "llama", problems, max_new_tokens=5) == score
    with pytest.raises(ValueError, match="`problems` is empty"):
        evaluate_hf(tmp_path / "llama", [])


def test_the_grpo_stage_config_matches_the_pipeline(tmp_path, monkeypatch):
    """``examples/arithmetic/grpo.yaml`` (the GRPO stage for ``lmrl fit``) instantiates with the
    settings ``run.py`` trains with."""
    from pathlib import Path

    from lightning_mcore_rl import MCoreRLStrategy
    from lightning_mcore_rl.callbacks import HFExport
    from lightning_mcore_rl.cli import build_cli
    from lightning_mcore_rl.recipes import GRPOModule, PromptFileDataModule, TextRewardTask

    config = Path(__file__).parents[3] / "examples" / "arithmetic" / "grpo.yaml"
    train, _ = make_splits(8, 2, seed=0)
    tokenizer = train_tokenizer(p.prompt + " " + p.response for p in train)
    write_tiny_llama(tmp_path / "sft", tokenizer, seed=0)
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        ["--config", str(config), f"--model.init_args.model.path={tmp_path / 'sft'}",
         f"--data.init_args.tokenizer={tmp_path / 'sft'}"],
        run=False,
    )  # fmt: skip
    module, data = cli.model, cli.datamodule
    assert isinstance(module, GRPOModule) and isinstance(module.task, TextRewardTask)
    assert isinstance(module.task.reward, NumericAnswerReward)
    assert module.rollout.backend == "hf" and module.rollout.stop_at_eos
    assert (module.rollout.group_size, module.rollout.max_new_tokens, module.lr) == (8, 4, 1e-3)
    assert isinstance(data, PromptFileDataModule) and data.prompts_per_step == 16
    assert data.max_prompt_length == module.task.max_prompt_length == 24
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MCoreRLStrategy)
    assert strategy.microbatching.micro_batch_size == 16 * 8 // 2  # one microbatch per DP rank
    assert any(isinstance(c, HFExport) for c in cli.trainer.callbacks)
