"""Helpers of the single-process unit tests (also used by rank functions: pure objects)."""

from __future__ import annotations

from typing import Any


class FakeGroup:
    """A process group with ``rank()``/``size()`` only: any collective issued on it fails."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def word_level_tokenizer(words: list[str], chat_template: str, *, prepend_bos: bool = False) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``words`` (whitespace-split; ``<unk>``, ``<pad>``,
    ``<s>``, ``</s>`` among them), built offline with ``tokenizers``; ``prepend_bos``: ``<s>``
    before every encoded text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if prepend_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>",
    )  # fmt: skip
    fast.chat_template = chat_template
    return fast


TINY_HF_FIELDS: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 128,
}
"""The size fields of every tiny HF config the bridge tests build (2 layers, H=64, 4 heads with
2 KV heads, MLP width 96, V=128)."""
