"""Rank worker for the context-parallel post-processor checks (synthetic logits, CP=2).

Megatron's local attention cannot run context parallelism on CPU, so the model is replaced by
synthetic full logits ``z [B, S, V]``: each CP rank takes its zigzag shard (dense) or its per-span
zigzag shard of the packed row, runs the post-processor's returned function, and back-propagates
what Megatron's schedule would (``R * CP / M``). Everything is compared with a single-process
reference on the full logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from lightning_mcore_rl.data import BatchedDataDict, cp_local_indices, pack_sequences
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.ops import get_tokens_on_this_cp_rank
from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.train import (
    LogprobsPostProcessor,
    LossPostProcessor,
    TeacherFullPayloadPostProcessor,
    TopkLogitsPostProcessor,
    aggregate_training_statistics,
)

B, S, V, CP, M = 2, 8, 16, 2, 3
LENGTHS = [7, 5]
PG_CFG = {"reference_policy_kl_penalty": 0.05}


def make_data() -> tuple[torch.Tensor, BatchedDataDict]:
    """Full logits ``[B, S, V]`` and a GRPO batch with ragged lengths."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(B, S, V, generator=g)
    real = torch.arange(S)[None, :] < torch.tensor(LENGTHS)[:, None]
    near = lambda: -torch.log(torch.tensor(float(V))) + 0.2 * torch.randn(B, S, generator=g)  # noqa: E731
    data = BatchedDataDict(
        input_ids=torch.randint(0, V, (B, S), generator=g) * real,
        input_lengths=torch.tensor(LENGTHS),
        token_mask=(real & (torch.arange(S)[None, :] >= 1)).float(),
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, S, generator=g),
        prev_logprobs=near(),
        generation_logprobs=near(),
        reference_policy_logprobs=near(),
    )
    return z, data


def reference(z: torch.Tensor, data: BatchedDataDict) -> dict[str, torch.Tensor]:
    """Single-process loss and ``dL/dz`` on the full logits (plain log_softmax + gather)."""
    z = z.clone().requires_grad_(True)
    ids = data["input_ids"]
    lp = F.log_softmax(z[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    gvs, gvt = counts(data)
    loss, _ = ClippedPGLossFn(PG_CFG)(BatchedDataDict(data), gvs, gvt, next_token_logprobs=lp)
    loss.backward()
    return {"loss": loss.detach(), "grad": z.grad, "logprobs": F.pad(lp.detach(), (1, 0))}


def counts(data: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Global valid (seqs, toks) of the one-batch global batch."""
    return data["sample_mask"].sum(), (
        data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    ).sum()


def packed_layout(z: torch.Tensor, data: BatchedDataDict, cp_rank: int) -> dict[str, Any]:
    """The packed row of ``z`` (spans padded to 2*CP) and this CP rank's per-span shard."""
    packed = pack_sequences(data["input_ids"], data["input_lengths"], pad_individual=2 * CP,
                            cp_rank=cp_rank, cp_size=CP)  # fmt: skip
    cu = packed.cu_seqlens_padded.tolist()
    full = torch.randn(1, cu[-1], V, generator=torch.Generator().manual_seed(1))  # pad garbage
    for i, n in enumerate(LENGTHS):
        full[0, cu[i] : cu[i] + n] = z[i, :n]
    index = cp_local_indices(packed.cu_seqlens_padded, cp_rank, CP)
    return {"packed": packed, "cu": cu, "full": full, "index": index}


@dataclass(frozen=True)
class LossCheck:
    """A loss post-processor on local logits: its result, its ``loss`` metric, ``dR/dlogits``."""

    result: torch.Tensor
    loss_metric: torch.Tensor
    grad: torch.Tensor


def _run_loss(logits_local: torch.Tensor, post: LossPostProcessor, data: BatchedDataDict,
              packed_seq_params: Any) -> LossCheck:  # fmt: skip
    leaf = logits_local.clone().requires_grad_(True)
    gvs, gvt = counts(data)
    bound = post(BatchedDataDict(data), packed_seq_params, gvs, gvt, groups=megatron_groups())
    result, metrics = bound(leaf)
    # Megatron's schedule back-propagates result * CP / M (forward_step_calc_loss, 2-tuple path)
    (result * CP / M).backward()
    return LossCheck(result.detach(), metrics["loss"], leaf.grad)


def cp_run(rank: int) -> dict[str, Any]:
    """All CP=2 checks of one rank; returns local results plus the references to compare."""
    init_megatron_state(context_parallel_size=CP)
    cp_rank = ps.get_context_parallel_rank()
    z, data = make_data()
    ref = reference(z, data)
    out: dict[str, Any] = {"cp_rank": cp_rank, "ref": ref}
    dense_local = get_tokens_on_this_cp_rank(z, cp_rank, CP, seq_dim=1)
    out["expected_dense_grad"] = get_tokens_on_this_cp_rank(ref["grad"], cp_rank, CP, seq_dim=1)
    for cp_normalize in (True, False):
        post = LossPostProcessor(ClippedPGLossFn(PG_CFG), None, M, cp_normalize=cp_normalize)
        out[f"dense_cp_normalize={cp_normalize}"] = _run_loss(dense_local, post, data, None)
    layout = packed_layout(z, data, cp_rank)
    grad_full = torch.zeros_like(layout["full"])
    for i, n in enumerate(LENGTHS):
        grad_full[0, layout["cu"][i] : layout["cu"][i] + n] = ref["grad"][i, :n]
    out["expected_packed_grad"] = grad_full[:, layout["index"]]
    packed_local = layout["full"][:, layout["index"]]
    for fuse in (False, True):
        cfg = {"sequence_packing": {"enabled": True, "fuse_loss": fuse}}
        post = LossPostProcessor(ClippedPGLossFn(PG_CFG), cfg, M)
        params = layout["packed"].packed_seq_params
        out[f"packed_fuse={fuse}"] = _run_loss(packed_local, post, data, params)
    packing = {"sequence_packing": {"enabled": True}}
    ids, cu = layout["packed"].packed_full, layout["packed"].cu_seqlens_padded
    g = megatron_groups()
    logprobs = LogprobsPostProcessor(packing)(data, ids, cu, S, groups=g)
    out["logprobs_packed"] = logprobs(packed_local)[1]
    out["topk_packed"] = TopkLogitsPostProcessor(packing, 3)(data, cu, S, groups=g)(packed_local)[1]
    payload = TeacherFullPayloadPostProcessor(packing, "logits", torch.float64)
    out["payload_packed"] = payload(data, ids, cu, S, groups=g)(packed_local)[1]
    out["errors"] = _cp_without_packing_errors(data, dense_local)
    out["stats"] = _stats_check(rank)
    return out


def _cp_without_packing_errors(data: BatchedDataDict, dense_local: torch.Tensor) -> list[str]:
    messages = []
    g = megatron_groups()
    payload = TeacherFullPayloadPostProcessor(None, "logits", torch.float32)
    for fn in (
        LogprobsPostProcessor(None)(data, data["input_ids"], None, S, groups=g),
        TopkLogitsPostProcessor(None, 2)(data, None, S, groups=g),
        payload(data, data["input_ids"], None, S, groups=g),
    ):
        try:
            fn(dense_local)
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def _stats_check(rank: int) -> dict[str, Any]:
    """aggregate_training_statistics over the 2-rank world as the DP group: count collectives."""
    calls: list[dict[str, Any]] = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(*args, **kwargs)

    metrics = [{"loss": torch.tensor(0.5 + rank), "lr": 1e-4}, {"loss": torch.tensor(0.25), "x": 1}]
    dist.all_reduce = counting
    try:
        mb_metrics, global_loss = aggregate_training_statistics(
            metrics, [torch.tensor(0.5 + rank), 0.25], dist.group.WORLD
        )
    finally:
        dist.all_reduce = original
    return {
        "ops": [str(c.get("op")) for c in calls],
        "group_is_world": [c.get("group") is dist.group.WORLD for c in calls],
        "mb_metrics": mb_metrics,
        "global_loss": global_loss,
    }
