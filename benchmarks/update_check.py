"""What verifying an optimizer update costs: the preview against the snapshot, on one CPU rank.

Run: ``.venv/bin/python benchmarks/update_check.py [--steps N] [--block E] [--bf16]``.

The parameters have the shapes of the peer benchmark's Llama (``peer_update_step.py``: vocab
32000, hidden 512, 4 layers, FFN 1408, 8/4 heads, untied head: 44.6M parameters) and sit under
torch's ``AdamW`` as megatron builds it on CPU (``--bf16``: fp32 main parameters beside bf16
model parameters, as megatron's mixed-precision optimizer keeps them; the update is written to
the fp32 ones and copied to the bf16 ones). Each variant runs in its own process (one intra-op
thread), ``N`` timed steps after one warm-up step (which creates the Adam state):

* ``step``: ``optimizer.step()`` alone (and the bf16 copy), the baseline;
* ``certified``: :func:`~lightning_mcore_rl.reliability.update_bound.certify_update` (the update
  check's default for torch Adam/AdamW: a bound from one read of the parameters and moments and
  the global gradient norm megatron's step computes anyway), the preview only where it cannot
  certify, then the step;
* ``preview``: :func:`~lightning_mcore_rl.reliability.update_preview.preview_measures` (the update
  check for torch SGD, and for Adam/AdamW updates the bound cannot certify), then the step;
* ``snapshot``: ``UpdateSnapshot.take`` of the model parameters and the optimizer, the step,
  then :func:`~lightning_mcore_rl.reliability.update_check.update_measures` (what the check did
  before 2026-12-05, and still does for inner optimizers it cannot preview).

Printed per variant: the median process CPU seconds per step (``time.process_time``: the work
done, steadier than wall time on a shared machine; its ratio to ``step``), whether every timed
step was certified, and the peak RSS above
the RSS after the warm-up step (what the variant adds on top of parameters, gradients and Adam
state: ``ru_maxrss`` minus the set-up RSS, MiB).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

VARIANTS = ("step", "certified", "preview", "snapshot")


def llama_shapes(vocab: int = 32000, hidden: int = 512, layers: int = 4, ffn: int = 1408,
                 heads: int = 8, kv_heads: int = 4) -> list[tuple[int, ...]]:  # fmt: skip
    """The parameter shapes of the peer benchmark's Llama (embedding, layers, norm, head)."""
    kv = hidden // heads * kv_heads
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
             (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]  # fmt: skip
    return [(vocab, hidden), *layer * layers, (hidden,), (vocab, hidden)]


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def worker(variant: str, steps: int, block: int, bf16: bool) -> dict[str, Any]:
    from types import SimpleNamespace

    from lightning_mcore_rl.reliability.update_bound import certify_update
    from lightning_mcore_rl.reliability.update_check import UpdateSnapshot, update_measures
    from lightning_mcore_rl.reliability.update_preview import preview_measures

    torch.set_num_threads(1)
    torch.manual_seed(0)
    main = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in llama_shapes()]
    model = [p.detach().bfloat16() for p in main] if bf16 else main
    member = SimpleNamespace(optimizer=torch.optim.AdamW(main, lr=1e-4, weight_decay=0.01))

    def update() -> None:
        member.optimizer.step()
        if bf16:
            with torch.no_grad():
                for m, p in zip(model, main, strict=True):
                    m.copy_(p)

    certified = []

    def step() -> None:
        if variant == "certified":
            certified.append(certify_update(member, "cpu", None, 1e3, grad_norm))
            if not certified[-1]:
                preview_measures(member, "cpu", None, block=block)
            update()
        elif variant == "preview":
            preview_measures(member, "cpu", None, block=block)
            update()
        elif variant == "snapshot":
            snapshot = UpdateSnapshot.take(member, model)
            update()
            update_measures(snapshot, "cpu", None)
        else:
            update()

    for p in main:
        p.grad = torch.randn(p.shape) * 1e-3
    # megatron's global gradient norm, computed by its step whether or not updates are checked
    grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in main])))
    update()  # the Adam state
    setup = _rss_mib()
    times = []
    for _ in range(steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": statistics.median(times), "extra_mib": peak - setup, "setup_mib": setup,
            "certified": all(certified) if certified else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--block", type=int, default=None, help="preview block (elements)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.block is None:
        from lightning_mcore_rl.reliability.update_preview import block_elements

        args.block = block_elements("cpu")
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.block, args.bf16)))
        return
    results = {}
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--worker", variant, "--steps", str(args.steps),
                   "--block", str(args.block)] + (["--bf16"] if args.bf16 else [])  # fmt: skip
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    base = results["step"]["seconds"]
    params = sum(torch.Size(s).numel() for s in llama_shapes())
    print(f"{params / 1e6:.1f}M parameters, AdamW, {'bf16 + fp32 main' if args.bf16 else 'fp32'}"
          f", preview block {args.block}, median of {args.steps} steps, 1 thread, "
          "process CPU time")  # fmt: skip
    print("| variant | CPU s/step | vs step | certified | extra peak RSS MiB | set-up RSS MiB |")
    print("|---|---|---|---|---|---|")
    for variant, r in results.items():
        certified = "" if r["certified"] is None else ("all" if r["certified"] else "not all")
        print(f"| {variant} | {r['seconds']:.3f} | {r['seconds'] / base:.2f}x | {certified} | "
              f"{r['extra_mib']:.0f} | {r['setup_mib']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
