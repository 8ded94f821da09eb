"""Rank workers for the training-step invariance tests: the tiny GPT through Megatron's schedule.

One spawned run covers several layouts (the megatron state is rebuilt for each), so the suite
pays the process start-up a few times only. Every layout trains on the same global batch; results
are the global loss (sum over microbatches and DP of the per-microbatch ``loss`` metric) and the
TP-gathered parameter gradients keyed by canonical name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossFn, DPOLossFn
from lightning_mcore_rl.models.layers import get_packed_local_layer_spec
from lightning_mcore_rl.models.tiny_gpt import canonical_name, tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.testing.training import TrainingSetup, gather_full_tensors
from lightning_mcore_rl.train import (
    LogprobsPostProcessor,
    LossPostProcessor,
    TopkLogitsPostProcessor,
    aggregate_training_statistics,
    megatron_forward_backward,
    process_global_batch,
)

V, S, B = 128, 16, 4
LENGTHS = [16, 11, 7, 13]
PROMPT = 3
PG_CFG = {"reference_policy_kl_penalty": 0.01, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2}
DPO_CFG = {"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.5}


@dataclass(frozen=True)
class StepResult:
    """One training step: the global loss (on the reporting rank of the last stage, else
    ``None``), the TP-gathered grads (reporting ranks only, else empty) and the microbatch count."""

    loss: float | None
    grads: dict[str, torch.Tensor]
    num_microbatches: int


@dataclass(frozen=True)
class HandReference:
    """Plain torch on the TP=1 model: ClippedPG loss and grads, logprobs at T=0.7, top-5 logits."""

    loss: float
    grads: dict[str, torch.Tensor]
    logprobs_t07: torch.Tensor
    topk_logits: torch.Tensor
    topk_indices: torch.Tensor


def make_batch(seed: int = 0) -> BatchedDataDict:
    """``B=4`` right-padded sequences of lengths ``LENGTHS`` with GRPO/DPO fields ``[B, S]``."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(S)[None, :]
    lengths = torch.tensor(LENGTHS)
    real = positions < lengths[:, None]
    ids = torch.randint(1, V, (B, S), generator=g) * real
    token_mask = (real & (positions >= PROMPT)).float()

    def near_uniform() -> torch.Tensor:  # ratios near 1: some clipped, some not
        return -torch.log(torch.tensor(float(V))) + 0.15 * torch.randn(B, S, generator=g)

    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, S, generator=g),
        prev_logprobs=near_uniform(),
        generation_logprobs=near_uniform(),
        reference_policy_logprobs=near_uniform(),
    )


def loss_fn_for(name: str) -> Any:
    """The loss under test: token-level ClippedPG or sequence-level DPO (+ SFT term)."""
    return ClippedPGLossFn(PG_CFG) if name == "pg" else DPOLossFn(DPO_CFG)


def build_setup(seed: int = 0) -> TrainingSetup:
    """Tiny GPT with the CPU packed-attention spec in Megatron DDP (sum over DP, no optimizer)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    groups = megatron_groups()
    config = tiny_gpt_config(groups, calculate_per_token_loss=True)
    model = tiny_gpt(config, groups=groups, vocab_size=V, seed=seed, transformer_layer_spec=spec())
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    config.finalize_model_grads_func = finalize_model_grads
    return TrainingSetup(chunks=[ddp], optimizer=None, config=config)


def spec() -> Any:
    """Layer spec with the packed-capable local attention (also used for padded batches)."""
    return get_packed_local_layer_spec()


def local_share(batch: BatchedDataDict) -> BatchedDataDict:
    """This DP rank's contiguous share of the global batch."""
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = batch.size // dp
    return batch.slice(rank * per, (rank + 1) * per)


def train_step(setup: TrainingSetup, loss: str, mbs: int, packed: bool = False,
               fuse: bool = False) -> StepResult:  # fmt: skip
    """One forward-backward; global loss from the per-microbatch metrics, gathered grads."""
    for chunk in setup.chunks:
        chunk.zero_grad_buffer()
    dp_group = ps.get_data_parallel_group()
    batch = process_global_batch(local_share(make_batch()), dp_group, mbs, sequence_packing=packed)
    cfg = {"sequence_packing": {"enabled": packed, "fuse_loss": fuse}}
    post = LossPostProcessor(loss_fn_for(loss), cfg, num_microbatches=batch.num_microbatches)
    metrics = megatron_forward_backward(
        setup.chunks[0], batch.iterator(), batch.num_microbatches, batch.seq_length,
        batch.micro_batch_size, post, global_valid_seqs=batch.global_valid_seqs,
        global_valid_toks=batch.global_valid_toks, groups=megatron_groups(),
    )  # fmt: skip
    local = sum(float(m["loss"]) for m in metrics)
    _, global_loss = aggregate_training_statistics(metrics, [local], dp_group)
    reporter = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    last = ps.is_pipeline_last_stage()
    grads = gather_full_tensors(setup, grads=True)
    return StepResult(
        loss=float(global_loss[0]) if last and reporter else None,
        grads=grads if reporter else {},
        num_microbatches=batch.num_microbatches,
    )


def _forward_only(setup: TrainingSetup, post: Any, packed: bool, temperature: float) -> Any:
    batch = process_global_batch(make_batch(), ps.get_data_parallel_group(), B,
                                 sequence_packing=packed)  # fmt: skip
    return megatron_forward_backward(
        setup.chunks[0], batch.iterator(), batch.num_microbatches, batch.seq_length,
        batch.micro_batch_size, post, forward_only=True,
        sampling_params=TrainingSamplingParams(temperature=temperature), groups=megatron_groups(),
    )  # fmt: skip


def forward_only_outputs(setup: TrainingSetup) -> dict[str, torch.Tensor]:
    """Logprobs (padded/packed, T=0.7) and top-5 logits through the post-processors."""
    out = {}
    for packed in (False, True):
        cfg = {"sequence_packing": {"enabled": packed}}
        result = _forward_only(setup, LogprobsPostProcessor(cfg), packed, 0.7)
        out[f"logprobs_packed={packed}"] = result[0]["logprobs"]
        result = _forward_only(setup, TopkLogitsPostProcessor(cfg, 5), packed, 1.0)
        out[f"topk_logits_packed={packed}"] = result[0]["topk_logits"]
        out[f"topk_indices_packed={packed}"] = result[0]["topk_indices"]
    return out


def hand_reference() -> HandReference:
    """Plain torch on the TP=1 model: logits, logprobs, and the ClippedPG loss + grads by hand.

    ``r = exp(c - p)``, ``L = sum m max(-A r, -A clip(r, 0.8, 1.2)) / N_t
    + beta sum m w k3 / N_t`` with ``k3 = exp(ref - c) - (ref - c) - 1`` (clamps inactive:
    |ref - c| << 20) and ``w = exp(c - c.detach())``: value 1, but it adds the score-function
    gradient ``beta k3 dc`` (docs/behaviour-reference.md §4.2: d penalty / dc = beta w (k3 + 1 - e^r) / N_t).
    """
    config = tiny_gpt_config(calculate_per_token_loss=True)
    model = tiny_gpt(config, vocab_size=V, seed=0, transformer_layer_spec=spec())
    data = make_batch()
    ids = data["input_ids"]
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    logits = model(ids, torch.arange(S).expand(B, -1), mask)  # [B, S, V]
    c = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    n_t = m.sum()
    adv, prev = data["advantages"][:, 1:], data["prev_logprobs"][:, 1:]
    ratio = torch.exp(c - prev)
    clip = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    log_r = data["reference_policy_logprobs"][:, 1:] - c
    k3 = (torch.exp(log_r) - log_r - 1) * torch.exp(c - c.detach())
    loss = (clip * m).sum() / n_t + PG_CFG["reference_policy_kl_penalty"] * (k3 * m).sum() / n_t
    loss.backward()
    grads = {canonical_name(model, n): p.grad.detach().clone() for n, p in model.named_parameters()}
    logits = logits.detach()
    scaled = F.log_softmax(logits / 0.7, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    top = logits.topk(5, dim=-1)
    return HandReference(
        loss=float(loss),
        grads=grads,
        logprobs_t07=F.pad(scaled, (1, 0)),
        topk_logits=top.values,
        topk_indices=top.indices,
    )


def single_rank_run(rank: int) -> dict[str, Any]:
    """1 rank: reference (M=1), M=2, M=4, packed per-sequence and fused, DPO, hand reference."""
    init_megatron_state()
    setup = build_setup()
    out: dict[str, Any] = {
        "pg_M1": train_step(setup, "pg", mbs=4),
        "pg_M2": train_step(setup, "pg", mbs=2),
        "pg_M4": train_step(setup, "pg", mbs=1),
        "pg_packed_M2": train_step(setup, "pg", mbs=2, packed=True),
        "pg_packed_fused_M2": train_step(setup, "pg", mbs=2, packed=True, fuse=True),
        "dpo_M1": train_step(setup, "dpo", mbs=4),
        "dpo_M2": train_step(setup, "dpo", mbs=2),
        "dpo_packed_fused_M2": train_step(setup, "dpo", mbs=2, packed=True, fuse=True),
        "forward_only": forward_only_outputs(setup),
    }
    out["hand"] = hand_reference()
    return out


def two_rank_run(rank: int) -> dict[str, Any]:
    """2 ranks: TP=2 (padded, packed, forward-only), PP=2 (1F1B, 4 microbatches), DP=2."""
    out: dict[str, Any] = {}
    init_megatron_state(tensor_model_parallel_size=2)
    setup = build_setup()
    out["tp2_pg_M2"] = train_step(setup, "pg", mbs=2)
    out["tp2_pg_packed_M2"] = train_step(setup, "pg", mbs=2, packed=True)
    out["tp2_dpo_M2"] = train_step(setup, "dpo", mbs=2)
    out["tp2_forward_only"] = forward_only_outputs(setup)
    init_megatron_state(pipeline_model_parallel_size=2)
    setup = build_setup()
    out["pp2_pg_M4"] = train_step(setup, "pg", mbs=1)
    out["pp2_dpo_M2"] = train_step(setup, "dpo", mbs=2)
    init_megatron_state()
    setup = build_setup()
    out["dp2_pg_M1"] = train_step(setup, "pg", mbs=2)
    out["dp2_pg_M2"] = train_step(setup, "pg", mbs=1)
    out["dp2_pg_packed_M1"] = train_step(setup, "pg", mbs=2, packed=True)
    out["dp2_dpo_M1"] = train_step(setup, "dpo", mbs=2)
    return out
