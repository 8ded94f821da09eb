"""Arithmetic word problems on two CPU ranks: a tiny Llama is SFT-warmed, then trained with GRPO
and the numeric verifier, and evaluated with ``transformers`` before and after GRPO.

Launch (2-4 minutes on a 2-core Intel Xeon, load average 1-10 from other jobs)::

    .venv/bin/python examples/arithmetic/run.py --seed 0 --out outputs/arithmetic/seed0

The stages, all under ``--out``:

1. ``data/``: train/validation problems made locally
   (:func:`~lightning_mcore_rl.recipes.make_splits`, disjoint), as ``{"prompt", "response"}``
   (SFT) and ``{"prompt", "answer"}`` (GRPO) JSONL; ``init/``: a word-level tokenizer trained on
   them and a random tiny Llama (:func:`~lightning_mcore_rl.recipes.write_tiny_llama`).
2. ``sft/``: a short SFT warm-up (``SFTModule`` on ``ResponseFileDataModule``, TP=1 DP=2;
   greedy accuracy about 30-65%, so GRPO has room), exported as an HF directory by the
   ``HFExport`` callback.
3. the SFT model's greedy accuracy on the validation problems with ``transformers``
   (:func:`~lightning_mcore_rl.recipes.evaluate_hf`).
4. ``grpo/``: GRPO from the SFT export (``TextRewardTask`` with ``NumericAnswerReward``, the
   ``transformers`` rollout backend refit after every step, or vLLM with ``--backend vllm``;
   completions ending at EOS), exported with ``HFExport``.
5. the GRPO model's accuracy; both accuracies and the stage times go to ``summary.json``.
   Measured on a 2-core Intel Xeon, seeds 0 / 1: 0.656 -> 0.793 / 0.449 -> 0.699 with torch's
   AVX-512 kernels, 0.637 -> 0.895 / 0.285 -> 0.660 with its AVX2 kernels
   (``ATEN_CPU_CAPABILITY=avx2``), 0.656 -> 0.906 / 0.355 -> 0.641 with MKL's and oneDNN's AVX2
   paths as well. A run repeats exactly on the same machine and kernels only;
   another CPU's rounding gives other numbers in about that range (BENCHMARKS.md).

``--backend vllm`` samples the GRPO stage with a vLLM engine instead
(``RolloutSpec(backend="vllm")``: the first rank of each replica's model-parallel group owns an
engine in a process of its own, refit in place after every step; two engines at TP=1 DP=2).
It runs in ``.venv-vllm`` (``scripts/bootstrap_vllm.sh``), and the random Llama then has 2
heads of 32 (:data:`~lightning_mcore_rl.recipes.arithmetic.VLLM_HEADS`: vLLM's CPU attention
needs a head dim of 32 or more), so its numbers are not the default run's::

    .venv-vllm/bin/python examples/arithmetic/run.py --backend vllm --out outputs/arithmetic/vllm0

Each training stage runs in its own ``Trainer(devices=2)`` launch (``--stage sft`` /
``--stage grpo``, started by the pipeline), so the two stages can use different layouts. Every
process runs one intra-op thread (:data:`THREADS`), and each training stage prints a line every
5% of its steps (:class:`StepLines`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.callbacks import HFExport, MetricsHistory
from lightning_mcore_rl.recipes import (
    ArithmeticProblem,
    evaluate_hf,
    make_splits,
    train_tokenizer,
    write_rl_rows,
    write_sft_rows,
    write_tiny_llama,
)
from lightning_mcore_rl.recipes.arithmetic import VLLM_HEADS
from lightning_mcore_rl.strategy import MicrobatchConfig

MAX_PROMPT_LENGTH = 24
"""Prompt tokens at most (the longest template is 19 words + BOS)."""

THREADS = "1"
"""Intra-op threads of every process (``OMP_NUM_THREADS``): the model is tiny, so more threads
per rank only contend for the cores (Lightning gives each rank ``visible CPUs / ranks``, all of a
large host's CPUs under a container's CPU quota), and the results do not depend on the core
count."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    description = " ".join(__doc__.split("\n\n")[0].replace("``", "").split())
    parser = argparse.ArgumentParser(
        description=description,
        epilog="Stages, outputs and measured numbers: docs/recipes.md and BENCHMARKS.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--seed", type=int, default=0, help="data, weight and sampling seed")
    add("--out", default="outputs/arithmetic", help="output directory (new or empty)")
    add("--train-problems", type=int, default=4000, help="training problems (SFT and GRPO)")
    add("--val-problems", type=int, default=256, help="held-out problems for the accuracy")
    add("--sft-steps", type=int, default=150, help="SFT optimizer steps")
    add("--sft-batch", type=int, default=32, help="SFT rows per step (even: 2 ranks)")
    add("--sft-lr", type=float, default=3e-3, help="SFT learning rate")
    add("--grpo-steps", type=int, default=300, help="GRPO optimizer steps")
    add("--grpo-prompts", type=int, default=16, help="GRPO prompts per step")
    add("--group-size", type=int, default=8, help="GRPO completions per prompt")
    add("--grpo-lr", type=float, default=1e-3, help="GRPO learning rate")
    add("--max-new-tokens", type=int, default=4, help="completion tokens at most")
    add(
        "--backend",
        choices=("hf", "vllm"),
        default="hf",
        help="GRPO rollout backend; vllm: run with .venv-vllm's python, the Llama has 2 heads of 32",
    )
    add("--stage", choices=("sft", "grpo"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class StepLines(Callback):
    """Progress of a training stage on rank 0: one line every ``max_steps / lines`` optimizer
    steps and after the last, with the step, the percentage, the mean of each of ``keys`` over
    the steps since the previous line, the seconds per step and the time left. Lines, not a
    progress bar, so a redirected log shows them too."""

    def __init__(
        self, stage: str, lines: int = 20, keys: tuple[str, ...] = ("reward", "train_loss")
    ):
        self.stage, self.lines, self.keys = stage, lines, keys
        self._values: dict[str, list[float]] = {}
        self._first_step = self._last_step = 0
        self._start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_step = self._last_step = trainer.global_step
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, total = trainer.global_step, trainer.max_steps
        if not trainer.is_global_zero or step == self._last_step:
            return
        self._last_step = step
        for key in self.keys:
            if key in trainer.callback_metrics:
                self._values.setdefault(key, []).append(float(trainer.callback_metrics[key]))
        if step % max(1, total // self.lines) and step != total:
            return
        per_step = (time.perf_counter() - self._start) / (step - self._first_step)
        means = "".join(f"  {k} {sum(v) / len(v):.3g}" for k, v in self._values.items())
        print(
            f"[{self.stage}] step {step}/{total} ({100 * step // total}%){means}  "
            f"{per_step:.2f} s/step, {per_step * (total - step):.0f} s left",
            flush=True,
        )
        self._values = {}


def _trainer(out: Path, steps: int, micro_batch_size: int, callbacks: list) -> Trainer:
    """Two CPU ranks at TP=1 (DP=2), one microbatch per rank and step, progress as
    :class:`StepLines`."""
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=1,
            microbatching=MicrobatchConfig(micro_batch_size=micro_batch_size),
        ),
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=CSVLogger(str(out), name="logs"),
        callbacks=[
            MetricsHistory(out, plot_keys=("train_loss", "reward")),
            StepLines(out.name),
            *callbacks,
        ],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def run_sft(args: argparse.Namespace, out: Path) -> None:
    """Stage 2: SFT of ``init/`` on the demonstrations, exported to ``sft/hf``."""
    from lightning_mcore_rl.recipes import HFModelSpec, ResponseFileDataModule, SFTModule

    init = str(out / "init")
    data = ResponseFileDataModule(
        str(out / "data" / "sft_train.jsonl"),
        tokenizer=init,
        samples_per_step=args.sft_batch,
        seed=args.seed,
        cache_dir=str(out / "cache"),
    )
    vocab = int(json.loads((out / "init" / "config.json").read_text())["vocab_size"])
    module = SFTModule(HFModelSpec(init), vocab_size=vocab, max_sequence_length=32, lr=args.sft_lr)
    stage = out / "sft"
    _trainer(stage, args.sft_steps, args.sft_batch // 2, [HFExport(stage / "hf")]).fit(
        module, datamodule=data
    )


def run_grpo(args: argparse.Namespace, out: Path) -> None:
    """Stage 4: GRPO of ``sft/hf`` with the numeric verifier, exported to ``grpo/hf``."""
    from lightning_mcore_rl.recipes import (
        GRPOModule,
        HFModelSpec,
        PromptFileDataModule,
        RolloutSpec,
        TextRewardTask,
    )
    from lightning_mcore_rl.rewards import NumericAnswerReward

    sft = str(out / "sft" / "hf")
    module = GRPOModule(
        task=TextRewardTask(reward=NumericAnswerReward(), max_prompt_length=MAX_PROMPT_LENGTH),
        model=HFModelSpec(path=sft),
        rollout=RolloutSpec(
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            temperature=1.0,
            seed=args.seed,
            backend=args.backend,
            stop_at_eos=True,
        ),
        lr=args.grpo_lr,
    )
    data = PromptFileDataModule(
        train_files=str(out / "data" / "rl_train.jsonl"),
        tokenizer=sft,
        max_prompt_length=MAX_PROMPT_LENGTH,
        prompts_per_step=args.grpo_prompts,
        seed=args.seed,
        cache_dir=str(out / "cache"),
    )
    stage = out / "grpo"
    rows = args.grpo_prompts * args.group_size // 2
    _trainer(stage, args.grpo_steps, rows, [HFExport(stage / "hf")]).fit(module, datamodule=data)


def prepare(args: argparse.Namespace, out: Path) -> list[ArithmeticProblem]:
    """Stage 1: the data files, the tokenizer and the random tiny Llama; returns the held-out
    problems."""
    train, val = make_splits(args.train_problems, args.val_problems, seed=args.seed)
    data = out / "data"
    write_sft_rows(train, data / "sft_train.jsonl")
    write_rl_rows(train, data / "rl_train.jsonl")
    write_rl_rows(val, data / "rl_val.jsonl")
    tokenizer = train_tokenizer(p.prompt + " " + p.response for p in train + val)
    if args.backend == "vllm":  # vLLM's CPU attention needs a head dim of 32, not the default 16
        write_tiny_llama(
            out / "init",
            tokenizer,
            seed=args.seed,
            num_attention_heads=VLLM_HEADS,
            num_key_value_heads=VLLM_HEADS,
        )
    else:
        write_tiny_llama(out / "init", tokenizer, seed=args.seed)
    return val


def _stage(argv: list[str], stage: str) -> float:
    """Run ``--stage stage`` in a new ``Trainer(devices=2)`` launch with :data:`THREADS`
    threads per rank; returns its wall time."""
    print(f"[{stage}] launching 2 ranks", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": THREADS}
    subprocess.run([sys.executable, __file__, *argv, "--stage", stage], check=True, env=env)
    return time.perf_counter() - start


def _evaluate(hf_dir: Path, val: list[ArithmeticProblem], max_new_tokens: int) -> float:
    """:func:`evaluate_hf` of ``hf_dir``, printed."""
    accuracy = evaluate_hf(hf_dir, val, max_new_tokens)
    print(f"[eval] {hf_dir}: greedy accuracy {accuracy:.3f} on {len(val)} problems", flush=True)
    return accuracy


def main(argv: list[str] | None = None) -> dict:
    """The whole pipeline (or, with ``--stage``, one training stage); returns the summary."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.out)
    if args.stage is not None:
        (run_sft if args.stage == "sft" else run_grpo)(args, out)
        return {}
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} is not empty; give a new directory.")
    if args.backend == "vllm":
        from lightning_mcore_rl.rollout.vllm_source import import_vllm

        import_vllm()  # before the SFT stage: without vLLM, raise naming how to install it
    torch.set_num_threads(int(THREADS))
    times: dict[str, float] = {}
    start = time.perf_counter()
    val = prepare(args, out)
    times["prepare"] = time.perf_counter() - start
    times["sft"] = _stage(argv, "sft")
    start = time.perf_counter()
    sft_accuracy = _evaluate(out / "sft" / "hf", val, args.max_new_tokens)
    times["eval_sft"] = time.perf_counter() - start
    times["grpo"] = _stage(argv, "grpo")
    start = time.perf_counter()
    grpo_accuracy = _evaluate(out / "grpo" / "hf", val, args.max_new_tokens)
    times["eval_grpo"] = time.perf_counter() - start
    summary = {
        "seed": args.seed,
        "val_problems": len(val),
        "sft_accuracy": sft_accuracy,
        "grpo_accuracy": grpo_accuracy,
        "gain": grpo_accuracy - sft_accuracy,
        "seconds": {k: round(v, 1) for k, v in times.items()},
        "args": {k: v for k, v in vars(args).items() if k != "stage"},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"greedy accuracy on {len(val)} held-out problems: SFT {sft_accuracy:.3f} -> "
        f"GRPO {grpo_accuracy:.3f} ({summary['gain']:+.3f}); total {sum(times.values()):.0f} s"
    )
    return summary


if __name__ == "__main__":
    main()
