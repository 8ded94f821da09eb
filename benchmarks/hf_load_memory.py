"""Peak resident memory per rank while ``HFBridge.build_chunk`` loads a Llama-shaped model at
TP=1 and TP=2 (each rank reads only its slices with ``safe_open(...).get_slice``).

Run: ``.venv/bin/python benchmarks/hf_load_memory.py`` (writes a random fp32 checkpoint to a
temporary directory first). Per rank: RSS after imports and megatron initialisation (baseline),
then the peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the build) while
building and loading the chunk; the increment is the load's cost. Ratios are TP=2 / TP=1 from the
same run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_rl.testing import run_on_ranks


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _load_rank(rank: int, directory: str, tp: int) -> dict[str, float]:
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state(tensor_model_parallel_size=tp)
    groups = megatron_groups()
    bridge = HFBridge.from_pretrained(directory)
    config = bridge.transformer_config(groups)
    baseline = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    chunk = bridge.build_chunk(config, groups=groups)
    peak = _status_mib("VmHWM")
    param_mib = sum(p.numel() * p.element_size() for p in chunk.parameters()) / 2**20
    return {"baseline": baseline, "peak": peak, "increment": peak - baseline, "params": param_mib}


def _write_model(directory: Path, args: argparse.Namespace) -> float:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        intermediate_size=4 * args.hidden,
        vocab_size=args.vocab,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return sum(p.numel() * 4 for p in model.parameters()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_mib = _write_model(Path(tmp), args)
        results: dict[int, list[dict[str, Any]]] = {}
        for tp in (1, 2):
            results[tp] = run_on_ranks(_load_rank, tp, tmp, tp, timeout=600)
    print(f"model: {vars(args)}, fp32 checkpoint {model_mib:.0f} MiB")
    print("| TP | rank | baseline RSS MiB | peak RSS MiB | peak - baseline MiB | params MiB |")
    print("|---|---|---|---|---|---|")
    for tp, ranks in results.items():
        for rank, r in enumerate(ranks):
            print(
                f"| {tp} | {rank} | {r['baseline']:.0f} | {r['peak']:.0f} | "
                f"{r['increment']:.0f} | {r['params']:.0f} |"
            )
    one = results[1][0]
    worst = max(results[2], key=lambda r: r["increment"])
    ratios = {
        "increment_tp2_over_tp1": worst["increment"] / one["increment"],
        "peak_tp2_over_tp1": worst["peak"] / one["peak"],
    }
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
