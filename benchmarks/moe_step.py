"""One MoE update step (forward + backward + optimizer) of the tiny megatron GPT with MoE layers
on two CPU ranks, experts replicated (EP=1, DP=2) vs split (EP=2, DP=2), same global batch.

The step is megatron-core's own: ``SequentialMLP`` experts on the local spec, megatron DDP,
megatron Adam, the no-pipelining schedule (``lightning_mcore_rl.testing.training``), the alltoall
token dispatcher (or ``--dispatcher allgather``). Each layout runs in fresh ``run_on_ranks``
processes (gloo, one intra-op thread per rank).

Usage::

    .venv/bin/python benchmarks/moe_step.py
    .venv/bin/python benchmarks/moe_step.py --hidden 512 --experts 16 --steps 5

Prints a markdown table per layout: median step time over the timed steps (slowest rank),
tokens/s over the global batch, the expert and total parameter bytes each rank holds (exact),
the peak RSS of the larger rank (``ru_maxrss``, which includes the forkserver's imported
torch/megatron, ~the same for both layouts), and the ratios EP=2 / EP=1.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

from lightning_mcore_rl.testing import init_megatron_state, run_on_ranks


def rank_step(_rank: int, ep: int, args: argparse.Namespace) -> dict[str, Any]:
    """This rank's timings, parameter bytes and peak RSS for ``args.steps`` timed steps."""
    import torch.distributed as dist

    from lightning_mcore_rl.models.tiny_gpt import is_expert_parameter
    from lightning_mcore_rl.parallel import megatron_groups, unwrap_model
    from lightning_mcore_rl.testing.training import build_training, make_microbatches, train_step

    init_megatron_state(expert_model_parallel_size=ep)
    setup = build_training(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_token_dispatcher_type=args.dispatcher,
        moe_aux_loss_coeff=0.01,
        add_bias_linear=False,
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
    )
    groups = megatron_groups()
    rows = args.rows // groups.dp_size
    microbatches = [
        {k: v[groups.dp_rank * rows : (groups.dp_rank + 1) * rows] for k, v in mb.items()}
        for mb in make_microbatches(2, args.rows, args.seq, vocab_size=args.vocab)
    ]
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        train_step(setup, microbatches)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    named = list(unwrap_model(setup.chunks[0]).named_parameters())
    return {
        "step_s": statistics.median(times),
        "expert_bytes": sum(p.numel() * 4 for n, p in named if is_expert_parameter(n)),
        "param_bytes": sum(p.numel() * 4 for _, p in named),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8, help="rows per microbatch (global)")
    parser.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    tokens = 2 * args.rows * args.seq  # two microbatches per step
    results = {}
    for ep in (1, 2):
        ranks = run_on_ranks(rank_step, 2, ep, args, timeout=1200.0)
        results[ep] = {
            "step_s": max(r["step_s"] for r in ranks),
            "expert_mib": max(r["expert_bytes"] for r in ranks) / 2**20,
            "param_mib": max(r["param_bytes"] for r in ranks) / 2**20,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        }
    print(
        f"{args.layers} layers, H={args.hidden}, {args.experts} experts top-{args.topk}, "
        f"{args.dispatcher} dispatcher, {tokens} tokens per step (2 microbatches)\n"
    )
    print("| layout | step | tokens/s | expert params / rank | params / rank | peak RSS / rank |")
    print("|---|---|---|---|---|---|")
    for ep, r in results.items():
        print(
            f"| EP={ep}, DP=2 | {r['step_s'] * 1e3:.1f} ms | {tokens / r['step_s']:,.0f} | "
            f"{r['expert_mib']:.2f} MiB | {r['param_mib']:.2f} MiB | {r['peak_rss_mib']:.0f} MiB |"
        )
    one, two = results[1], results[2]
    print(
        f"\nEP=2 / EP=1: step time {two['step_s'] / one['step_s']:.2f}x, expert params "
        f"{two['expert_mib'] / one['expert_mib']:.2f}x, params {two['param_mib'] / one['param_mib']:.2f}x, "
        f"peak RSS {two['peak_rss_mib'] / one['peak_rss_mib']:.2f}x"
    )


if __name__ == "__main__":
    main()
