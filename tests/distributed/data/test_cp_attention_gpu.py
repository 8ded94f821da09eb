"""Transformer Engine's context-parallel THD attention (``TEDotProductAttention``, CP=2 over
NCCL, bf16, two GPUs): each rank's output and q/k/v gradients on its zigzag shard of every span
equal its shard of plain per-span causal attention on the full row (the same reference and
layout as the CPU ``PackedDotProductAttention`` test). With one GPU it checks TE's THD path at
CP=1 against the same reference and skips the CP=2 case. Real TE kernels: nothing emulated."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _cp_attention_ranks import full_inputs, packed_params, reference_attention

SPANS = [16, 24, 8, 16]  # multiples of 2*CP = 4, no empty span (TE's kernels need len >= 1)
BF16_RTOL = 2e-2  # max |TE - ref| / max |ref|: bf16 inputs (8 mantissa bits), fp32 accumulation


def _te_cp_rank(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from lightning_mcore_rl.data import cp_local_indices

    ps.initialize_model_parallel(context_parallel_size=world)
    heads, groups, head_dim = 4, 2, 8
    config = TransformerConfig(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
        num_query_groups=groups, context_parallel_size=world, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16,
    )  # fmt: skip
    attention = TEDotProductAttention(config, 1, AttnMaskType.padding_causal, "self",
                                      cp_comm_type="p2p")  # fmt: skip
    params = packed_params(SPANS, "cuda")
    full = full_inputs(SPANS)
    leaves = {n: full[n].clone().requires_grad_() for n in "qkv"}
    ref = reference_attention(leaves["q"], leaves["k"], leaves["v"], SPANS)
    (ref * full["w"]).sum().backward()
    mine = cp_local_indices(params.cu_seqlens_q.cpu(), rank, world)
    local = {n: full[n][mine].cuda().bfloat16().requires_grad_() for n in "qkv"}
    out = attention(local["q"], local["k"], local["v"], None, packed_seq_params=params)
    (out.float() * full["w"][mine].cuda()).sum().backward()
    diffs = {"out": _relative(out, ref.detach()[mine])}
    for n in "qkv":
        grad, expected = local[n].grad, leaves[n].grad
        assert grad is not None and expected is not None
        diffs[f"d{n}"] = _relative(grad, expected[mine])
    queue.put((rank, diffs))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double().cpu() - reference).abs().max() / reference.abs().max())


def _run(world: int) -> list[dict[str, float]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_te_cp_rank, args=(world, port, queue), nprocs=world, start_method="spawn")
    results = dict(queue.get(timeout=60) for _ in range(world))
    return [results[r] for r in range(world)]


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [1, 2])
def test_te_cp_attention_matches_full_causal_attention(cp: int) -> None:
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs Transformer Engine")
    if torch.cuda.device_count() < cp:
        pytest.skip(f"CP={cp} needs {cp} GPUs (NCCL allows one rank per GPU)")
    for diffs in _run(cp):
        print(f"CP={cp}: max |TE - reference| / max |reference| {diffs}")
        assert max(diffs.values()) <= BF16_RTOL, diffs
