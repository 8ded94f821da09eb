"""Prompt files (JSONL and Parquet) through ``PromptFileDataset`` / ``PromptFileDataModule``:
tokenization against hand-derived ids, the chat template, length filtering and its log line,
padding, the loader of two simulated DP ranks and its mid-epoch resume, the errors (no ranks).

The DP=2 resume through ``Trainer(strategy=MCoreRLStrategy())`` is
``tests/distributed/data/test_prompt_resume.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from distributed.data._prompt_resume_ranks import (
    addition_rows,
    ids,
    tiny_tokenizer,
    write_rows,
)

from lightning_mcore_rl.recipes.prompt_data import (
    PromptFileDataModule,
    PromptFileDataset,
    collate_prompts,
)

BOS, PAD = 2, 1


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _dataset(tmp_path, files, tokenizer, **kwargs) -> PromptFileDataset:
    return PromptFileDataset(files, tokenizer, cache_dir=str(tmp_path / "cache"), **kwargs)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_reads_tokenizes_and_filters(tmp_path, tokenizer, suffix: str):
    rows = addition_rows(12, long_every=4)  # rows 3, 7, 11 are LONG_PROMPT (14 tokens)
    path = write_rows(rows, tmp_path / f"train{suffix}")
    data = _dataset(tmp_path, path, tokenizer, max_prompt_length=6)  # "<s> what is a plus b" = 6
    assert (data.num_rows, data.num_filtered, len(data)) == (12, 3, 9)
    kept = [i for i in range(12) if i % 4 != 3]
    for position, row in enumerate(kept):
        item = data[position]
        assert item["index"] == row
        assert item["prompt"] == rows[row]["prompt"]
        assert item["input_ids"].tolist() == [BOS, *ids(rows[row]["prompt"])]  # BOS + words
        assert item["metadata"] == {"answer": rows[row]["answer"], "id": row}
    # no limit: nothing filtered; metadata_keys keeps only the named fields
    data = _dataset(tmp_path, path, tokenizer, metadata_keys=["answer"])
    assert (data.num_filtered, len(data)) == (0, 12)
    assert data[3]["metadata"] == {"answer": 6} and len(data[3]["input_ids"]) == 14


def test_several_files_keep_their_order(tmp_path, tokenizer):
    rows = addition_rows(6)
    first = write_rows(rows[:4], tmp_path / "a.jsonl")
    second = write_rows(rows[4:], tmp_path / "b.jsonl")
    data = _dataset(tmp_path, [first, second], tokenizer)
    assert [data[i]["metadata"]["id"] for i in range(6)] == list(range(6))


def test_chat_template(tmp_path, tokenizer):
    rows = [
        {"prompt": "what is 1 plus 3", "answer": 4},
        {"prompt": [{"role": "user", "content": "what is 2 plus 2"}], "answer": 4},
    ]
    path = write_rows(rows, tmp_path / "chat.jsonl")
    data = _dataset(tmp_path, path, tokenizer, chat_template=True)
    # the template writes the BOS itself: no second one from the tokenizer
    assert data[0]["prompt"] == "<s> <user> what is 1 plus 3 <assistant>"
    assert data[0]["input_ids"].tolist() == ids("<s> <user> what is 1 plus 3 <assistant>")
    assert data[1]["input_ids"].tolist() == ids("<s> <user> what is 2 plus 2 <assistant>")
    data = _dataset(tmp_path, path, tokenizer, chat_template=True, system_prompt="be brief")
    assert data[0]["prompt"] == "<s> <system> be brief <user> what is 1 plus 3 <assistant>"
    # a message list is used as it is (the system prompt is for string prompts)
    assert data[1]["prompt"] == "<s> <user> what is 2 plus 2 <assistant>"
    with pytest.raises(ValueError, match="Row 1: the prompt is a list; without `chat_template"):
        _dataset(tmp_path, path, tokenizer)


def test_collate_pads_left_or_right():
    items = [
        {"input_ids": torch.tensor([5, 6, 7]), "prompt": "a", "metadata": {"x": 1}, "index": 4},
        {"input_ids": torch.tensor([8]), "prompt": "b", "metadata": {"x": 2}, "index": 9},
    ]
    left = collate_prompts(items, pad_token_id=PAD)
    assert left.input_ids.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert left.input_lengths.tolist() == [3, 1] and left.indices.tolist() == [4, 9]
    assert left.prompts == ["a", "b"] and left.metadata == [{"x": 1}, {"x": 2}]
    right = collate_prompts(items, pad_token_id=0, padding_side="right")
    assert right.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]


def _module(tmp_path, path, tokenizer, rank: int = 0, **kwargs) -> PromptFileDataModule:
    data = PromptFileDataModule(
        path, tokenizer, prompts_per_step=4, cache_dir=str(tmp_path / "cache"), **kwargs
    )
    data.trainer = SimpleNamespace(  # type: ignore[assignment]
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})
    )
    return data


def test_datamodule_two_dp_ranks_and_resume(tmp_path, tokenizer, caplog):
    path = write_rows(addition_rows(22, long_every=11), tmp_path / "train.parquet")
    loaders = []
    for rank in (0, 1):
        data = _module(tmp_path, path, tokenizer, rank, max_prompt_length=8, seed=5)
        with caplog.at_level(logging.INFO):
            data.setup("fit")
        loaders.append(data.train_dataloader())
    assert "dropped 2 of 22 train prompts longer than max_prompt_length=8 tokens" in caplog.text
    # 20 kept, 10 per rank, 2 per step: 5 batches each, disjoint, covering every kept row
    epochs = [[batch.indices.tolist() for batch in loader] for loader in loaders]
    assert [len(e) for e in epochs] == [5, 5]
    assert all(batch.input_ids.shape[0] == 2 for batch in loaders[0])
    seen = [i for epoch in epochs for step in epoch for i in step]
    assert sorted(seen) == [i for i in range(22) if i % 11 != 10]
    # mid-epoch resume of rank 1: a fresh loader given the state after 2 batches yields batch 3 on
    state = {}
    for step, _ in enumerate(loaders[1]):
        if step == 1:
            state = loaders[1].state_dict()
            break
    assert state == {"batches_yielded": 2}
    fresh = _module(tmp_path, path, tokenizer, 1, max_prompt_length=8, seed=5)
    fresh.setup("fit")
    resumed = fresh.train_dataloader()
    resumed.load_state_dict(state)
    assert [batch.indices.tolist() for batch in resumed] == epochs[1][2:]


def test_datamodule_drops_the_partial_last_step(tmp_path, tokenizer):
    data = _module(tmp_path, write_rows(addition_rows(11), tmp_path / "t.jsonl"), tokenizer)
    data.setup("fit")
    # the sampler gives each rank ceil(11 / 2) = 6 rows: 3 full steps of 2, none partial
    assert [b.input_ids.shape[0] for b in data.train_dataloader()] == [2, 2, 2]


def test_datamodule_val_loader(tmp_path, tokenizer):
    train = write_rows(addition_rows(8), tmp_path / "t.jsonl")
    data = _module(
        tmp_path, train, tokenizer, val_files=write_rows(addition_rows(4), tmp_path / "v.jsonl")
    )
    assert data.val_dataloader() == []  # before setup: no dataset yet
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    assert batch.input_ids.shape == (2, 6) and batch.indices.tolist() == [0, 1]
    odd = _module(
        tmp_path, train, tokenizer, val_files=write_rows(addition_rows(3), tmp_path / "o.jsonl")
    )
    odd.setup("validate")
    with pytest.raises(
        ValueError, match=r"`val prompts` \(3\) must be divisible by the data-parallel size \(2\)"
    ):
        odd.val_dataloader()


def test_errors(tmp_path, tokenizer):
    path = write_rows(addition_rows(4), tmp_path / "t.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl' does not exist"):
        _dataset(tmp_path, str(tmp_path / "missing.jsonl"), tokenizer)
    csv = tmp_path / "t.csv"
    csv.write_text("prompt\nx\n")
    with pytest.raises(
        ValueError, match=r"suffix '\.csv'; expected one of \['\.json', '\.jsonl', '\.parquet'\]"
    ):
        _dataset(tmp_path, str(csv), tokenizer)
    parquet = write_rows(addition_rows(2), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"mixes formats \['json', 'parquet'\]"):
        _dataset(tmp_path, [path, parquet], tokenizer)
    with pytest.raises(ValueError, match="`files` is empty"):
        _dataset(tmp_path, [], tokenizer)
    with pytest.raises(
        ValueError, match=r"no field 'question'; their fields: \['prompt', 'answer', 'id'\]"
    ):
        _dataset(tmp_path, path, tokenizer, prompt_key="question")
    with pytest.raises(ValueError, match="no field 'solution'"):
        _dataset(tmp_path, path, tokenizer, metadata_keys=["solution"])
    with pytest.raises(
        ValueError,
        match=r"All 4 prompts are longer than max_prompt_length=5 tokens \(the shortest has 6\)",
    ):
        _dataset(tmp_path, path, tokenizer, max_prompt_length=5)
    with pytest.raises(ValueError, match="`max_prompt_length` must be >= 1"):
        _dataset(tmp_path, path, tokenizer, max_prompt_length=0)
    plain = tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        _dataset(tmp_path, path, plain, chat_template=True)
    bad = write_rows([{"prompt": [{"content": "hi"}]}], tmp_path / "bad.jsonl")
    with pytest.raises(
        ValueError, match=r"Row 0: the prompt must be a string or a list of \{'role', 'content'\}"
    ):
        _dataset(tmp_path, bad, tokenizer, chat_template=True)
    from tokenizers import processors

    no_bos = tiny_tokenizer()  # without its BOS an empty prompt has no tokens
    no_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    empty = write_rows([{"prompt": "what is 1"}, {"prompt": ""}], tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match=r"Rows \[1\] have prompts with no tokens"):
        _dataset(tmp_path, empty, no_bos)


def test_datamodule_errors(tmp_path, tokenizer):
    path = write_rows(addition_rows(6), tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="`padding_side` must be 'left' or 'right', got 'top'"):
        PromptFileDataModule(path, tokenizer, padding_side="top")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`prompts_per_step` must be >= 1"):
        PromptFileDataModule(path, tokenizer, prompts_per_step=0)
    data = _module(tmp_path, path, tokenizer)
    data.prompts_per_step = 3
    data.setup("fit")
    with pytest.raises(
        ValueError,
        match=r"`prompts_per_step` \(3\) must be divisible by the data-parallel size \(2\)",
    ):
        data.train_dataloader()
    data.prompts_per_step = 8
    with pytest.raises(
        ValueError,
        match=r"6 training prompts \(after filtering\) are fewer than `prompts_per_step` \(8\)",
    ):
        data.train_dataloader()
    no_pad = tiny_tokenizer()
    no_pad.pad_token = None
    data = _module(tmp_path, path, no_pad)
    data.setup("fit")
    with pytest.raises(ValueError, match="The tokenizer has no pad token: pass `pad_token_id`"):
        data.train_dataloader()
    data.pad_token_id = 3  # the EOS id
    assert next(iter(data.train_dataloader())).input_ids.shape == (2, 6)


def test_tokenizer_from_a_directory(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    path = write_rows(addition_rows(4), tmp_path / "t.jsonl")
    data = _module(tmp_path, path, str(tmp_path / "tok"))
    data.setup("fit")
    assert data.train_dataset is not None
    assert data.train_dataset[0]["input_ids"].tolist() == [BOS, *ids("what is 0 plus 0")]
