"""Our GRPO step against TRL's ``GRPOTrainer`` on the same work, by process CPU time per step.

Run: ``.venv/bin/python benchmarks/grpo_vs_trl.py [--size 3.1M|32M] [--pairs 3] [--steps 10]
[--warmup 2] [--prev-logprobs-pass auto|always]`` after ``bash scripts/bootstrap_trl.sh`` (TRL
1.16 in its own environment, ``.venv-trl``).

Both sides train the same random fp32 Llama directory (written here with transformers: a
word-level tokenizer over the numbers ``"0"`` ... ``"1019"`` and 4 special tokens, vocabulary
1024) on the same counting prompts (8 consecutive numbers modulo 1020; every prompt 9 tokens
with BOS), the same reward (`count_reward`: how closely the completion continues the count), the
same group size, completion length (every completion exactly ``--new-tokens`` tokens: ours samples
without stopping at EOS, TRL with ``min_new_tokens``), temperature 1, Adam (no weight decay, the
same ``--lr``, constant), gradient clipping at 1.0, no reference model (KL coefficient 0), the
clipped token-mean policy-gradient loss, and one optimizer step per rollout batch (the whole
batch in one micro-batch). Each side runs in its own fresh process with one intra-op thread
(``torch.set_num_threads(1)``):

* ours: ``GRPOModule(rollout=RolloutSpec(backend="hf"))`` on an ``HFModelSpec`` model with a
  ``TextRewardTask`` and ``PromptFileDataModule``, under ``Trainer(strategy=MCoreRLStrategy())``
  on one CPU rank, with ``.venv/bin/python``;
* TRL: ``GRPOTrainer`` (``use_vllm=False``: plain ``transformers.generate``;
  ``gradient_checkpointing=False``, ``bf16=False``, ``beta=0``, ``num_iterations=1``,
  ``per_device_train_batch_size`` = the rollout batch, so one optimizer step per generation and
  no old-logprob pass) with ``--trl-python`` (default ``.venv-trl/bin/python``).

``--pairs`` pairs run back to back, alternating which side goes first. Clock: process CPU time
(``time.process_time``: every thread of the process, no time spent waiting or descheduled), since
wall time swings by several times between identical runs on a shared machine. A step is the CPU
time between two consecutive step starts (Lightning's ``on_train_batch_start``, TRL's
``on_step_begin``; the last step ends at ``on_train_end``): data loading, hooks and logging
included; the first ``--warmup`` steps are left out. Phases (mean CPU s/step), each by a timer
around the function named:

* ``generate``: ours ``PolicyRollout.generate`` less the refit; TRL ``_generate`` (tokenize,
  ``generate``, decode);
* ``refit``: ours ``PolicyRollout._refit`` (the weight export into the HF generator); TRL none
  (it generates with the training model);
* ``score``: the rest of the rollout (rewards, advantages; ours ``make_rollout`` less the above,
  TRL ``_generate_and_score_completions`` less ``_generate`` and the logprob pass);
* ``logprobs``: the forward-only pass over the batch before training (ours ``compute_logprobs``,
  TRL's old-logprob ``_get_per_token_logps_and_entropies``);
* ``train``: forward + loss + backward (ours ``forward_backward``; TRL ``training_step`` less
  ``_prepare_inputs``);
* ``optimizer``: ours ``MCoreRLStrategy.optimizer_step`` less the training step it runs as the
  closure (megatron's Adam, clipping, the update check); TRL from the end of ``training_step`` to
  ``on_optimizer_step`` (clipping, grad norm, ``optimizer.step``);
* ``rest``: the step less all of the above (Lightning's / HF Trainer's loop, zeroing, logging,
  data loading, metrics).

Peak RSS: each process's ``ru_maxrss``. The table gives each pair's CPU s/step per phase for both
sides and the ratio ours/TRL of the totals and peaks.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import resource
import socket
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

NUMBERS = 1020
"""The words are the numbers ``0 .. NUMBERS - 1``; with 4 special tokens the vocabulary is 1024."""
PROMPT_WORDS = 8
"""Every prompt: this many consecutive numbers (modulo ``NUMBERS``)."""

SIZES: dict[str, dict[str, Any]] = {
    # the model of benchmarks/grpo_async.py: 8 heads of 32, no grouped-query attention
    "3.1M": {
        "model": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                  "num_key_value_heads": 8, "intermediate_size": 512},
        "prompts": 8, "group": 8, "new_tokens": 32,
    },
    "32M": {
        "model": {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
                  "num_key_value_heads": 8, "intermediate_size": 1792},
        "prompts": 8, "group": 4, "new_tokens": 16,
    },
}  # fmt: skip

PHASES = ("generate", "refit", "score", "logprobs", "train", "optimizer", "rest", "total")


# ------------------------------------------------------------------------------ shared


def count_reward(prompt: str, completion: str) -> float:
    """How closely ``completion``'s words continue ``prompt``'s count: the mean over its words of
    ``1 - d / (NUMBERS / 2)``, ``d`` the circular distance to the expected number (1: the count
    continued exactly; 0 for no number). Graded, so a group's rewards differ and every step
    updates the weights."""
    last = int(prompt.split()[-1])
    words = completion.split()
    score = 0.0
    for i, word in enumerate(words):
        if word.isdigit():
            d = abs(int(word) - (last + 1 + i)) % NUMBERS
            score += 1 - min(d, NUMBERS - d) / (NUMBERS / 2)
    return score / max(len(words), 1)


class Clock:
    """Process CPU seconds per step: ``begin`` marks each step's start, ``add`` charges a phase
    of the current step, ``timed`` wraps a function so its CPU time is charged to ``key``."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.steps: list[dict[str, float]] = []
        self.marks: dict[str, float] = {}

    def begin(self) -> None:
        self.starts.append(time.process_time())
        self.steps.append(defaultdict(float))

    def add(self, key: str, seconds: float) -> None:
        if self.steps:  # nothing before the first step (set-up) is charged
            self.steps[-1][key] += seconds

    def timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.process_time() - start)

        return wrapper

    def finish(self) -> list[dict[str, float]]:
        """Each step's raw timers and its ``total`` (start to the next start, or to now)."""
        ends = [*self.starts[1:], time.process_time()]
        return [
            {**step, "total": end - start}
            for step, start, end in zip(self.steps, self.starts, ends, strict=True)
        ]


def _zero_default(step: dict[str, float]) -> defaultdict[str, float]:
    """``step`` with 0 for a timer that never ran (e.g. a skipped logprob pass)."""
    return defaultdict(float, step)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)


# ------------------------------------------------------------------------------ our side


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """``steps`` GRPO steps of `GRPOModule` (``backend="hf"``) on one CPU rank."""
    _one_thread()
    import inspect

    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_mcore_rl import MCoreRLStrategy
    from lightning_mcore_rl.recipes import (
        GRPOModule,
        HFModelSpec,
        PromptFileDataModule,
        RolloutSpec,
        TextRewardTask,
    )
    from lightning_mcore_rl.strategy import MicrobatchConfig, ReliabilityConfig

    clock = Clock()
    rewards: list[float] = []
    lengths: list[float] = []  # mean completion words per step (= tokens, special ones skipped)

    def reward(
        prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        scores = [count_reward(p, c) for p, c in zip(prompts, completions, strict=True)]
        rewards.append(sum(scores) / len(scores))
        lengths.append(statistics.fmean(len(c.split()) for c in completions))
        return torch.tensor(scores, dtype=torch.float32)

    class Steps(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_start(self, *unused: Any) -> None:
            clock.begin()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *_: Any) -> None:
            self.losses.append(float(outputs["loss"]))

    batch = args.prompts * args.group
    steps = Steps()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MCoreRLStrategy(
            microbatching=MicrobatchConfig(micro_batch_size=batch),
            # --no-verify-updates: what the default update check costs in the optimizer phase
            reliability=ReliabilityConfig(verify_updates=not args.no_verify_updates),
        ),
        max_steps=args.steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[steps],
    )
    extra = {}
    if args.prev_logprobs_pass is not None:
        if "prev_logprobs_pass" not in inspect.signature(GRPOModule).parameters:
            raise SystemExit("--prev-logprobs-pass: this GRPOModule has no `prev_logprobs_pass`")
        extra["prev_logprobs_pass"] = args.prev_logprobs_pass
    module = GRPOModule(
        task=TextRewardTask(reward=reward, max_prompt_length=PROMPT_WORDS + 1),
        model=HFModelSpec(path=args.model_dir),
        rollout=RolloutSpec(
            group_size=args.group,
            max_new_tokens=args.new_tokens,
            temperature=1.0,
            backend="hf",
            stop_at_eos=False,  # every completion new_tokens long, as TRL's min_new_tokens
        ),
        lr=args.lr,
        **extra,
    )
    # the phases: instance attributes shadow the methods Lightning and the recipe call
    timers = (
        (module.rollout_source, "generate", "rollout_generate"),
        (module.rollout_source, "_refit", "refit"),
        (module, "make_rollout", "make_rollout"),
        (module, "compute_logprobs", "logprobs"),
        (module, "forward_backward", "train"),
        (module, "training_step", "training_step"),
        (trainer.strategy, "optimizer_step", "optimizer_step"),
    )
    for owner, name, key in timers:
        object.__setattr__(owner, name, clock.timed(getattr(owner, name), key))
    data = PromptFileDataModule(
        train_files=args.prompt_file,
        tokenizer=args.model_dir,
        max_prompt_length=PROMPT_WORDS + 1,
        prompts_per_step=args.prompts,
    )
    trainer.fit(module, datamodule=data)
    raw = clock.finish()
    phases = []
    for step in map(_zero_default, raw):
        generate = step["rollout_generate"] - step["refit"]
        optimizer = step["optimizer_step"] - step["training_step"]  # the closure runs inside
        out = {
            "generate": generate,
            "refit": step["refit"],
            "score": step["make_rollout"] - step["rollout_generate"],
            "logprobs": step["logprobs"],
            "train": step["train"],
            "optimizer": optimizer,
            "total": step["total"],
        }
        out["rest"] = out["total"] - sum(v for k, v in out.items() if k != "total")
        phases.append(out)
    return {"steps": phases, "losses": steps.losses, "rewards": rewards, "lengths": lengths}


# ------------------------------------------------------------------------------ TRL's side


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    """``steps`` steps of TRL's `GRPOTrainer` (plain ``generate``) on one CPU process."""
    _one_thread()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    clock = Clock()
    rewards: list[float] = []
    lengths: list[float] = []  # mean completion words per step (= tokens, special ones skipped)

    def count_reward_fn(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        scores = [count_reward(p, c) for p, c in zip(prompts, completions, strict=True)]
        rewards.append(sum(scores) / len(scores))
        lengths.append(statistics.fmean(len(c.split()) for c in completions))
        return scores

    class Timed(GRPOTrainer):  # type: ignore[misc]
        in_rollout = False

        def _generate_and_score_completions(self, *a: Any, **k: Any) -> Any:
            self.in_rollout = True
            try:
                return clock.timed(super()._generate_and_score_completions, "rollout")(*a, **k)
            finally:
                self.in_rollout = False

        def _generate(self, *a: Any, **k: Any) -> Any:
            return clock.timed(super()._generate, "generate")(*a, **k)

        def _get_per_token_logps_and_entropies(self, *a: Any, **k: Any) -> Any:
            key = "logprobs" if self.in_rollout else "train_logps"
            return clock.timed(super()._get_per_token_logps_and_entropies, key)(*a, **k)

        def _prepare_inputs(self, *a: Any, **k: Any) -> Any:
            return clock.timed(super()._prepare_inputs, "prepare_inputs")(*a, **k)

        def training_step(self, *a: Any, **k: Any) -> Any:
            out = clock.timed(super().training_step, "training_step")(*a, **k)
            clock.marks["training_step_end"] = time.process_time()
            return out

    class Steps(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_step_begin(self, *unused: Any, **kwargs: Any) -> None:
            clock.begin()

        def on_optimizer_step(self, *unused: Any, **kwargs: Any) -> None:
            clock.add("optimizer", time.process_time() - clock.marks["training_step_end"])

        def on_log(self, *unused: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    rows = [json.loads(line) for line in Path(args.prompt_file).read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    batch = args.prompts * args.group
    config = GRPOConfig(
        output_dir=args.work_dir,
        per_device_train_batch_size=batch,  # completions: the whole rollout batch per step
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group,
        num_iterations=1,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        pad_to_multiple_of=None,
        beta=0.0,
        epsilon=0.2,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",  # = Adam without weight decay
        max_grad_norm=1.0,
        max_steps=args.steps,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        use_vllm=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    steps = Steps()
    trainer = Timed(
        model=model,
        reward_funcs=[count_reward_fn],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[steps],
    )
    trainer.train()
    raw = clock.finish()
    phases = []
    for step in map(_zero_default, raw):
        out = {
            "generate": step["generate"],
            "refit": 0.0,
            "score": step["rollout"] - step["generate"] - step["logprobs"],
            "logprobs": step["logprobs"],
            "train": step["training_step"] - step["prepare_inputs"],
            "optimizer": step["optimizer"],
            "total": step["total"],
        }
        # _prepare_inputs less the rollout: the buffered-batch bookkeeping, left in `rest`
        out["rest"] = out["total"] - sum(v for k, v in out.items() if k != "total")
        phases.append(out)
    return {"steps": phases, "losses": steps.losses, "rewards": rewards, "lengths": lengths}


def worker(args: argparse.Namespace) -> None:
    start = time.process_time()
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    result["process_cpu_s"] = time.process_time() - start
    result["peak_rss_mib"] = _peak_rss_mib()
    Path(args.out).write_text(json.dumps(result))


# ------------------------------------------------------------------------------ driver


def write_model_and_prompts(directory: Path, size: str, prompts: int, seed: int) -> int:
    """The random Llama + tokenizer of ``size`` in ``directory`` and ``prompts.jsonl`` with
    ``prompts`` counting prompts; returns the parameter count."""
    from lightning_mcore_rl.recipes.arithmetic import train_tokenizer, write_tiny_llama

    tokenizer = train_tokenizer([" ".join(str(i) for i in range(NUMBERS))])
    write_tiny_llama(
        directory,
        tokenizer,
        **SIZES[size]["model"],
        max_position_embeddings=128,
        seed=seed,
        random_pad_embedding=True,
    )
    rng = random.Random(seed)
    lines = []
    for _ in range(prompts):
        start = rng.randrange(NUMBERS)
        words = [str((start + i) % NUMBERS) for i in range(PROMPT_WORDS)]
        lines.append(json.dumps({"prompt": " ".join(words), "start": start}) + "\n")
    (directory / "prompts.jsonl").write_text("".join(lines))
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, side: str, work: Path, tag: str) -> dict[str, Any]:
    python = args.ours_python if side == "ours" else args.trl_python
    out = work / f"{tag}.json"
    run_dir = work / tag
    run_dir.mkdir()
    cmd = [
        python, __file__, f"--side={side}", f"--out={out}", f"--model-dir={args.model_dir}",
        f"--prompt-file={args.prompt_file}", f"--work-dir={run_dir}", f"--steps={args.steps}",
        f"--prompts={args.prompts}", f"--group={args.group}", f"--new-tokens={args.new_tokens}",
        f"--lr={args.lr}",
    ]  # fmt: skip
    if side == "ours" and args.prev_logprobs_pass is not None:
        cmd.append(f"--prev-logprobs-pass={args.prev_logprobs_pass}")
    if side == "ours" and args.no_verify_updates:
        cmd.append("--no-verify-updates")
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env = {
        **os.environ, **threads, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(run_dir / "datasets"), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }  # fmt: skip
    wall = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - wall
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def mean_phases(result: dict[str, Any], warmup: int) -> dict[str, float]:
    steps = result["steps"][warmup:]
    return {k: statistics.fmean(s[k] for s in steps) for k in PHASES}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _revision() -> str:
    """The commit measured, and whether the package has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "lightning_mcore_rl"], capture_output=True, text=True
    )
    return f"main {head.stdout.strip()}" + (" + uncommitted changes" if dirty.stdout else "")


def _cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "?")


def driver(args: argparse.Namespace) -> None:
    if not Path(args.trl_python).exists():
        raise SystemExit(f"{args.trl_python} missing: run `bash scripts/bootstrap_trl.sh` first")
    size = SIZES[args.size]
    for key in ("prompts", "group", "new_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, size[key])
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps must be > --warmup ({args.warmup})")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {_cpu_model()}, "
          f"{os.cpu_count()} CPUs; {_revision()}; uptime at start: {_uptime()}",
          flush=True)  # fmt: skip
    results: list[tuple[dict[str, Any], dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        params = write_model_and_prompts(model_dir, args.size, args.steps * args.prompts, 0)
        args.model_dir, args.prompt_file = str(model_dir), str(model_dir / "prompts.jsonl")
        print(
            f"Llama {args.size} ({params / 1e6:.2f}M parameters: {size['model']}, vocabulary "
            f"1024), fp32, one thread; {args.prompts} prompts x G={args.group} x "
            f"{args.new_tokens} new tokens per step, {args.steps} steps ({args.warmup} warm-up "
            f"left out), Adam lr {args.lr}; ours prev_logprobs_pass="
            f"{args.prev_logprobs_pass or 'default'}"
            + (", verify_updates=False" if args.no_verify_updates else ""),
            flush=True,
        )
        for pair in range(args.pairs):
            order = ("ours", "trl") if pair % 2 == 0 else ("trl", "ours")
            got = {side: launch(args, side, work, f"pair{pair}_{side}") for side in order}
            results.append((got["ours"], got["trl"]))
            ours, trl = (mean_phases(got[s], args.warmup) for s in ("ours", "trl"))
            print(
                f"pair {pair} ({order[0]} first): ours {ours['total']:.3f} CPU s/step, TRL "
                f"{trl['total']:.3f}, ratio {ours['total'] / trl['total']:.3f}; peak RSS "
                f"{got['ours']['peak_rss_mib']:.0f} / {got['trl']['peak_rss_mib']:.0f} MiB; wall "
                f"{got['ours']['wall_s']:.0f} / {got['trl']['wall_s']:.0f} s",
                flush=True,
            )
    print(f"\nuptime at end: {_uptime()}\n")
    print("Mean process CPU s/step of the measured steps, per phase:\n")
    print(f"| pair | side | {' | '.join(PHASES)} | ours/TRL total | peak RSS MiB | ours/TRL RSS |")
    print("|---|---|" + "---|" * len(PHASES) + "---|---|---|")
    for pair, (ours, trl) in enumerate(results):
        mo, mt = mean_phases(ours, args.warmup), mean_phases(trl, args.warmup)
        for side, m, r in (("ours", mo, ours), ("TRL", mt, trl)):
            ratio = f"{mo['total'] / mt['total']:.3f}" if side == "ours" else ""
            rss = f"{ours['peak_rss_mib'] / trl['peak_rss_mib']:.3f}" if side == "ours" else ""
            cells = " | ".join(f"{m[k]:.3f}" for k in PHASES)
            print(f"| {pair} | {side} | {cells} | {ratio} | {r['peak_rss_mib']:.0f} | {rss} |")
    print("\nPer-step losses and mean rewards of the last pair (ours / TRL):")
    for side, r in (("ours", results[-1][0]), ("TRL", results[-1][1])):
        print(f"  {side} loss {[round(x, 4) for x in r['losses']]}")
        print(f"  {side} reward {[round(x, 4) for x in r['rewards']]}")
        print(f"  {side} mean completion words {[round(x, 2) for x in r['lengths']]}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "pairs": [list(p) for p in results]}, indent=1)
        )


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="3.1M", help="model + workload")
    parser.add_argument("--pairs", type=int, default=3, help="ours/TRL pairs, back to back")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--prompts", type=int, help="prompts per step (default: per --size)")
    parser.add_argument("--group", type=int, help="completions per prompt (default: per --size)")
    parser.add_argument("--new-tokens", type=int, help="completion length (default: per --size)")
    parser.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (both)")
    parser.add_argument(
        "--prev-logprobs-pass",
        choices=("auto", "always"),
        help="ours: GRPOModule(prev_logprobs_pass=...) (default: not passed, the module's default)",
    )
    parser.add_argument(
        "--no-verify-updates",
        action="store_true",
        help="ours: ReliabilityConfig(verify_updates=False) (default: the strategy's check on)",
    )
    parser.add_argument("--ours-python", default=str(root / ".venv/bin/python"))
    parser.add_argument("--trl-python", default=str(root / ".venv-trl/bin/python"))
    parser.add_argument("--timeout", type=int, default=3600, help="per run, s")
    parser.add_argument("--json", help="write every step's phases here")
    parser.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
