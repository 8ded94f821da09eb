"""Cost of the CPU test machinery: rank start-up and the emulation's per-step overhead.

Run: ``.venv/bin/python benchmarks/megatron_cpu.py``. Prints, in one run:

* start-up of a 2-rank job that imports megatron-core and all-reduces once: ``torchrun`` (the
  baseline every megatron user knows) vs ``run_on_ranks`` cold (first call, starts the forkserver)
  and warm (later calls: ranks fork from a process that already imported torch + megatron);
* forward+backward of the tiny GPT with and without the ``cpu_emulation`` TorchFunctionMode;
* a full megatron training step (DDP + schedule + Adam) at TP=1 and TP=2.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_mcore_rl.testing import run_on_ranks

_TORCHRUN_SCRIPT = """
import torch.distributed as dist, torch, megatron.core.models.gpt, megatron.core.optimizer
dist.init_process_group("gloo"); t = torch.ones(1); dist.all_reduce(t); dist.destroy_process_group()
"""


def _all_reduce(rank: int) -> float:
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value)


def _timed(fn, repeats: int = 1) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def startup() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "noop.py"
        script.write_text(_TORCHRUN_SCRIPT)
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        baseline = _timed(lambda: subprocess.run(cmd, check=True, capture_output=True, env=env), 3)
    cold = _timed(lambda: run_on_ranks(_all_reduce, 2, emulate_cuda=False))
    warm = _timed(lambda: run_on_ranks(_all_reduce, 2, emulate_cuda=False), 5)
    return {"torchrun": baseline, "run_on_ranks cold": cold, "run_on_ranks warm": warm}


def _mode_overhead(rank: int, hidden: int) -> dict[str, float]:
    from lightning_mcore_rl.cpu.emulation import _STATE
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config

    init_megatron_state()
    model = tiny_gpt(tiny_gpt_config(num_layers=4, hidden_size=hidden, num_attention_heads=8))
    tokens = torch.randint(0, 128, (4, 64))
    positions = torch.arange(64).expand(4, 64)
    # explicit mask: megatron's default causal mask is built with device="cuda"
    causal = torch.triu(torch.ones(64, 64, dtype=torch.bool), diagonal=1).view(1, 1, 64, 64)

    def step() -> None:
        model(tokens, positions, causal, labels=tokens).mean().backward()

    for _ in range(3):
        step()
    with_mode = _timed(step, 20)
    _STATE.mode.__exit__(None, None, None)  # measure the same model with the mode popped
    try:
        for _ in range(3):
            step()
        without_mode = _timed(step, 20)
    finally:
        _STATE.mode.__enter__()
    return {"with": with_mode, "without": without_mode}


def _train_steps(rank: int, tp: int) -> float:
    from lightning_mcore_rl.testing import init_megatron_state
    from lightning_mcore_rl.testing.training import build_training, make_microbatches, train_step

    init_megatron_state(tensor_model_parallel_size=tp)
    setup = build_training()
    batches = make_microbatches(2, 4, 32)
    for _ in range(3):
        train_step(setup, batches)
    return _timed(lambda: train_step(setup, batches), 20)


def main() -> None:
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    times = startup()
    base = times["torchrun"]
    print("\n2-rank start-up (import megatron-core, init gloo, one all-reduce)")
    for name, value in times.items():
        print(f"  {name:<20} {value:6.2f} s   {value / base:5.2f}x torchrun")
    print("\ntiny GPT fwd+bwd, 4 layers, batch 4 x 64 tokens (median of 20)")
    for hidden in (64, 512):
        (res,) = run_on_ranks(_mode_overhead, 1, hidden)
        print(
            f"  H={hidden:<4} plain {res['without'] * 1e3:7.2f} ms   emulated "
            f"{res['with'] * 1e3:7.2f} ms   {res['with'] / res['without']:5.2f}x"
        )
    print("\nmegatron train step (DDP + schedule + Adam + clip), 2 microbatches of 4 x 32")
    tp1 = run_on_ranks(_train_steps, 1, 1)[0]
    tp2 = max(run_on_ranks(_train_steps, 2, 2))
    print(f"  TP=1 (1 rank) {tp1 * 1e3:7.2f} ms   TP=2 (2 ranks) {tp2 * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
