"""Write a tiny random-init Hugging Face model + tokenizer for ``examples/configs/grpo_hf.yaml``
(a Llama), ``examples/configs/grpo_vllm_tiny.yaml`` (a Llama vLLM can load, ``--vllm``) or
``examples/configs/grpo_moe_tiny.yaml`` (a Qwen3-MoE, ``--arch qwen3_moe``).

    .venv/bin/python scripts/make_tiny_hf.py                    # -> outputs/tiny_llama
    .venv/bin/lmrl fit --config examples/configs/grpo_hf.yaml
    .venv-vllm/bin/python scripts/make_tiny_hf.py --vllm        # -> outputs/tiny_llama_vllm
    .venv-vllm/bin/lmrl fit --config examples/configs/grpo_vllm_tiny.yaml
    .venv/bin/python scripts/make_tiny_hf.py --arch qwen3_moe   # -> outputs/tiny_qwen3_moe
    .venv/bin/lmrl fit --config examples/configs/grpo_moe_tiny.yaml

The tokenizer is a word-level one over the counting task's 16 token words (``"0"`` ... ``"15"``)
after 4 special tokens, so the model's vocabulary (24: 20 rounded up to a multiple of 8, even for
TP=2) covers the task's ids 0-15; 2 layers, hidden size 64, 4 heads (2 KV heads), 64 positions,
fp32 safetensors (about 0.3 MB); the pad token's embedding is random like the others (the task
feeds id 0 as content). ``--vllm``: 2 heads of 32 and 2 KV heads instead (vLLM's CPU attention
needs a head dim of 32 or more), otherwise the same. The Qwen3-MoE has 4 experts per layer, top-2,
expert width 64. Needs the ``hf`` extra (``transformers``, ``tokenizers``).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from lightning_mcore_rl.recipes.arithmetic import (
    VLLM_HEADS,
    train_tokenizer,
    write_tiny_llama,
    write_tiny_qwen3_moe,
)

TASK_VOCAB = 16
"""Token ids of the YAMLs' counting task (``task.vocab_size``)."""

ARCHS = {
    "llama": ("Llama", write_tiny_llama, "outputs/tiny_llama"),
    "qwen3_moe": ("Qwen3-MoE", write_tiny_qwen3_moe, "outputs/tiny_qwen3_moe"),
}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS), help="model type")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="2 heads of 32 (vLLM's CPU attention needs head dim >= 32); Llama only, "
        "default --out outputs/tiny_llama_vllm",
    )
    parser.add_argument("--out", default=None, help="directory to write (default: per arch)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args(argv)
    if args.vllm and args.arch != "llama":
        parser.error(f"--vllm makes a Llama only, got --arch {args.arch}")
    name, write, default_out = ARCHS[args.arch]
    if args.vllm:
        write = functools.partial(
            write_tiny_llama, num_attention_heads=VLLM_HEADS, num_key_value_heads=VLLM_HEADS
        )
        default_out += "_vllm"
    tokenizer = train_tokenizer([" ".join(str(i) for i in range(TASK_VOCAB))])
    # the task feeds every id 0-15 as content, the pad id 0 included: give it a real embedding
    out = write(args.out or default_out, tokenizer, seed=args.seed, random_pad_embedding=True)
    print(f"tiny {name} + tokenizer: {out}")
    return out


if __name__ == "__main__":
    main()
