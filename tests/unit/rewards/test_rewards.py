"""The built-in reward functions on hand-written completions: correct, wrong, malformed and
empty completions per built-in, the combination, and the batch checks (no ranks)."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.rewards import (
    ExactMatchReward,
    FormatReward,
    NumericAnswerReward,
    WeightedReward,
    extract_numeric_answer,
    parse_number,
)


def _score(reward, completions: list[str], answers: list[object]) -> list[float]:
    """Run ``reward`` on a batch with empty prompts; check the [B] float32 contract."""
    out = reward([""] * len(completions), completions, [{"answer": a} for a in answers])
    assert out.dtype == torch.float32 and out.shape == (len(completions),)
    return out.tolist()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", 42.0),
        (" -3.5 ", -3.5),
        ("$1,234$", 1234.0),
        ("1e-3", 1e-3),
        ("3/4", 0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{-1}{8}", -0.125),
        ("1/0", None),
        ("x+1", None),
        ("", None),
    ],
)
def test_parse_number(text: str, expected: float | None):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("2 apples and 3 pears make 5.", 5.0),  # the last number wins
        ("so x = -3", -3.0),  # a sign after a space
        ("pages 3-5", 5.0),  # a hyphen between numbers is no minus sign
        ("in total 1,234 items", 1234.0),
        ("0.5 or \\boxed{\\frac{1}{4}} then 7", 0.25),  # a box beats the last number
        ("first \\boxed{1} then \\boxed{2}", 2.0),  # the last box
        ("\\boxed{{12}}", None),  # nested braces: '{12}' is not a number
        ("\\boxed{x+1} and 3", None),  # an unreadable box does not fall back to 3
        ("\\boxed{3", None),  # unclosed
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_numeric_answer(completion: str, expected: float | None):
    assert extract_numeric_answer(completion) == expected


def test_numeric_answer_reward():
    completions = [
        "The answer is 12.",  # correct
        "The answer is \\boxed{12}.",  # correct, boxed
        "I think 11",  # wrong
        "twelve",  # malformed: no number
        "",  # empty
        "0.1 + 0.2 = 0.30000000000000004",  # within abs_tol 1e-6 of 0.3
        "\\boxed{3/4}",  # fraction against the string reference "0.75"
    ]
    answers = [12, "12", 12, 12, 12, 0.3, "0.75"]
    assert _score(NumericAnswerReward(), completions, answers) == [1, 1, 0, 0, 0, 1, 1]
    # tolerance: 12.4 vs 12 is a miss at the default abs_tol, a hit at abs_tol=0.5 or rel_tol=5%
    assert _score(NumericAnswerReward(), ["12.4"], [12]) == [0]
    assert _score(NumericAnswerReward(abs_tol=0.5), ["12.4"], [12]) == [1]
    assert _score(NumericAnswerReward(abs_tol=0.0, rel_tol=0.05), ["12.4"], [12]) == [1]


def test_numeric_answer_reward_custom_key_and_bad_reference():
    reward = NumericAnswerReward(answer_key="target")
    assert reward(["q"], ["= 7"], [{"target": "7"}]).tolist() == [1.0]
    with pytest.raises(ValueError, match=r"`metadata\[1\]` has no key 'target'.*\['answer'\]"):
        reward(["q", "q"], ["7", "7"], [{"target": 7}, {"answer": 7}])
    with pytest.raises(
        ValueError, match=r"`metadata\[0\]\['answer'\]` must be a finite number.*'seven'"
    ):
        NumericAnswerReward()(["q"], ["7"], [{"answer": "seven"}])
    with pytest.raises(ValueError, match=r"must be a finite number.*bool True"):
        NumericAnswerReward()(["q"], ["1"], [{"answer": True}])
    with pytest.raises(ValueError, match="`abs_tol` and `rel_tol` must be >= 0"):
        NumericAnswerReward(abs_tol=-1.0)


def test_exact_match_reward():
    completions = ["Paris", "  Paris \n", "paris", "London", "", "The capital is Paris"]
    answers = ["Paris"] * 6
    assert _score(ExactMatchReward(), completions, answers) == [1, 1, 0, 0, 0, 0]
    assert _score(ExactMatchReward(ignore_case=True), completions, answers) == [1, 1, 1, 0, 0, 0]
    # boxed: the last box's content is compared; no box (malformed) and empty score 0
    boxed = ["so \\boxed{New  York}", "\\boxed{Boston}", "New York", ""]
    assert _score(ExactMatchReward(boxed=True), boxed, ["New York"] * 4) == [1, 0, 0, 0]
    assert _score(ExactMatchReward(), ["7"], [7]) == [1]  # an int compares as its text
    with pytest.raises(
        ValueError, match=r"`metadata\[0\]\['answer'\]` must be a str or an int.*float 7.0"
    ):
        ExactMatchReward()(["q"], ["7"], [{"answer": 7.0}])
    with pytest.raises(ValueError, match=r"`metadata\[0\]` has no key 'answer'"):
        ExactMatchReward()(["q"], ["7"], [{}])


def test_format_reward():
    think = FormatReward.with_tags("think", "answer")
    completions = [
        "<think>2+2\nis 4</think>\n<answer>4</answer>",  # correct (newlines inside and between)
        "  <think>x</think><answer>4</answer>  ",  # correct (outer whitespace stripped)
        "<answer>4</answer><think>x</think>",  # wrong order
        "<think>x</think> <answer>4</answer> extra",  # trailing text
        "<think>unclosed <answer>4</answer>",  # malformed
        "",  # empty
    ]
    assert _score(think, completions, [None] * 6) == [1, 1, 0, 0, 0, 0]
    anywhere = FormatReward(r"<answer>\d+</answer>", full_match=False)
    assert _score(anywhere, completions, [None] * 6) == [1, 1, 1, 1, 1, 0]
    with pytest.raises(ValueError, match=r"`pattern` '\(' is not a regular expression"):
        FormatReward("(")
    with pytest.raises(ValueError, match="at least one tag"):
        FormatReward.with_tags()


def test_weighted_reward():
    correct, fmt = NumericAnswerReward(), FormatReward.with_tags("answer")
    combined = WeightedReward([correct, fmt], weights=[1.0, 0.25])
    completions = ["<answer>4</answer>", "<answer>5</answer>", "4", "", "no"]
    metadata = [{"answer": 4}] * 5
    # by hand: correct = [1, 0, 1, 0, 0], format = [1, 1, 0, 0, 0]
    scores = combined.scores([""] * 5, completions, metadata)
    assert scores.tolist() == [[1, 0, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert combined([""] * 5, completions, metadata).tolist() == [1.25, 0.25, 1.0, 0.0, 0.0]
    assert WeightedReward([correct, correct])([""], ["4"], [{"answer": 4}]).tolist() == [2.0]
    with pytest.raises(ValueError, match="one weight per reward: 2 rewards, 1 weights"):
        WeightedReward([correct, fmt], weights=[1.0])
    with pytest.raises(ValueError, match="at least one reward"):
        WeightedReward([])
    with pytest.raises(ValueError, match="must be finite"):
        WeightedReward([correct], weights=[float("nan")])

    def scalar(prompts, completions, metadata):
        return torch.tensor(1.0)

    with pytest.raises(
        ValueError,
        match=r"`rewards\[1\]` \(function\) must return a \[B\] tensor with B=1, got \(\)",
    ):
        WeightedReward([correct, scalar])([""], ["4"], [{"answer": 4}])


@pytest.mark.parametrize(
    "reward",
    [
        ExactMatchReward(),
        NumericAnswerReward(),
        FormatReward("x"),
        WeightedReward([FormatReward("x")]),
    ],
    ids=["exact", "numeric", "format", "weighted"],
)
def test_batch_checks(reward):
    assert reward([], [], []).shape == (0,)  # an empty batch: [0] rewards
    with pytest.raises(
        ValueError, match=r"len\(prompts\)=2, len\(completions\)=1, len\(metadata\)=2"
    ):
        reward(["a", "b"], ["x"], [{"answer": "x"}, {"answer": "x"}])
    with pytest.raises(TypeError, match=r"`completions\[1\]` must be a str, got int"):
        reward(["a", "b"], ["x", 3], [{"answer": "x"}, {"answer": "x"}])
    with pytest.raises(TypeError, match=r"`metadata\[0\]` must be a mapping.*got str"):
        reward(["a"], ["x"], ["answer"])
