"""Prompt/response files for SFT (``ResponseFileDataset`` / ``ResponseFileDataModule``): a row
checked id by id against the word-level vocabulary, ``token_mask`` exactly on the response and
EOS tokens, the shapes and keys ``SFTModule`` reads, two simulated DP ranks with mid-epoch
resume, and the errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers.unit import word_level_tokenizer

from lightning_mcore_rl.recipes.response_data import ResponseFileDataModule, ResponseFileDataset
from lightning_mcore_rl.recipes.sft import SFT_KEYS

WORDS = ["<unk>", "<pad>", "<s>", "</s>", "what", "is", "1", "plus", "2", "?", "3", "it"]
PAD, BOS, EOS = 1, 2, 3


@pytest.fixture(scope="module")
def tokenizer():
    return word_level_tokenizer(WORDS, chat_template="", prepend_bos=True)


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _rows(n: int) -> list[dict[str, str]]:
    """Row ``i``: ``"what is 1 plus 2 ?"`` then ``"it is 3"`` (even i) or ``"3"`` (odd i)."""
    return [
        {"prompt": "what is 1 plus 2 ?", "response": "it is 3" if i % 2 == 0 else "3"}
        for i in range(n)
    ]


def test_rows_by_hand(tmp_path, tokenizer):
    data = ResponseFileDataset(
        _write(tmp_path / "t.jsonl", _rows(2)), tokenizer, cache_dir=str(tmp_path / "cache")
    )
    assert len(data) == 2
    # prompt: <s> what is 1 plus 2 ? = 7 ids; responses "it is 3" + </s> = 4, "3" + </s> = 2
    prompt = [BOS, 4, 5, 6, 7, 8, 9]
    long_row, short_row = data[0], data[1]
    assert sorted(long_row) == sorted(SFT_KEYS)
    assert long_row["input_ids"].tolist() == [*prompt, 11, 5, 10, EOS]  # S = 11, the widest
    assert short_row["input_ids"].tolist() == [*prompt, 10, EOS, PAD, PAD]
    assert long_row["token_mask"].tolist() == [0.0] * 7 + [1.0] * 4
    assert short_row["token_mask"].tolist() == [0.0] * 7 + [1.0] * 2 + [0.0] * 2
    assert (long_row["input_lengths"].item(), short_row["input_lengths"].item()) == (11, 9)
    assert long_row["sample_mask"].item() == 1.0
    assert long_row["input_ids"].dtype == torch.long and long_row["token_mask"].dtype == torch.float


def _module(tmp_path, path, tokenizer, rank: int) -> ResponseFileDataModule:
    data = ResponseFileDataModule(
        path, tokenizer, samples_per_step=4, seed=5, cache_dir=str(tmp_path / "cache")
    )
    data.trainer = SimpleNamespace(  # type: ignore[assignment]
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})
    )
    data.setup("fit")
    return data


def test_datamodule_two_dp_ranks_and_resume(tmp_path, tokenizer):
    path = _write(tmp_path / "t.jsonl", _rows(12))
    loaders = [_module(tmp_path, path, tokenizer, rank).train_dataloader() for rank in (0, 1)]
    # 12 rows, 6 per rank, 2 per step: 3 batches each of [2, 11], the ranks' rows disjoint
    batches = [list(loader) for loader in loaders]
    assert [len(b) for b in batches] == [3, 3]
    for batch in batches[0] + batches[1]:
        assert batch["input_ids"].shape == batch["token_mask"].shape == (2, 11)
        assert batch["input_lengths"].shape == batch["sample_mask"].shape == (2,)
        # the masked tokens are the last (input_lengths - 7) real ones: response + EOS
        assert batch["token_mask"].sum(1).tolist() == (batch["input_lengths"] - 7).tolist()
    state = {}
    for step, _ in enumerate(loaders[1]):
        if step == 1:
            state = loaders[1].state_dict()
            break
    resumed = _module(tmp_path, path, tokenizer, 1).train_dataloader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 1 and torch.equal(rest[0]["input_ids"], batches[1][2]["input_ids"])


def test_val_loader_and_errors(tmp_path, tokenizer):
    train = _write(tmp_path / "t.jsonl", _rows(8))
    data = ResponseFileDataModule(
        train, tokenizer, samples_per_step=4, val_files=_write(tmp_path / "v.jsonl", _rows(4)),
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    data.trainer = SimpleNamespace(  # type: ignore[assignment]
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0})
    )
    data.setup("validate")
    val = data.val_dataloader()
    assert not isinstance(val, list) and len(val.dataset) == 4  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`samples_per_step` must be >= 1, got 0"):
        ResponseFileDataModule(train, tokenizer, samples_per_step=0)
    few = ResponseFileDataModule(train, tokenizer, samples_per_step=16, cache_dir=data.cache_dir)
    few.trainer = data.trainer
    few.setup("fit")
    with pytest.raises(ValueError, match=r"8 training rows are fewer than `samples_per_step` \(16"):
        few.train_dataloader()
    kwargs = {"cache_dir": str(tmp_path / "cache")}
    other = _write(tmp_path / "o.jsonl", [{"prompt": "what", "answer": "3"}])
    with pytest.raises(
        ValueError, match="no field 'response'; their fields: \\['prompt', 'answer'"
    ):
        ResponseFileDataset(other, tokenizer, **kwargs)
    empty = _write(tmp_path / "e.jsonl", [{"prompt": "what", "response": ""}])
    with pytest.raises(ValueError, match=r"Rows \[0\] have responses with no tokens"):
        ResponseFileDataset(empty, tokenizer, **kwargs)
    numbers = _write(tmp_path / "n.jsonl", [{"prompt": "what", "response": 3}])
    with pytest.raises(ValueError, match="Row 0: `prompt` and `response` must be strings"):
        ResponseFileDataset(numbers, tokenizer, **kwargs)
    no_pad = word_level_tokenizer(WORDS, chat_template="")
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="needs an EOS and a pad token"):
        ResponseFileDataset(train, no_pad, **kwargs)
