"""Rollout throughput: the embedded megatron sampler with and without its KV cache, the
Hugging Face rollout source, and ``transformers``' own ``generate``, on one model.

Run: ``.venv/bin/python benchmarks/sampler_throughput.py`` (one CPU rank; writes a random fp32
Llama to a temporary directory first). The same prompts (``B`` x ``P`` ids) get ``N`` sampled
tokens from: ``generate(kv_cache=False)`` (the whole prefix re-run per token), ``generate(
kv_cache=True)`` (megatron's ``StaticInferenceContext``), ``HFRolloutSource.generate`` (the HF model
with its KV cache, per-token logprobs) and ``AutoModelForCausalLM.generate(do_sample=True)``
(no logprobs). Sampled tokens per second, best of ``--repeats`` runs after one warm-up; ratios
against the no-cache sampler of the same run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_mcore_rl.testing import run_on_ranks

MODEL: dict[str, Any] = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}


def _best_rate(run: Callable[[], None], tokens: int, repeats: int) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return tokens / best


def _rank(rank: int, directory: str, batch: int, prompt: int, new: int, repeats: int) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.rollout import HFRolloutSource, SamplingConfig, generate
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    bridge = HFBridge.from_pretrained(directory)
    chunk = bridge.build_chunk(bridge.transformer_config()).eval()
    prompts = torch.randint(0, MODEL["vocab_size"], (batch, prompt))
    source = HFRolloutSource(directory, dist.group.WORLD)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = batch * new

    def megatron(kv_cache: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                generate(chunk, prompts, max_new_tokens=new, kv_cache=kv_cache,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip

        return run

    def hf_source() -> None:
        source.generate(prompts, SamplingConfig(max_new_tokens=new, seed=0))

    def hf_generate() -> None:
        with torch.no_grad():
            hf.generate(prompts, do_sample=True, max_new_tokens=new, min_new_tokens=new,
                        attention_mask=torch.ones_like(prompts), pad_token_id=0)  # fmt: skip

    return {
        "megatron sampler, no cache": _best_rate(megatron(False), tokens, repeats),
        "megatron sampler, KV cache": _best_rate(megatron(True), tokens, repeats),
        "HFRolloutSource (KV cache)": _best_rate(hf_source, tokens, repeats),
        "transformers generate()": _best_rate(hf_generate, tokens, repeats),
    }


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(directory)
        (rates,) = run_on_ranks(
            _rank, 1, directory, args.batch, args.prompt, args.new, args.repeats, timeout=1200
        )
    print(f"torch {torch.__version__}; Llama {MODEL}; B={args.batch} P={args.prompt} N={args.new}")
    print("| sampler | tokens/s | vs no cache |\n|---|---|---|")
    base = rates["megatron sampler, no cache"]
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
