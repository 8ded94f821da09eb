"""Rank workers of the multi-token-prediction tests: the tiny GPT with ``mtp_num_layers=2`` through
``run_global_batch`` (megatron's schedule, DDP, the ClippedPG loss), and a plain-torch reference of
its MTP loss on the same weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from helpers.batches import prompted_batch

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.tiny_gpt import canonical_name, tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.testing.training import TrainingSetup, gather_full_tensors
from lightning_mcore_rl.train import LossPostProcessor, Microbatching, StepContext, run_global_batch

V, S, B = 128, 16, 4
LENGTHS = [16, 11, 7, 13]
PROMPT = 4
DEPTHS = 2
SCALE = 0.3  # mtp_loss_scaling_factor
PG_CFG = {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2}


@dataclass(frozen=True)
class MTPStep:
    """One step: its metrics and the TP-gathered grads (keyed by canonical name)."""

    metrics: dict[str, float]
    loss: float
    grads: dict[str, torch.Tensor]


@dataclass(frozen=True)
class MTPReference:
    """Plain torch: ``L_d`` per depth and the grads of ``SCALE / D * sum_d L_d`` on ``mtp.*``."""

    terms: list[float]
    grads: dict[str, torch.Tensor]


def make_batch() -> BatchedDataDict:
    """Right-padded rows, a ``PROMPT``-token prompt, one sample masked out."""
    return prompted_batch(LENGTHS, S, V, PROMPT, seed=3)


def _model(groups: Any = None, rope: bool = False) -> torch.nn.Module:
    config = tiny_gpt_config(
        groups, calculate_per_token_loss=True, mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=SCALE,
    )  # fmt: skip
    position = "rope" if rope else "learned_absolute"
    return tiny_gpt(
        config, groups=groups, vocab_size=V, max_sequence_length=S,
        position_embedding_type=position,
    )  # fmt: skip


def mtp_step(packed: bool, mbs: int, rope: bool = False) -> MTPStep:
    """One training step of this rank's layout (megatron state initialised by the caller)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    groups = megatron_groups()
    model = _model(groups, rope)
    config = model.config
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    config.finalize_model_grads_func = finalize_model_grads
    loss_fn = ClippedPGLossFn(PG_CFG)
    context = StepContext(
        groups=groups,
        microbatching=Microbatching(
            micro_batch_size=mbs, sequence_packing=packed, equal_shapes=groups.pp_size > 1
        ),
    )
    post = LossPostProcessor(loss_fn, {"sequence_packing": {"enabled": packed}})
    out = run_global_batch(
        [ddp], make_batch(), context, loss=post, normalizations=loss_fn.metric_normalizations
    )
    grads = gather_full_tensors(TrainingSetup([ddp], None, config), grads=True)
    return MTPStep({k: float(v) for k, v in out.metrics.items()}, float(out.loss), grads)


def _layer_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def _left(x: torch.Tensor, steps: int = 1) -> torch.Tensor:
    """``[B, S]`` shifted left by ``steps``, zero-filled (a token past the row scores nothing)."""
    return F.pad(x[:, steps:], (0, steps))


def mtp_reference() -> MTPReference:
    """The MTP term by hand on the single-rank model (megatron's modules only for the decoder
    and each depth's transformer layer, which the policy tests already cover).

    Depth ``d`` at position ``t``: ``x = eh_proj [enorm(emb(ids[t+d+1], pos[t+d+1])) ;
    hnorm(h_{d-1}[t])]``, ``h_d = final_norm(layer(x))``, ``CE(h_d W_out^T, ids[t+d+2])``
    weighted by ``m[t+d+2] / N_t`` with ``m = token_mask * sample_mask`` and ``N_t`` the policy
    loss's count ``sum(token_mask[:, 1:] * sample_mask)``; ids and positions past the row are 0,
    as megatron's roll fills them.
    """
    model: Any = _model()
    data = make_batch()
    ids, m = data["input_ids"], data["token_mask"] * data["sample_mask"][:, None]
    n_t = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    pos = torch.arange(S).expand(B, -1)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    emb = model.embedding(input_ids=ids, position_ids=pos)  # [S, B, H]
    hidden = model.decoder(hidden_states=emb, attention_mask=mask).detach()  # [S, B, H]
    w_word = model.embedding.word_embeddings.weight
    w_pos = model.embedding.position_embeddings.weight
    terms = []
    for d, layer in enumerate(model.mtp.layers):
        e = (w_word[_left(ids, d + 1)] + w_pos[_left(pos, d + 1)]).transpose(0, 1)  # [S, B, H]
        x = torch.cat([_layer_norm(e, layer.enorm), _layer_norm(hidden, layer.hnorm)], -1)
        x = x @ layer.eh_proj.weight.T
        x, _ = layer.transformer_layer(hidden_states=x, attention_mask=mask)
        hidden = _layer_norm(x, layer.final_layernorm)  # [S, B, H]
        logits = hidden.transpose(0, 1) @ model.output_layer.weight.T  # [B, S, V]
        ce = F.cross_entropy(logits.reshape(-1, V), _left(ids, d + 2).reshape(-1),
                             reduction="none").view(B, S)  # fmt: skip
        terms.append((ce * _left(m, d + 2)).sum() / n_t)
    (SCALE / DEPTHS * torch.stack(terms).sum()).backward()
    grads = {
        canonical_name(model, n): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if n.startswith("mtp.")
    }
    return MTPReference([float(t) for t in terms], grads)


def decoding() -> dict[str, Any]:
    """KV-cache and full-prefix sampling from the MTP model and from the same tiny GPT without
    MTP layers (same seed: the same decoder and head weights), same generator seed."""
    from lightning_mcore_rl.rollout.sampler import generate

    prompts = make_batch()["input_ids"][:, :PROMPT]
    out = {}
    for name, model in (
        ("mtp", _model()),
        ("plain", tiny_gpt(vocab_size=V, max_sequence_length=S)),
    ):
        model.eval()
        for kv in (True, False):
            gen = generate(model, prompts, max_new_tokens=6, kv_cache=kv,
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
            out[f"{name}_kv={kv}"] = gen.logprobs
    return out


def single_rank_run(rank: int) -> dict[str, Any]:
    """TP=1: the reference, then padded (one and two microbatches) and packed steps."""
    init_megatron_state()
    return {
        "decoding": decoding(),
        "reference": mtp_reference(),
        "padded_M1": mtp_step(packed=False, mbs=B),
        "padded_M2": mtp_step(packed=False, mbs=2),
        "packed_M2": mtp_step(packed=True, mbs=2),
        "rope_M1": mtp_step(packed=False, mbs=B, rope=True),
    }


def tensor_parallel_run(rank: int) -> dict[str, Any]:
    """TP=2: padded and packed steps; then PP=2 with rope (learned positions are refused)."""
    from lightning_mcore_rl.testing import destroy_megatron_state

    init_megatron_state(tensor_model_parallel_size=2)
    out: dict[str, Any] = {
        "padded_M2": mtp_step(packed=False, mbs=2),
        "packed_M2": mtp_step(packed=True, mbs=2),
    }
    destroy_megatron_state()
    init_megatron_state(pipeline_model_parallel_size=2)
    out["pp2_rope_M2"] = mtp_step(packed=True, mbs=2, rope=True)
    try:
        _model(megatron_groups())
    except ValueError as err:
        out["pp2_learned_error"] = str(err)
    return out
