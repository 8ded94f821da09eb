"""Arithmetic word problems made locally (no download) for ``examples/arithmetic``: problems, their
JSONL files, a word-level tokenizer, tiny random-init HF models and a greedy evaluation."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# A problem is one sentence of lower-case words and numbers separated by single spaces, e.g.
# "tom has 3 apples and gets 4 more . how many apples does tom have now ?" with answer 7; its SFT
# response is the bare answer ("7"), which NumericAnswerReward's last-number rule reads.
Operation = Literal["add", "subtract", "multiply"]

NAMES = ("tom", "anna", "li", "sara", "omar", "mia", "ken", "zoe")
OBJECTS = ("apples", "books", "coins", "pens", "cards", "shells", "eggs", "stones")
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")
"""Pad, unknown, BOS and EOS, ids 0-3 of every tokenizer :func:`train_tokenizer` makes."""

VLLM_HEADS = 2
"""Attention heads and KV heads of a tiny model vLLM can load (``write_tiny_llama(...,
num_attention_heads=VLLM_HEADS, num_key_value_heads=VLLM_HEADS)``): hidden size 64 over 2 heads
is a head dim of 32, the smallest vLLM's CPU attention supports (the defaults' 4 heads of 16 fail
there: "Unsupported CPU attention configuration"); TP = 2 still splits the 2 KV heads."""

_TEMPLATES: dict[Operation, tuple[str, ...]] = {
    "add": (
        "{n} has {a} {o} and gets {b} more . how many {o} does {n} have now ?",
        "{n} has {a} {o} . {m} gives {n} {b} {o} . how many {o} does {n} have ?",
    ),
    "subtract": (
        "{n} has {a} {o} and gives {b} to {m} . how many {o} does {n} have now ?",
        "{n} had {a} {o} and lost {b} . how many {o} are left ?",
    ),
    "multiply": ("{n} has {a} bags with {b} {o} in each bag . how many {o} does {n} have ?",),
}


@dataclass(frozen=True)
class ArithmeticProblem:
    """One word problem: its ``prompt`` (lower-case words, numbers) and its ``answer`` (>= 0)."""

    prompt: str
    answer: int

    @property
    def response(self) -> str:
        """The SFT demonstration: the bare answer (what ``NumericAnswerReward`` reads)."""
        return str(self.answer)


def _operands(op: Operation, rng: random.Random, max_operand: int) -> tuple[int, int, int]:
    """``(a, b, answer)`` with ``answer >= 0``; multiplications use factors up to 5."""
    if op == "multiply":
        a, b = rng.randint(1, min(5, max_operand)), rng.randint(1, min(5, max_operand))
        return a, b, a * b
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "subtract":  # the larger first, so the answer stays >= 0
        a, b = max(a, b), min(a, b)
        return a, b, a - b
    return a, b, a + b


def random_problem(
    rng: random.Random, operations: Sequence[Operation], max_operand: int
) -> ArithmeticProblem:
    """One problem drawn from ``rng``, operands in ``[0, max_operand]``."""
    op = rng.choice(list(operations))
    template = rng.choice(_TEMPLATES[op])
    name, other = rng.sample(NAMES, 2)
    a, b, answer = _operands(op, rng, max_operand)
    prompt = template.format(n=name, m=other, o=rng.choice(OBJECTS), a=a, b=b)
    return ArithmeticProblem(prompt, answer)


def make_splits(
    num_train: int,
    num_val: int,
    seed: int = 0,
    operations: Sequence[Operation] = ("add", "subtract"),
    max_operand: int = 9,
) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    """Disjoint train and validation problems (no prompt text in both), drawn with ``seed``.

    Raises:
        ValueError: a negative count, unknown operation, ``max_operand < 1``, too few problems."""
    if num_train < 0 or num_val < 0:
        raise ValueError(f"`num_train` and `num_val` must be >= 0, got {num_train}, {num_val}.")
    unknown = sorted(set(operations) - set(_TEMPLATES))
    if not operations or unknown:
        raise ValueError(f"`operations` must be a non-empty subset of {sorted(_TEMPLATES)}.")
    if max_operand < 1:
        raise ValueError(f"`max_operand` must be >= 1, got {max_operand}.")
    # draw until num_train + num_val distinct prompts exist (at most 100 draws per problem); the
    # first num_val distinct ones are the validation split
    rng = random.Random(seed)
    total = num_train + num_val
    seen: dict[str, ArithmeticProblem] = {}
    for _ in range(100 * total):
        if len(seen) == total:
            break
        problem = random_problem(rng, operations, max_operand)
        seen.setdefault(problem.prompt, problem)
    if len(seen) < total:
        raise ValueError(
            f"Only {len(seen)} distinct problems found for num_train + num_val = {total}; "
            "allow more operations or a larger `max_operand`."
        )
    problems = list(seen.values())
    return problems[num_val:], problems[:num_val]


def write_rl_rows(problems: Iterable[ArithmeticProblem], path: str | os.PathLike[str]) -> Path:
    """Write ``{"prompt", "answer"}`` JSONL rows (answer as a string) for GRPO; returns the path."""
    rows = ({"prompt": p.prompt, "answer": str(p.answer)} for p in problems)
    return _write_jsonl(rows, Path(path))


def write_sft_rows(problems: Iterable[ArithmeticProblem], path: str | os.PathLike[str]) -> Path:
    """Write ``{"prompt", "response"}`` JSONL rows for SFT; returns the path."""
    rows = ({"prompt": p.prompt, "response": p.response} for p in problems)
    return _write_jsonl(rows, Path(path))


def _write_jsonl(rows: Iterable[dict[str, str]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def train_tokenizer(
    texts: Iterable[str], out_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the whitespace-split words of ``texts``, `SPECIAL_TOKENS` as
    ids 0-3 and BOS before every text; saved to ``out_dir`` when given."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    pad, unk, bos, eos = SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(unk_token=unk))
    # Decoding joins words with single spaces, so decode(encode(t), skip_special_tokens=True) is t
    # for any text of the corpus's words in that form; other words map to <unk>.
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # min_frequency=1: every word of the corpus gets an id
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, unk_token=unk, bos_token=bos, eos_token=eos
    )
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def write_tiny_llama(
    out_dir: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerFast,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 64,
    vocab_multiple: int = 8,
    seed: int = 0,
    random_pad_embedding: bool = False,
) -> Path:
    """Save a random-init fp32 ``LlamaForCausalLM`` and ``tokenizer`` in ``out_dir``; ``vocab_size``
    is ``len(tokenizer)`` rounded up to ``vocab_multiple``.

    Raises:
        ValueError: heads or query groups not divisible as Llama requires."""
    from transformers import LlamaConfig

    _check_heads(hidden_size, num_attention_heads, num_key_value_heads)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        **_token_fields(tokenizer, vocab_multiple),
    )
    return _save_random_causal_lm(config, out_dir, tokenizer, seed, random_pad_embedding)


def write_tiny_qwen3_moe(
    out_dir: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerFast,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    max_position_embeddings: int = 64,
    vocab_multiple: int = 8,
    seed: int = 0,
    random_pad_embedding: bool = False,
) -> Path:
    """Save a random-init fp32 ``Qwen3MoeForCausalLM`` (every layer MoE) and ``tokenizer`` in
    ``out_dir``; the vocabulary as `write_tiny_llama`'s. ``random_pad_embedding``: draw the pad
    row like every other (transformers zeroes it).

    Raises:
        ValueError: heads or query groups not divisible."""
    from transformers import Qwen3MoeConfig

    _check_heads(hidden_size, num_attention_heads, num_key_value_heads)
    config = Qwen3MoeConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=True,  # top-k probabilities renormalised
        max_position_embeddings=max_position_embeddings,
        **_token_fields(tokenizer, vocab_multiple),
    )
    return _save_random_causal_lm(config, out_dir, tokenizer, seed, random_pad_embedding)


def _check_heads(hidden_size: int, num_attention_heads: int, num_key_value_heads: int) -> None:
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"`hidden_size` ({hidden_size}) must be divisible by `num_attention_heads` "
            f"({num_attention_heads}), and that by `num_key_value_heads` ({num_key_value_heads})."
        )


def _token_fields(tokenizer: PreTrainedTokenizerFast, vocab_multiple: int) -> dict[str, Any]:
    """``vocab_size`` (``len(tokenizer)`` rounded up to ``vocab_multiple``) and the special ids."""
    return {
        # megatron splits the vocabulary over TP without padding it: TP = 2 needs an even multiple
        "vocab_size": -(-len(tokenizer) // vocab_multiple) * vocab_multiple,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _save_random_causal_lm(
    config: Any,
    out_dir: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    random_pad_embedding: bool,
) -> Path:
    """Random-init the causal LM of ``config``; save it and ``tokenizer`` in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # For tasks that feed the pad id as content (the toy counting tasks' ids 0-15): transformers
    # zeroes the pad row (padding_idx), and a zero row through RMSNorm has a gradient of
    # 1/sqrt(eps), which no trained checkpoint has. Drawn N(0, initializer_range) from its own
    # generator, so no other weight changes.
    if random_pad_embedding and config.pad_token_id is not None:
        generator = torch.Generator().manual_seed(seed)
        embedding = model.get_input_embeddings().weight
        row = torch.randn(embedding.shape[1], generator=generator) * config.initializer_range
        with torch.no_grad():
            embedding[config.pad_token_id] = row
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)


def greedy_completions(
    hf_dir: str | os.PathLike[str],
    prompts: Sequence[str],
    max_new_tokens: int = 8,
    batch_size: int = 64,
) -> list[str]:
    """Greedy continuations of ``prompts`` by the model in ``hf_dir``, without special tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # left-padded batches of batch_size prompts through generate(do_sample=False)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        inputs = tokenizer(
            list(prompts[start : start + batch_size]), return_tensors="pt", padding=True
        )
        with torch.no_grad():
            out = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )  # [b, P + N]
        new = out[:, inputs["input_ids"].shape[1] :]
        completions += tokenizer.batch_decode(new, skip_special_tokens=True)
    return completions


def evaluate_hf(
    hf_dir: str | os.PathLike[str],
    problems: Sequence[ArithmeticProblem],
    max_new_tokens: int = 8,
    batch_size: int = 64,
) -> float:
    """Greedy accuracy of the model in ``hf_dir`` on ``problems``: the mean ``NumericAnswerReward``.

    Raises:
        ValueError: no problems."""
    from lightning_mcore_rl.rewards import NumericAnswerReward

    if not problems:
        raise ValueError("`problems` is empty.")
    prompts = [p.prompt for p in problems]
    completions = greedy_completions(hf_dir, prompts, max_new_tokens, batch_size)
    metadata = [{"answer": p.answer} for p in problems]
    return float(NumericAnswerReward()(prompts, completions, metadata).mean())
