"""Forward+backward time and peak extra memory of token-logprob kernels on CPU.

Compares, at ``tokens x vocab`` bf16 logits (``hidden`` for the fused path) and TP in {1, 2}:
naive torch (fp32 ``log_softmax`` + ``gather``, TP=1 only), megatron-core's
``vocab_parallel_cross_entropy``, and ours (plain, chunked, fused linear). Every configuration runs
in fresh gloo ranks (``run_on_ranks``), one at a time, so memory is freed between them.

Memory: a thread samples this rank's RSS (psutil) every 0.5 ms during forward+backward; "peak
extra" is the peak minus the RSS just before (inputs allocated, no gradients). glibc's mmap
threshold is pinned to 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so freed blocks go back to the OS and
RSS tracks live tensors. "working" subtracts the gradients every method must return (logits grad,
or hidden + weight grads for the fused path). Run: ``python benchmarks/logprob_kernels.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the ranks' glibc at start

import torch  # noqa: E402

from lightning_mcore_rl.testing import run_on_ranks  # noqa: E402

GiB = 2**30


class _PeakRSS:
    """Samples the process RSS in a background thread; ``peak`` after ``stop()``."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._running:
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.0005)

    def stop(self) -> int:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return self.peak - self.base


def _bench_rank(rank: int, method: str, cfg: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from lightning_mcore_rl.ops import distributed_logprob, fused_linear_logprobs
    from lightning_mcore_rl.testing import init_megatron_state

    tokens, hidden_size, vocab, tp = cfg["tokens"], cfg["hidden"], cfg["vocab"], cfg["tp"]
    init_megatron_state(tensor_model_parallel_size=tp)
    group = parallel_state.get_tensor_model_parallel_group()
    local_vocab = vocab // tp
    start, end = rank * local_vocab, (rank + 1) * local_vocab
    torch.manual_seed(0)
    target = torch.randint(0, vocab, (1, tokens))
    if method == "ours_fused":
        hidden = torch.empty(tokens, hidden_size, dtype=torch.bfloat16).normal_()
        weight = torch.empty(local_vocab, hidden_size, dtype=torch.bfloat16).normal_(std=0.05)
        leaves = [hidden.requires_grad_(), weight.requires_grad_()]
        block = cfg["fused_block_bytes"] // (4 * local_vocab)
    else:
        logits = torch.empty(1, tokens, local_vocab, dtype=torch.bfloat16).normal_(std=3.0)
        leaves = [logits.requires_grad_()]
    grad_bytes = sum(t.numel() * t.element_size() for t in leaves)

    def step() -> None:
        if method == "naive":
            logp = torch.log_softmax(logits.float(), dim=-1)
            lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        elif method == "megatron":
            lp = -vocab_parallel_cross_entropy(logits, target)
        elif method == "ours_plain":
            lp = distributed_logprob(logits, target, start, end, group)
        elif method == "ours_chunked":
            lp = distributed_logprob(logits, target, start, end, group, chunk_size=cfg["chunk"])
        else:
            lp = fused_linear_logprobs(hidden, weight, target[0], start, end, group, block).logprobs
        lp.sum().backward()

    times, extras = [], []
    for _ in range(cfg["repeats"]):
        for leaf in leaves:
            leaf.grad = None
        dist.barrier()
        meter = _PeakRSS()
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
        extras.append(meter.stop())
    return {"time": min(times), "extra": max(extras), "grad_bytes": grad_bytes}


def _run(method: str, cfg: dict) -> dict:
    per_rank = run_on_ranks(_bench_rank, cfg["tp"], method, cfg, timeout=1800.0)
    return {
        "time": max(r["time"] for r in per_rank),
        "extra": max(r["extra"] for r in per_rank),
        "grad_bytes": per_rank[0]["grad_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk (ours_chunked)")
    parser.add_argument("--fused-block-mib", type=int, default=32, help="fp32 logits block")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--naive-max-gib", type=float, default=4.0,
        help="skip naive when its estimated peak (8x the bf16 logits) exceeds this",
    )  # fmt: skip
    args = parser.parse_args()
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; tokens={args.tokens}, "
        f"hidden={args.hidden}, bf16 inputs, chunk={args.chunk}, fused block "
        f"{args.fused_block_mib} MiB"
    )
    header = (
        "| vocab | TP | method | fwd+bwd s | time vs mcore | peak extra GiB | mem vs mcore "
        "| working GiB | working vs mcore | working / bf16 logits |"
    )
    print(header)
    print("|---" * 10 + "|")
    for vocab in args.vocabs:
        for tp in args.tps:
            cfg = {
                "tokens": args.tokens, "hidden": args.hidden, "vocab": vocab, "tp": tp,
                "chunk": args.chunk, "repeats": args.repeats,
                "fused_block_bytes": args.fused_block_mib * 2**20,
            }  # fmt: skip
            logits_bytes = args.tokens * vocab // tp * 2
            methods = ["megatron", "naive", "ours_plain", "ours_chunked", "ours_fused"]
            results = {}
            for method in methods:
                if method == "naive" and (tp > 1 or 8 * logits_bytes > args.naive_max_gib * GiB):
                    continue
                results[method] = _run(method, cfg)
            ref = results["megatron"]
            ref_working = ref["extra"] - ref["grad_bytes"]
            for method, res in results.items():
                working = res["extra"] - res["grad_bytes"]
                print(
                    f"| {vocab // 1024}k | {tp} | {method} | {res['time']:.2f} | "
                    f"{res['time'] / ref['time']:.2f}x | {res['extra'] / GiB:.3f} | "
                    f"{res['extra'] / ref['extra']:.2f}x | {working / GiB:.3f} | "
                    f"{working / ref_working:.3f}x | {working / logits_bytes:.3f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
