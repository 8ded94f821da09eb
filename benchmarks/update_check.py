"""What verifying an optimizer update costs (the certificate, the preview, the snapshot), and what
megatron's optimizer path costs beside torch's AdamW, on one CPU rank.

Run: ``.venv/bin/python benchmarks/update_check.py [--steps N] [--block E] [--bf16]``.

The parameters have the shapes of the peer benchmark's Llama (``peer_update_step.py``: vocab
32000, hidden 512, 4 layers, FFN 1408, 8/4 heads, untied head: 44.6M parameters) and sit under
torch's ``AdamW`` as megatron builds it on CPU (``--bf16``: fp32 main parameters beside bf16
model parameters, as megatron's mixed-precision optimizer keeps them; the update is written to
the fp32 ones and copied to the bf16 ones). Each variant runs in its own process (one intra-op
thread), ``N`` timed steps after one warm-up step (which creates the Adam state):

* ``step``: ``optimizer.step()`` alone (and the bf16 copy), the baseline;
* ``megatron``: megatron's own path over the same parameters, under the CPU emulation:
  ``FP32Optimizer`` (``--bf16``: ``Float16OptimizerWithFloat16Params``, bf16 model parameters and
  its fp32 main copies) around the same torch ``AdamW``, timing ``prepare_grads``,
  ``get_grad_norm`` (what clipping needs) and ``step_with_ready_grads`` (the inner step, and the
  copy to the bf16 parameters): what it adds to ``step`` beyond the norm is its overhead;
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

VARIANTS = ("step", "megatron", "certified", "preview", "snapshot")


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
    if variant == "megatron":
        return _megatron_worker(steps, bf16, [p.grad for p in main])
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


def _megatron_worker(steps: int, bf16: bool, grads: list[torch.Tensor]) -> dict[str, Any]:
    """The ``megatron`` variant: megatron's optimizer over the same shapes and gradients."""
    import tempfile

    import torch.distributed as dist

    from lightning_mcore_rl.cpu.emulation import cpu_emulation

    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    with cpu_emulation():
        from megatron.core import parallel_state
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.optimizer import (
            Float16OptimizerWithFloat16Params,
            FP32Optimizer,
        )

        parallel_state.initialize_model_parallel()
        torch.manual_seed(0)
        dtype = torch.bfloat16 if bf16 else torch.float32
        params = [torch.nn.Parameter((torch.randn(g.shape) * 0.02).to(dtype)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.main_grad = g  # what megatron's DDP leaves: fp32 gradients beside the parameters
        inner = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
        config = OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, bf16=bf16)
        optimizer: Any
        if bf16:
            optimizer = Float16OptimizerWithFloat16Params(inner, config, None, lambda *_: None)
        else:
            optimizer = FP32Optimizer(inner, config, lambda *_: None)

        def step() -> float:
            optimizer.prepare_grads()
            start = time.process_time()
            optimizer.get_grad_norm()
            norm_s = time.process_time() - start
            optimizer.step_with_ready_grads()
            return norm_s

        step()  # the Adam state
        setup = _rss_mib()
        times, norms = [], []
        for _ in range(steps):
            start = time.process_time()
            norms.append(step())
            times.append(time.process_time() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.destroy_process_group()
    return {"seconds": statistics.median(times), "extra_mib": peak - setup, "setup_mib": setup,
            "certified": None, "norm_seconds": statistics.median(norms)}  # fmt: skip


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
        if "norm_seconds" in r:
            certified = f"(of which grad norm {r['norm_seconds']:.3f})"
        print(f"| {variant} | {r['seconds']:.3f} | {r['seconds'] / base:.2f}x | {certified} | "
              f"{r['extra_mib']:.0f} | {r['setup_mib']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
