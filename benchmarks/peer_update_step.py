"""One update step (forward + backward + optimizer) of the SAME imported Llama, same batch, same
loss, on two CPU ranks (``--ranks``; ``--device cuda``: one GPU per rank), under these stacks:

* ``trainer``   ``Trainer(strategy=MCoreRLStrategy())`` (DP=2) with an ``MCoreRLModule(loss_fn=...)``
  whose ``build_chunk`` imports the model with ``HFBridge``;
* ``trainer_chunked`` the same with ``PolicyConfig(logprob_chunk_size=...)`` from the module's
  ``loss_post_processor`` hook (chunked vocab-parallel logprobs);
* ``hf_ddp``    the ``transformers`` model under torch DDP (gloo) with the losses TRL / HF Trainer
  run: the model's own loss for NLL (``labels=``, ``ForCausalLMLoss``, summed with
  ``num_items_in_batch=1``), ``log_softmax`` over the full vocabulary + ``gather`` for
  ClippedPG;
* ``bare``      the bare megatron loop: megatron DDP + megatron Adam + ``run_global_batch``;
* ``trainer_recompute`` / ``hf_ddp_recompute``: ``trainer`` / ``hf_ddp`` with full activation
  recompute of every layer (megatron ``recompute_granularity="full"``, transformers
  ``activation_checkpointing_enable()``); not in the default set.
* ``trainer_fused``: ``trainer`` with
  ``MCoreRLStrategy(logprobs=LogprobKernelConfig(use_fused_linear_logprobs=True))``: the last
  stage returns its final hidden states and the logprobs come from hidden x output weight in fp32
  blocks (the ``[tokens, V]`` logits are never built).
* ``trainer_fused_fwd_grad``: ``trainer_fused`` with
  ``LogprobKernelConfig(fused_gradient_in_forward=True)``: both losses are token-local, so the
  head's gradients are computed in the forward and nothing is recomputed in the backward.
* ``trainer_fused_fwd_grad_zero``: ``trainer_fused_fwd_grad`` with megatron's distributed
  optimizer (``MegatronDDPConfig(use_distributed_optimizer=True)``: Adam state and main weights
  sharded over the DP ranks, ZeRO-1). Not the issue's comparison (the HF peer is plain DDP);
  it shows what the set-up memory is made of.
* ``trainer_fused_fwd_grad_noverify``: ``trainer_fused_fwd_grad`` with
  ``ReliabilityConfig(verify_updates=False)``: no update check, so no copy of the parameters and
  Adam state before megatron's update (what that reliability default costs).
* ``trainer_fused_bf16`` / ``trainer_fused_fwd_grad_bf16`` / ``trainer_fused_fwd_grad_zero_bf16``
  / ``trainer_fused_fwd_grad_noverify_bf16``
  / ``hf_ddp_bf16``: the same under bf16 on both sides:
  ``Trainer(precision="bf16-mixed")`` (bf16 weights in ``Float16Module``, fp32 main weights in
  megatron's optimizer) vs transformers' model in fp32 under ``torch.autocast(bfloat16)`` for the
  forward and the loss (what ``transformers.Trainer(bf16=True)`` runs: bf16 matmuls, fp32
  weights, gradients and Adam state, ``log_softmax``/``cross_entropy`` autocast to fp32).

Losses: ``NLLLossFn`` and ``ClippedPGLossFn`` (no reference KL; HF side written out by hand).
Each (stack, loss) pair runs in ``--ranks`` fresh processes started by ``torchrun --standalone
--nproc-per-node=<ranks>`` (one intra-op thread each), so ``ru_maxrss`` is that run's own peak.

Usage::

    .venv/bin/python benchmarks/peer_update_step.py                      # all stacks, both losses
    .venv/bin/python benchmarks/peer_update_step.py --stacks hf_ddp trainer_fused \
        hf_ddp_bf16 trainer_fused_bf16                                     # issue 26's rows
    python3 benchmarks/peer_update_step.py --device cuda --ranks 1 --stacks ...  # one GPU

On CUDA (``--device cuda``) each rank runs on GPU ``LOCAL_RANK`` under NCCL and the memory
columns are ``torch.cuda.max_memory_allocated`` (peak) and ``memory_allocated`` at setup
instead of the process RSS; ``bare`` is CPU only.

Prints a markdown table (median step time of the timed steps, slowest rank; tokens/s over the
global batch; the same in process CPU time, ``time.process_time`` of each rank's step, every
thread, the slowest rank's: what the ratios mean on a shared machine, where wall time swings with
the other load; peak RSS per rank, the larger of the two; step-0 loss) and the ratios to the HF
peer (``hf_ddp``; ``hf_ddp_recompute`` for the ``*_recompute`` rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

STACKS = (
    "trainer",
    "trainer_chunked",
    "hf_ddp",
    "bare",
    "trainer_recompute",
    "hf_ddp_recompute",
    "trainer_fused",
    "trainer_fused_bf16",
    "hf_ddp_bf16",
    "trainer_fused_fwd_grad",
    "trainer_fused_fwd_grad_bf16",
    "trainer_fused_fwd_grad_zero",
    "trainer_fused_fwd_grad_zero_bf16",
    "trainer_fused_fwd_grad_noverify",
    "trainer_fused_fwd_grad_noverify_bf16",
)
# full activation recompute of every layer on both sides (megatron ``recompute_granularity="full"``,
# transformers ``activation_checkpointing_enable()``): only with --stacks ... *_recompute
MEGATRON_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}
LOSSES = ("nll", "clipped_pg")
LR = 1e-5
ADAM_EPS = 1e-8
PROMPT_FRACTION = 8  # the first S/8 tokens of every row are "prompt" (token_mask 0)
PG_CFG = {
    "reference_policy_kl_penalty": 0.0,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
}


# ------------------------------------------------------------------------------ model and data


def build_hf_model(directory: Path, args: argparse.Namespace) -> None:
    """A random Llama (``save_pretrained`` safetensors, fp32)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.seq),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)


def global_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The global batch: ``2 * rows_per_rank`` full-length rows (rows ``[r*B, (r+1)*B)`` go to
    rank ``r``), token mask 0 on each row's prompt, per-sample advantages, and old/generation
    logprobs near a uniform policy's."""
    g = torch.Generator().manual_seed(1234)
    rows, s, v = args.ranks * args.rows_per_rank, args.seq, args.vocab
    token_mask = torch.ones(rows, s)
    token_mask[:, : s // PROMPT_FRACTION] = 0.0
    near = -math.log(v)
    return {
        "input_ids": torch.randint(0, v, (rows, s), generator=g),
        "input_lengths": torch.full((rows,), s, dtype=torch.long),
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, s).contiguous(),
        "prev_logprobs": near + 0.1 * torch.randn(rows, s, generator=g),
        "generation_logprobs": near + 0.1 * torch.randn(rows, s, generator=g),
    }


def rank_batch(args: argparse.Namespace, rank: int) -> dict[str, torch.Tensor]:
    b = args.rows_per_rank
    return {k: v[rank * b : (rank + 1) * b] for k, v in global_batch(args).items()}


def make_loss_fn(loss: str) -> Any:
    from lightning_mcore_rl.losses import ClippedPGLossFn, NLLLossFn

    return NLLLossFn() if loss == "nll" else ClippedPGLossFn(PG_CFG)


# ------------------------------------------------------------------------------ the stacks


def _peak_rss_mib() -> float:
    """This process's peak RSS so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _setup_mib(device: str) -> float:
    """What the built model + optimizer hold: peak RSS so far (CPU), allocated memory (CUDA)."""
    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**20
    return _peak_rss_mib()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Profile:
    """With ``--profile DIR``: torch.profiler (CPU, memory) around the LAST step on rank 0;
    ``DIR/<stack>_<loss>.txt`` gets the ops with the largest self memory and self CPU time."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.prof: Any = None
        self.on = bool(args.profile) and os.environ.get("RANK") == "0"

    def start(self, step: int) -> None:
        if self.on and step == self.args.warmup + self.args.steps - 1:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        table = self.prof.key_averages()
        text = [
            table.table(sort_by="self_cpu_memory_usage", row_limit=25),
            table.table(sort_by="self_cpu_time_total", row_limit=25),
        ]
        out = Path(self.args.profile) / f"{self.args.worker}_{self.args.loss}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n\n".join(text))
        self.prof = None


def _slowest(wall: float, cpu: float, device: str) -> tuple[float, float]:
    """The largest wall and process CPU time of any rank (one MAX all-reduce)."""
    import torch.distributed as dist

    elapsed = torch.tensor([wall, cpu], dtype=torch.float64)
    if device == "cuda":
        elapsed = elapsed.cuda()  # NCCL reduces CUDA tensors only
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed[0]), float(elapsed[1])


def _timed_step(
    fn: Any, device: str, profile: Profile | None = None, step: int = 0
) -> tuple[float, float]:
    """Wall time and process CPU time (``time.process_time``: every thread of the rank, no time
    waited or descheduled) of ``fn()``, each the slowest rank's (barrier before, MAX after)."""
    import torch.distributed as dist

    dist.barrier()
    if profile is not None:
        profile.start(step)
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if profile is not None:
        profile.stop()
    return _slowest(wall, cpu, device)


def run_hf_ddp(
    args: argparse.Namespace, loss: str, rank: int, recompute: bool = False, bf16: bool = False
) -> dict[str, Any]:
    """transformers + torch DDP, the losses written as TRL / HF Trainer compute them; ``bf16``:
    the forward and the loss under ``torch.autocast(bfloat16)``, as ``Trainer(bf16=True)``."""
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    model = LlamaForCausalLM.from_pretrained(
        args.hf_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()
    if recompute:
        model.activation_checkpointing_enable({"use_reentrant": False})
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.0)
    batch = {k: v.to(device) for k, v in rank_batch(args, rank).items()}

    def autocast() -> Any:
        if not bf16:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    ids = batch["input_ids"]
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    n_global = mask.sum()
    dist.all_reduce(n_global)
    labels = ids[:, 1:].masked_fill(mask == 0, -100)
    losses: list[float] = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            if loss == "nll":  # transformers' own loss (ForCausalLMLoss), summed over tokens
                full = torch.full_like(ids, -100)  # [B, S]: the model shifts the labels itself
                full[:, 1:] = labels
                local = ddp(input_ids=ids, labels=full, num_items_in_batch=1).loss
            else:  # log_softmax autocasts to fp32
                logits = ddp(input_ids=ids).logits[:, :-1]  # [B, S-1, V]
                curr = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                ratio = torch.exp(curr - batch["prev_logprobs"][:, 1:])
                adv = batch["advantages"][:, 1:]
                clipped = ratio.clamp(1 - PG_CFG["ratio_clip_min"], 1 + PG_CFG["ratio_clip_max"])
                per_token = torch.maximum(-adv * ratio, -adv * clipped)
                local = (per_token * mask).sum()
        # DDP averages gradients over ranks: x world turns that into the global token mean's
        (local / n_global * world).backward()
        optimizer.step()
        value = local.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value / n_global))

    setup_rss = _setup_mib(args.device)
    profile = Profile(args)
    times = [_timed_step(step, args.device, profile, i) for i in range(args.warmup + args.steps)]
    return {
        "step_times": [wall for wall, _ in times],
        "cpu_times": [cpu for _, cpu in times],
        "losses": losses,
        "setup_rss_mib": setup_rss,
    }


def _bridge_module(
    args: argparse.Namespace, loss: str, chunk_size: int | None, recompute: bool
) -> Any:
    from lightning.pytorch import Callback

    from lightning_mcore_rl import MCoreRLModule
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.train import LossPostProcessor, PolicyConfig

    class LlamaModule(MCoreRLModule):
        def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
            bridge = HFBridge.from_pretrained(args.hf_dir)
            fields = {**bridge.config_fields(), **(MEGATRON_RECOMPUTE if recompute else {})}
            config = self.transformer_config(**fields)
            return bridge.build_chunk(config, vp_stage, groups=self.parallel_groups)

        def configure_optimizers(self) -> Any:
            from megatron.core.optimizer import OptimizerConfig

            return OptimizerConfig(optimizer="adam", lr=LR, adam_eps=ADAM_EPS, weight_decay=0.0)

        def loss_post_processor(self, num_microbatches: int | None = None) -> LossPostProcessor:
            if chunk_size is None:
                return super().loss_post_processor(num_microbatches)
            assert self.loss_fn is not None
            return LossPostProcessor(
                self.loss_fn,
                PolicyConfig(sequence_packing=False, logprob_chunk_size=chunk_size),
                num_microbatches,
                sampling_params=self.sampling_params(),
            )

    class StepTimer(Callback):
        """Wall and process CPU time from batch start to batch end (optimizer step and logging
        included), each the slowest rank's."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.losses: list[float] = []
            self.setup_rss = 0.0
            self.profile = Profile(args)

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.setup_rss = _setup_mib(args.device)  # model, DDP buffers and optimizer built

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            import torch.distributed as dist

            dist.barrier()
            self.profile.start(len(self.times))
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *_: Any) -> None:

            _sync(args.device)
            wall, cpu = time.perf_counter() - self.start, time.process_time() - self.cpu
            self.profile.stop()
            wall, cpu = _slowest(wall, cpu, args.device)
            self.times.append(wall)
            self.cpu_times.append(cpu)
            self.losses.append(float(outputs["loss"]))

    return LlamaModule(loss_fn=make_loss_fn(loss)), StepTimer()


def run_trainer(
    args: argparse.Namespace,
    loss: str,
    rank: int,
    chunk_size: int | None,
    recompute: bool = False,
    fused: bool = False,
    bf16: bool = False,
    fwd_grad: bool = False,
    zero: bool = False,
    verify: bool = True,
) -> dict[str, Any]:
    """``Trainer(strategy=MCoreRLStrategy())``, DP = ``--ranks``, one microbatch per rank;
    ``fused``: ``use_fused_linear_logprobs=True``; ``bf16``: ``precision="bf16-mixed"``;
    ``fwd_grad``: ``fused_gradient_in_forward=True``; ``zero``: megatron's distributed
    optimizer; ``verify``: ``ReliabilityConfig(verify_updates=...)``."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_mcore_rl import MCoreRLStrategy
    from lightning_mcore_rl.strategy import (
        LogprobKernelConfig,
        MegatronDDPConfig,
        MicrobatchConfig,
        ReliabilityConfig,
    )

    batch = rank_batch(args, rank)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(args.rows_per_rank)]
    steps = args.warmup + args.steps
    module, timer = _bridge_module(args, loss, chunk_size, recompute)
    trainer = Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=args.ranks,
        precision="bf16-mixed" if bf16 else "32-true",
        strategy=MCoreRLStrategy(
            microbatching=MicrobatchConfig(micro_batch_size=args.rows_per_rank),
            ddp=MegatronDDPConfig(use_distributed_optimizer=zero),
            reliability=ReliabilityConfig(verify_updates=verify),
            logprobs=LogprobKernelConfig(
                use_fused_linear_logprobs=fused, fused_gradient_in_forward=fwd_grad
            ),
        ),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # each rank reads exactly its rows of the global batch
        callbacks=[timer],
    )
    trainer.fit(module, DataLoader(rows * steps, batch_size=args.rows_per_rank))
    return {
        "step_times": timer.times,
        "cpu_times": timer.cpu_times,
        "losses": timer.losses,
        "setup_rss_mib": timer.setup_rss,
    }


def run_bare(args: argparse.Namespace, loss: str, rank: int) -> dict[str, Any]:
    """megatron DDP + megatron Adam + :func:`lightning_mcore_rl.train.run_global_batch` (CPU)."""
    import torch.distributed as dist
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from lightning_mcore_rl.cpu import cpu_emulation
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state
    from lightning_mcore_rl.train import (
        LossPostProcessor,
        Microbatching,
        PolicyConfig,
        StepContext,
        run_global_batch,
    )

    dist.init_process_group("gloo")
    with cpu_emulation():
        init_megatron_state(tensor_model_parallel_size=1)
        bridge = HFBridge.from_pretrained(args.hf_dir)
        config = bridge.transformer_config(calculate_per_token_loss=True)
        chunk = bridge.build_chunk(config, None)
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), chunk
        )
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=LR,
                adam_eps=ADAM_EPS,
                weight_decay=0.0,
                clip_grad=0.0,
            ),
            [model],
        )
        loss_fn = make_loss_fn(loss)
        batch = rank_batch(args, rank)
        context = StepContext(megatron_groups(), Microbatching(micro_batch_size=args.rows_per_rank))
        losses: list[float] = []

        def step() -> None:
            model.zero_grad_buffer()
            optimizer.zero_grad()
            out = run_global_batch(
                [model], batch, context, loss=LossPostProcessor(loss_fn, PolicyConfig()),
                normalizations=loss_fn.metric_normalizations,
            )  # fmt: skip
            optimizer.step()
            losses.append(float(out.loss))

        setup_rss = _peak_rss_mib()
        profile = Profile(args)
        times = [_timed_step(step, "cpu", profile, i) for i in range(args.warmup + args.steps)]
    return {
        "step_times": [wall for wall, _ in times],
        "cpu_times": [cpu for _, cpu in times],
        "losses": losses,
        "setup_rss_mib": setup_rss,
    }


def worker(args: argparse.Namespace) -> None:
    import psutil  # type: ignore[import-untyped]

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    base_rss = psutil.Process().memory_info().rss
    stack = args.worker
    if stack.startswith("hf_ddp"):
        result = run_hf_ddp(
            args, args.loss, rank, recompute=stack.endswith("_recompute"),
            bf16=stack.endswith("_bf16"),
        )  # fmt: skip
    elif stack == "bare":
        if args.device != "cpu":
            raise ValueError("the `bare` stack runs on CPU only (megatron's CPU emulation)")
        result = run_bare(args, args.loss, rank)
    else:
        chunk = args.chunk_size if stack == "trainer_chunked" else None
        result = run_trainer(
            args, args.loss, rank, chunk, recompute=stack == "trainer_recompute",
            fused=stack.startswith("trainer_fused"), bf16=stack.endswith("_bf16"),
            fwd_grad="_fwd_grad" in stack, zero="_zero" in stack,
            verify="_noverify" not in stack,
        )  # fmt: skip
    cuda = args.device == "cuda"
    record = {
        **result,
        "rank": rank,
        "peak_rss_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else _peak_rss_mib(),
        "start_rss_mib": 0.0 if cuda else base_rss / 2**20,
    }
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------------ driver


def launch(args: argparse.Namespace, stack: str, loss: str, out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.ranks}", __file__, f"--worker={stack}", f"--loss={loss}", f"--out={out}",
        f"--hf-dir={args.hf_dir}", f"--profile={args.profile or ''}", *forwarded(args),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{stack}/{loss} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]


def forwarded(args: argparse.Namespace) -> list[str]:
    keys = (
        "rows_per_rank",
        "seq",
        "vocab",
        "hidden",
        "ffn",
        "layers",
        "heads",
        "kv_heads",
    )
    keys += ("steps", "warmup", "chunk_size", "device", "ranks")  # type: ignore[assignment]
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]


def summarise(
    stack: str, loss: str, ranks: list[dict[str, Any]], tokens: int, warmup: int
) -> dict[str, Any]:
    timed = ranks[0]["step_times"][warmup:]
    step_s = statistics.median(timed)
    cpu_s = statistics.median(ranks[0]["cpu_times"][warmup:])
    return {
        "stack": stack,
        "loss": loss,
        "step_s": step_s,
        "min_step_s": min(timed),
        "all_step_s": ranks[0]["step_times"],
        "tokens_per_s": tokens / step_s,
        "cpu_step_s": cpu_s,
        "all_cpu_step_s": ranks[0]["cpu_times"],
        "tokens_per_cpu_s": tokens / cpu_s,
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "start_rss_mib": max(r["start_rss_mib"] for r in ranks),
        "setup_rss_mib": max(r["setup_rss_mib"] for r in ranks),
        "loss0": ranks[0]["losses"][0],
        "losses": ranks[0]["losses"],
    }


def step_mib(r: dict[str, Any]) -> float:
    """What the update step adds on top of the built model + optimizer (activations, logits,
    gradients, optimizer state created lazily at the first step)."""
    return float(r["peak_rss_mib"] - r["setup_rss_mib"])


def driver(args: argparse.Namespace) -> None:
    tokens = args.ranks * args.rows_per_rank * args.seq
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peer_bench_") as tmp:
        args.hf_dir = str(Path(tmp) / "llama")
        build_hf_model(Path(args.hf_dir), args)
        for loss in args.losses:
            for stack in args.stacks:
                ranks = launch(args, stack, loss, Path(tmp) / f"{stack}_{loss}")
                results.append(summarise(stack, loss, ranks, tokens, args.warmup))
                r = results[-1]
                print(
                    f"{stack:16s} {loss:10s} step {r['step_s']:.3f} s "
                    f"({', '.join(f'{t:.2f}' for t in r['all_step_s'])}), CPU "
                    f"{r['cpu_step_s']:.3f} s "
                    f"({', '.join(f'{t:.2f}' for t in r['all_cpu_step_s'])}), "
                    f"RSS start/setup/peak {r['start_rss_mib']:.0f}/{r['setup_rss_mib']:.0f}/"
                    f"{r['peak_rss_mib']:.0f} MiB, loss0 {r['loss0']:.8f}",
                    flush=True,
                )
    print()
    memory = "peak CUDA memory" if args.device == "cuda" else "peak RSS"
    print(
        f"Llama {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, heads "
        f"{args.heads}/{args.kv_heads}, vocab {args.vocab}; {args.rows_per_rank} x {args.seq} "
        f"tokens per rank, {args.ranks} ranks on {args.device}; median of {args.steps} timed "
        f"steps after {args.warmup} warm-up; memory = {memory} per rank; CPU = process CPU "
        "time of the step (time.process_time, the slowest rank's), tokens/CPU s and its vs HF "
        "ratio from it"
    )
    print()
    print(
        "| loss | stack | s/step (min) | tokens/s | vs HF | CPU s/step | tokens/CPU s | vs HF "
        "| peak RSS/rank MiB | vs HF | step peak - setup MiB | vs HF | step-0 loss | vs HF |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for loss in args.losses:
        rows = [r for r in results if r["loss"] == loss]
        for r in rows:
            peer = "hf_ddp" + next(
                (tail for tail in ("_recompute", "_bf16") if r["stack"].endswith(tail)), ""
            )
            ref = next((p for p in rows if p["stack"] == peer), rows[0])
            print(
                f"| {loss} | {r['stack']} | {r['step_s']:.2f} ({r['min_step_s']:.2f}) | "
                f"{r['tokens_per_s']:.0f} | "
                f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x | {r['cpu_step_s']:.2f} | "
                f"{r['tokens_per_cpu_s']:.0f} | "
                f"{r['tokens_per_cpu_s'] / ref['tokens_per_cpu_s']:.2f}x | "
                f"{r['peak_rss_mib']:.0f} | "
                f"{r['peak_rss_mib'] / ref['peak_rss_mib']:.2f}x | {step_mib(r):.0f} | "
                f"{step_mib(r) / step_mib(ref):.2f}x | {r['loss0']:.8f} | "
                f"{abs(r['loss0'] - ref['loss0']):.1e} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", nargs="+", default=list(STACKS[:4]), choices=STACKS)
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--rows-per-rank", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=128, help="logprob_chunk_size")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (DP size)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", help="torch.profiler tables of rank 0's last step, here")
    parser.add_argument("--worker", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--loss", choices=LOSSES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
