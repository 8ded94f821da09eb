"""Write a tiny random-init Hugging Face Llama + tokenizer for ``examples/configs/grpo_hf.yaml``.

    .venv/bin/python scripts/make_tiny_hf.py            # -> outputs/tiny_llama (the YAML's path)
    .venv/bin/lmrl fit --config examples/configs/grpo_hf.yaml

The tokenizer is a word-level one over the counting task's 16 token words (``"0"`` ... ``"15"``)
after 4 special tokens, so the model's vocabulary (24: 20 rounded up to a multiple of 8, even for
TP=2) covers the task's ids 0-15; 2 layers, hidden size 64, 4 heads (2 KV heads), 64 positions,
fp32 safetensors (about 0.3 MB). Needs the ``hf`` extra (``transformers``, ``tokenizers``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_mcore_rl.recipes.arithmetic import train_tokenizer, write_tiny_llama

TASK_VOCAB = 16
"""Token ids of the YAML's counting task (``task.vocab_size``)."""


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/tiny_llama", help="directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args(argv)
    tokenizer = train_tokenizer([" ".join(str(i) for i in range(TASK_VOCAB))])
    out = write_tiny_llama(args.out, tokenizer, seed=args.seed)
    print(f"tiny Llama + tokenizer: {out}")
    return out


if __name__ == "__main__":
    main()
