"""Rank workers of the draft-model tests: a 4-layer tiny GPT policy trained with ClippedPG through
``run_global_batch`` with an EAGLE draft reading decoder layers 2 and 3 (on the last stage under
PP=2), and a plain-torch reference of the draft's loss on the same captured hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.batches import prompted_batch

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.draft_model import eagle_draft
from lightning_mcore_rl.models.eagle3 import eagle3_draft
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state
from lightning_mcore_rl.testing.training import TrainingSetup, gather_full_tensors
from lightning_mcore_rl.train import LossPostProcessor, Microbatching, StepContext, run_global_batch

V, S, B, LAYERS = 64, 16, 4, 4
AUX = (2, 3)
LENGTHS = [16, 11, 7, 13]
PROMPT = 4
WEIGHT = 0.5  # draft.loss_weight
LR = 0.1  # SGD on the draft: an update that shows any gradient scale
PG_CFG = {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2}


@dataclass(frozen=True)
class DraftStep:
    """One step: its metrics, the policy's and the draft's full grads (canonical names; this
    rank's stage only), and the draft's weights after one SGD step (last stage only)."""

    loss: float
    metrics: dict[str, float]
    policy_grads: dict[str, torch.Tensor]
    draft_grads: dict[str, torch.Tensor]
    draft_updated: dict[str, torch.Tensor]


@dataclass(frozen=True)
class DraftReference:
    """Plain torch on the TP=1 model: draft loss, top-1 agreement, expected acceptance, grads."""

    loss: float
    agreement: float
    acceptance: float
    grads: dict[str, torch.Tensor]


def make_batch() -> BatchedDataDict:
    """Right-padded rows, a ``PROMPT``-token prompt, one sample masked out."""
    return prompted_batch(LENGTHS, S, V, PROMPT, seed=5)


def _policy_config(groups: Any = None, sequence_parallel: bool = False) -> Any:
    return tiny_gpt_config(
        groups, num_layers=LAYERS, calculate_per_token_loss=True,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip


def _full(tensor: torch.Tensor, param: torch.Tensor, groups: Any) -> torch.Tensor:
    """A TP shard all-gathered along its partition dim (replicated tensors unchanged)."""
    if not getattr(param, "tensor_model_parallel", False) or groups.tp_size == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(groups.tp_size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=groups.tp_group)
    return torch.cat(parts, dim=param.partition_dim)


def draft_step(
    *,
    draft: bool,
    packed: bool = False,
    mbs: int = B,
    defer: bool = False,
    sp: bool = False,
    eagle3: bool = False,
) -> DraftStep:
    """One training step of this rank's layout (megatron state initialised by the caller)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    groups = megatron_groups()
    config = _policy_config(groups, sequence_parallel=sp)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    policy = tiny_gpt(config, groups=groups, vocab_size=V, max_sequence_length=S)
    chunk = DistributedDataParallel(config, ddp_config, policy)
    config.finalize_model_grads_func = finalize_model_grads
    draft_ddp = None
    if draft and groups.is_pipeline_last_stage:
        build = eagle3_draft if eagle3 else eagle_draft
        model = build(config, vocab_size=V, aux_layers=AUX, groups=groups, seed=1)
        draft_ddp = DistributedDataParallel(model.config, ddp_config, model)
    context = StepContext(
        groups=groups,
        microbatching=Microbatching(
            mbs, sequence_packing=packed, equal_shapes=groups.pp_size > 1, sequence_parallel=sp
        ),
        draft_model=draft_ddp,
        train_draft=draft,
    )
    loss_fn = ClippedPGLossFn(PG_CFG)
    cfg = {"sequence_packing": {"enabled": packed}, "draft": {"loss_weight": WEIGHT}}
    post = LossPostProcessor(loss_fn, cfg, defer_draft_normalization=defer)
    out = run_global_batch(
        [chunk], make_batch(), context, loss=post, normalizations=loss_fn.metric_normalizations
    )
    policy_grads = gather_full_tensors(TrainingSetup([chunk], None, config), grads=True)
    draft_grads, updated = {}, {}
    if draft_ddp is not None:
        for name, param in draft_ddp.module.named_parameters():
            grad = _full(param.main_grad, param, groups)
            draft_grads[name] = grad
            updated[name] = _full(param, param, groups) - LR * grad
    metrics = {k: float(v) for k, v in out.metrics.items()}
    return DraftStep(float(out.loss), metrics, policy_grads, draft_grads, updated)


def _layer_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def draft_reference() -> DraftReference:
    """The draft term by hand on the single-rank models.

    The policy runs once (megatron's GPT) with forward hooks recording decoder layers 2 and 3
    (the captured hidden states, detached) and its logits ``z``. The draft then, in plain torch
    except for its one megatron transformer layer: ``f = [h2; h3] W_fc^T``, ``x = [LN_e(E[y_{t+1}]);
    LN_h(f)] W_eh^T``, ``s = LN_f(layer(x)) W_head^T``. Loss: ``sum_t m_t H(softmax(z_{t+1}),
    softmax(s_t)) / N_t`` with ``m_t = token_mask[t+1] * sample_mask`` and ``N_t`` the policy
    loss's count ``sum(token_mask[:, 1:] * sample_mask)``; agreement the same mean of
    ``[argmax s_t = argmax z_{t+1}]``, expected acceptance of ``sum_v min(softmax(z_{t+1}),
    softmax(s_t))_v``.
    """
    policy = tiny_gpt(_policy_config(), vocab_size=V, max_sequence_length=S)
    draft: Any = eagle_draft(_policy_config(), vocab_size=V, aux_layers=AUX, seed=1)
    data = make_batch()
    ids, token_mask, sample_mask = data["input_ids"], data["token_mask"], data["sample_mask"]
    captured: dict[int, torch.Tensor] = {}
    for index in AUX:
        policy.decoder.layers[index].register_forward_hook(
            lambda m, a, out, i=index: captured.__setitem__(i, out[0].detach())
        )
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        z = policy(ids, torch.arange(S).expand(B, -1), mask)  # [B, S, V]
    hidden = torch.cat([captured[i] for i in AUX], -1)  # [S, B, 2H]
    next_ids = F.pad(ids[:, 1:], (0, 1))
    embeds = draft.embed_tokens.weight[next_ids].transpose(0, 1)  # [S, B, H]
    f = hidden @ draft.fc.weight.T
    x = torch.cat([_layer_norm(embeds, draft.enorm), _layer_norm(f, draft.hnorm)], -1)
    x, _ = draft.layer(hidden_states=x @ draft.eh_proj.weight.T, attention_mask=mask)
    s = (_layer_norm(x, draft.final_layernorm) @ draft.lm_head.weight.T).transpose(0, 1)
    teacher = F.pad(z[:, 1:], (0, 0, 0, 1))  # z_{t+1}; nothing past the row
    m = F.pad(token_mask[:, 1:], (0, 1)) * sample_mask[:, None]
    n_t = (token_mask[:, 1:] * sample_mask[:, None]).sum()
    ce = -(teacher.softmax(-1) * s.log_softmax(-1)).sum(-1)  # [B, S]
    loss = (ce * m).sum() / n_t
    agreement = ((s.argmax(-1) == teacher.argmax(-1)).float() * m).sum() / n_t
    overlap = torch.minimum(teacher.softmax(-1), s.detach().softmax(-1)).sum(-1)  # [B, S]
    acceptance = (overlap * m).sum() / n_t
    (WEIGHT * loss).backward()
    grads = {n: p.grad.detach().clone() for n, p in draft.named_parameters()}
    return DraftReference(float(loss), float(agreement), float(acceptance), grads)


def single_rank_run(rank: int) -> dict[str, Any]:
    """TP=1: the reference; draft off and on; two microbatches; packed; deferred."""
    init_megatron_state()
    return {
        "reference": draft_reference(),
        "off": draft_step(draft=False),
        "on": draft_step(draft=True),
        "on_M2": draft_step(draft=True, mbs=2),
        "packed_M2": draft_step(draft=True, packed=True, mbs=2),
        "deferred_M2": draft_step(draft=True, mbs=2, defer=True),
        "packed_off": draft_step(draft=False, packed=True, mbs=2),
    }


def two_rank_run(rank: int) -> dict[str, Any]:
    """TP=2 (padded, packed, with sequence parallelism) and PP=2 (two microbatches, the draft on
    the last stage)."""
    init_megatron_state(tensor_model_parallel_size=2)
    out = {
        "tp2": draft_step(draft=True),
        "tp2_packed": draft_step(draft=True, packed=True, mbs=2),
        "tp2_sp": draft_step(draft=True, sp=True),
        "tp2_sp_packed": draft_step(draft=True, packed=True, mbs=2, sp=True),
    }
    destroy_megatron_state()
    init_megatron_state(pipeline_model_parallel_size=2)
    out["pp2"] = draft_step(draft=True, mbs=2)
    out["pp2_off"] = draft_step(draft=False, mbs=2)
    return out
