"""Forward-only peak memory of a last stage: megatron's LM head vs the batch-first head.

A forward-only pass (reference or previous-policy logprobs) of a one-layer tiny ``GPTModel``
with a large vocabulary, each variant in its own fresh rank:

* ``megatron``: ``GPTModel``'s own head: ``[S, B, V]`` logits, then
  ``logits.transpose(0, 1).contiguous()``, a second ``[B, S, V]`` copy;
* ``batch_first``: the same model under
  :func:`lightning_mcore_rl.train.fused.lm_head_batch_first` (what ``model_forward`` runs on a
  plain last stage): the logits are computed ``[B, S, V]`` and the final ``.contiguous()``
  copies nothing.

Memory is the process's ``VmHWM`` during the forward (reset just before it) minus its RSS just
before it, in MiB, and that figure over the size of the fp32 logits.

Usage::

    .venv/bin/python benchmarks/lm_head_forward_memory.py [--vocab 32000 --rows 8 --seq 512]
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch

from lightning_mcore_rl.testing import run_on_ranks


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def _measure(rank: int, batch_first: bool, vocab: int, rows: int, seq: int) -> tuple[float, float]:
    """``(peak extra MiB, logits MiB)`` of one no-grad forward."""
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config
    from lightning_mcore_rl.train import causal_attention_mask
    from lightning_mcore_rl.train.fused import lm_head_batch_first

    torch.set_num_threads(1)
    init_megatron_state()
    config = tiny_gpt_config(num_layers=1, hidden_size=64)
    model = tiny_gpt(config, vocab_size=vocab, max_sequence_length=seq)
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.arange(seq)[None, :].expand(rows, -1), causal_attention_mask(seq))
    head = lm_head_batch_first(model) if batch_first else contextlib.nullcontext()
    with torch.no_grad():
        model(*args)  # warm-up: allocator and kernels
        gc.collect()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current RSS
        before = _status_mib("VmRSS")
        with head:
            logits = model(*args)  # [B, S, V]
    return _status_mib("VmHWM") - before, logits.numel() * logits.element_size() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("| head | peak extra MiB | fp32 logits MiB | peak / logits |")
    print("|---|---|---|---|")
    for _ in range(args.repeats):
        for batch_first in (False, True):
            (result,) = run_on_ranks(
                _measure, 1, batch_first, args.vocab, args.rows, args.seq, timeout=300
            )
            extra, logits = result
            name = "batch_first" if batch_first else "megatron"
            print(f"| {name} | {extra:.0f} | {logits:.0f} | {extra / logits:.2f}x |")


if __name__ == "__main__":
    main()
