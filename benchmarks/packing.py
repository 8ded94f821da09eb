"""Sequence packing vs padding on a long-tailed RL length distribution (tiny GPT, CPU).

Run: ``.venv/bin/python benchmarks/packing.py`` (one process, one intra-op thread).

Lengths are log-normal, clipped to ``[min_len, max_len]``. Both paths run forward + backward of
a next-token cross-entropy over the same real tokens with the same weights:

* padded: fixed microbatches of ``--mbs`` sequences in input order, each padded to its own
  longest sequence, once with megatron's local ``DotProductAttention`` and once with
  ``PackedDotProductAttention`` in padded mode (torch SDPA, the same kernel the packed path uses,
  so that row isolates the effect of packing from the attention kernel);
* packed: token-budget microbatches (``--budget`` tokens, first-fit decreasing), each packed into
  one THD row (``pack_sequences``, spans rounded to ``--pad-individual``) and run through
  ``PackedDotProductAttention`` with per-document position ids. Planning and packing are timed.

Efficiency = real tokens / processed tokens; throughput = real tokens / second.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from lightning_mcore_rl.testing import run_on_ranks


def sample_lengths(
    num: int, min_len: int, max_len: int, median: float, sigma: float, seed: int
) -> list[int]:
    """Log-normal lengths ``exp(N(log(median), sigma))`` clipped to ``[min_len, max_len]``."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(num, generator=generator, dtype=torch.float64) * sigma)
    return raw.mul(median).round().clamp(min_len, max_len).long().tolist()


def _next_token_loss(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Sum of next-token cross-entropy: ``logits [b, s, V]``, ``targets/mask [b, s]``."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, targets[:, 1:, None])[..., 0]
    return (nll * mask[:, 1:]).sum()


def _run_padded(
    model: torch.nn.Module, ids: torch.Tensor, lengths: list[int], mbs: int
) -> tuple[float, int, float]:
    processed, total_loss = 0, 0.0
    start = time.perf_counter()
    for first in range(0, len(lengths), mbs):
        chunk = lengths[first : first + mbs]
        width = max(chunk)
        mb_ids = ids[first : first + mbs, :width]
        positions = torch.arange(width)[None, :].expand(len(chunk), -1)
        mask = (positions < torch.tensor(chunk)[:, None]).float()
        loss = _next_token_loss(model(mb_ids, positions, None), mb_ids, mask)
        loss.backward()
        total_loss += loss.item()
        processed += len(chunk) * width
    return time.perf_counter() - start, processed, total_loss


def _run_packed(
    model: torch.nn.Module, ids: torch.Tensor, lengths: list[int], budget: int, pad: int
) -> tuple[float, int, float, int]:
    from lightning_mcore_rl.data import (
        pack_sequences,
        packed_position_ids,
        plan_token_budget_microbatches,
    )

    processed, total_loss = 0, 0.0
    start = time.perf_counter()
    plan = plan_token_budget_microbatches(lengths, budget, packed=True, pad_individual=pad)
    for index in plan.indices:
        mb_lengths = torch.tensor([lengths[i] for i in index])
        packed = pack_sequences(ids[list(index)], mb_lengths, pad_individual=pad)
        # target mask in packed order: a real token that is not its span's first token (the
        # token before a span start belongs to the previous sequence and must not predict it)
        positions = packed_position_ids(packed.cu_seqlens_padded)
        spans = (packed.cu_seqlens_padded[1:] - packed.cu_seqlens_padded[:-1]).long()
        real_len = torch.repeat_interleave(mb_lengths, spans)[None, :]
        mask = ((positions < real_len) & (positions > 0)).float()
        logits = model(
            packed.packed_local, positions, None, packed_seq_params=packed.packed_seq_params
        )
        loss = _next_token_loss(logits, packed.packed_full, mask)
        loss.backward()
        total_loss += loss.item()
        processed += packed.packed_full.shape[1]
    return time.perf_counter() - start, processed, total_loss, plan.num_microbatches


def _benchmark(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from lightning_mcore_rl.models.layers import get_packed_local_layer_spec
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config

    init_megatron_state()
    lengths = sample_lengths(
        args["num_seqs"], args["min_len"], args["max_len"], args["median"], args["sigma"], 0
    )
    width = max(lengths)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args["vocab"], (len(lengths), width), generator=generator)
    ids[torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]] = 0
    config = tiny_gpt_config(num_layers=args["layers"], hidden_size=args["hidden"])
    common = {"vocab_size": args["vocab"], "max_sequence_length": args["max_len"]}
    padded_model = tiny_gpt(config, transformer_layer_spec=get_gpt_layer_local_spec(), **common)
    packed_model = tiny_gpt(config, transformer_layer_spec=get_packed_local_layer_spec(), **common)
    warm = [args["min_len"]] * 2
    _run_padded(padded_model, ids[:2], warm, 2)
    _run_packed(packed_model, ids[:2], warm, args["budget"], args["pad_individual"])

    real = sum(lengths)
    rows: dict[str, dict[str, float]] = {}
    for name, model in (
        ("padded (megatron attention)", padded_model),
        ("padded (SDPA)", packed_model),
    ):
        seconds, processed, loss = _run_padded(model, ids, lengths, args["mbs"])
        rows[name] = _row(seconds, processed, loss, -(-len(lengths) // args["mbs"]), real)
    seconds, processed, loss, num_mbs = _run_packed(
        packed_model, ids, lengths, args["budget"], args["pad_individual"]
    )
    rows["packed"] = _row(seconds, processed, loss, num_mbs, real)
    return {
        "num_seqs": len(lengths),
        "real_tokens": real,
        "mean_len": real / len(lengths),
        "max_len": width,
        "padded_to_batch_max_efficiency": real / (len(lengths) * width),
        "rows": rows,
    }


def _row(
    seconds: float, processed: int, loss: float, microbatches: int, real: int
) -> dict[str, float]:
    return {
        "seconds": seconds,
        "microbatches": microbatches,
        "processed_tokens": processed,
        "efficiency": real / processed,
        "real_tokens_per_s": real / seconds,
        "summed_loss": loss,
    }


def main() -> None:
    """Parse arguments, run the benchmark in one megatron rank, print a table (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--median", type=float, default=192.0, help="log-normal median length")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma")
    parser.add_argument("--mbs", type=int, default=8, help="padded microbatch size")
    parser.add_argument("--budget", type=int, default=4096, help="packed tokens per microbatch")
    parser.add_argument("--pad-individual", type=int, default=8, help="packed span multiple")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON")
    args = vars(parser.parse_args())
    (result,) = run_on_ranks(_benchmark, 1, args, timeout=1800.0)
    if args["json"]:
        print(json.dumps(result, indent=2))
    print(
        f"{result['num_seqs']} sequences, log-normal(median {args['median']:.0f}, sigma "
        f"{args['sigma']}) clipped to [{args['min_len']}, {args['max_len']}]: mean "
        f"{result['mean_len']:.0f}, max {result['max_len']}, {result['real_tokens']} real tokens"
    )
    print("| path | microbatches | processed tokens | efficiency | fwd+bwd s | real tokens/s |")
    print("|---|---|---|---|---|---|")
    rows = result["rows"]
    for name, r in rows.items():
        print(
            f"| {name} | {r['microbatches']} | {r['processed_tokens']} | {r['efficiency']:.3f} | "
            f"{r['seconds']:.2f} | {r['real_tokens_per_s']:.0f} |"
        )
    packed = rows["packed"]
    for name, r in rows.items():
        if name != "packed":
            loss_diff = abs(packed["summed_loss"] - r["summed_loss"]) / abs(r["summed_loss"])
            print(
                f"packed vs {name}: {r['seconds'] / packed['seconds']:.2f}x throughput, summed "
                f"loss relative difference {loss_diff:.1e}"
            )
    print(
        "padding every sequence to the batch max instead would have efficiency "
        f"{result['padded_to_batch_max_efficiency']:.3f}"
    )


if __name__ == "__main__":
    main()
