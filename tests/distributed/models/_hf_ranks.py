"""Tiny random Hugging Face models and the rank functions of the HFBridge tests.

``build_hf_models`` runs in the pytest process (transformers reference); the ``*_ranks`` functions
run on :func:`~lightning_mcore_rl.testing.run_on_ranks` ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from helpers.unit import TINY_HF_FIELDS, word_level_tokenizer

VOCAB = 128
SEQ = 10
PACKED_LENGTHS = (7, 4)
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
_COMMON = {**TINY_HF_FIELDS, "vocab_size": VOCAB}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def hf_configs() -> dict[str, Any]:
    """The tested architectures (2 layers, h=64, 4 heads, 2 KV groups, V=128, F=96)."""
    import transformers as t

    return {
        "llama": t.LlamaConfig(**_COMMON),
        "llama3_rope": t.LlamaConfig(
            **_COMMON, max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE
        ),
        "qwen2_tied": t.Qwen2Config(**_COMMON, tie_word_embeddings=True),
        "qwen3": t.Qwen3Config(**_COMMON, head_dim=32),
        "mistral": t.MistralConfig(**_COMMON, sliding_window=None),
    }


def window_configs() -> dict[str, Any]:
    """Sliding-window architectures shorter than ``SEQ`` (and ``PACKED_LENGTHS[0]``): Mistral
    windowed on every layer, one whose window equals ``max_position_embeddings`` (run past it),
    and Qwen2 windowed from layer ``max_window_layers = 1`` on (the PP=2 stage 1 layer)."""
    import transformers as t

    return {
        "mistral_window": t.MistralConfig(**_COMMON, sliding_window=4),
        "mistral_window_at_max": t.MistralConfig(
            **_COMMON, sliding_window=8, max_position_embeddings=8
        ),
        "qwen2_window": t.Qwen2Config(
            **_COMMON, use_sliding_window=True, sliding_window=3, max_window_layers=1
        ),
    }


def tiny_tokenizer() -> Any:
    """A WordLevel tokenizer (``PreTrainedTokenizerFast``) with a simple chat template."""
    words = ["<unk>", "<pad>", "<s>", "</s>", "<user>", "<assistant>", "hello", "world", "hi"]
    return word_level_tokenizer(words, CHAT_TEMPLATE)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter (norms ``1 + 0.2 N``, others ``0.05 N``)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.05 * noise)


def build_hf_model(config: Any, directory: Path, seed: int) -> Any:
    """Save a randomised fp32 ``AutoModelForCausalLM`` + tokenizer into ``directory``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return model


def input_ids() -> torch.Tensor:
    """``[2, SEQ]`` token ids."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, V]`` fp32 logits of an HF causal LM."""
    return model(input_ids=ids).logits.float()


def _pipeline_forward(chunks: list[torch.nn.Module], tokens: torch.Tensor, **kw: Any) -> Any:
    """Forward through all PP/VPP stages with blocking p2p; TP-gathered ``[b, s, V]`` logits on
    the last stage, ``None`` elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    positions = kw.pop("position_ids")
    result = None
    for vp, chunk in enumerate(chunks):
        stage = None if len(chunks) == 1 else vp
        config = chunk.config
        if not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage):
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], config.hidden_size)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            chunk.set_input_tensor(hidden)
        out = chunk(tokens, positions, None, **kw)
        if not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage):
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            continue
        group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, out.contiguous(), group=group)
        result = torch.cat(parts, dim=-1)
    return result


@torch.no_grad()
def _logits_and_exports(bridge: Any, chunks: list[torch.nn.Module], groups: Any) -> dict[str, Any]:
    from lightning_mcore_rl.data import pack_sequences, packed_position_ids, unpack_sequences

    ids = input_ids()
    positions = torch.arange(SEQ).expand(2, SEQ)
    padded = _pipeline_forward(chunks, ids, position_ids=positions)
    lengths = torch.tensor(PACKED_LENGTHS)
    packed = pack_sequences(ids, lengths)
    packed_out = _pipeline_forward(
        chunks,
        packed.packed_local,
        position_ids=packed_position_ids(packed.cu_seqlens_padded),
        packed_seq_params=packed.packed_seq_params,
    )
    rows = None
    if packed_out is not None:
        rows = unpack_sequences(packed_out, packed.cu_seqlens, packed.cu_seqlens_padded, SEQ)
    exported = dict(bridge.export_hf_weights(chunks, groups))
    return {"padded": padded, "packed": rows, "exported": exported}


def layout_ranks(
    rank: int, dirs: dict[str, str], tp: int, pp: int, vpp: int | None, out_root: str
) -> dict[str, Any]:
    """Import each model at ``tp`` x ``pp`` (x ``vpp``); return last-stage logits (padded and
    packed), the exported HF tensors (rank 0) and write ``save_pretrained`` to ``out_root/name``."""
    from megatron.core import parallel_state as ps

    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    groups = megatron_groups()
    reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    results: dict[str, Any] = {}
    for name, directory in dirs.items():
        bridge = HFBridge.from_pretrained(directory)
        config = bridge.transformer_config(groups)
        stages = [None] if vpp is None else list(range(vpp))
        chunks = [bridge.build_chunk(config, vp_stage=s, groups=groups).eval() for s in stages]
        out = _logits_and_exports(bridge, chunks, groups)
        out_dir = Path(out_root) / name
        bridge.save_pretrained(chunks, out_dir, groups=groups, max_shard_bytes=40_000)
        results[name] = {
            "padded": out["padded"] if reporter else None,
            "packed": out["packed"] if reporter else None,
            "exported": out["exported"] if rank == 0 else None,
            "norm": megatron_norm(chunks),
        }
    return results


@torch.no_grad()
def megatron_norm(chunks: list[torch.nn.Module]) -> float:
    """The global norm megatron's optimizer would compute for gradients equal to the weights:
    its filter (``get_main_grads_for_grad_norm``: not shared, not a TP duplicate) and
    ``get_grad_norm_fp32`` over the model-parallel group."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    tensors = [
        p.detach().float()
        for chunk in chunks
        for p in chunk.parameters()
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
    ]
    return float(
        get_grad_norm_fp32(tensors, grad_stats_parallel_group=ps.get_model_parallel_group())
    )


def vocab_error_ranks(rank: int, directory: str) -> str:
    """TP=2 import of a model whose vocab is odd: the error message."""
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state(tensor_model_parallel_size=2)
    groups = megatron_groups()
    bridge = HFBridge.from_pretrained(directory)
    try:
        bridge.build_chunk(bridge.transformer_config(groups), groups=groups)
    except ValueError as err:
        return str(err)
    return "no error"


@torch.no_grad()
def cp_window_ranks(rank: int, dirs: dict[str, str]) -> dict[str, torch.Tensor]:
    """CP=2 import of each model; packed ``PACKED_LENGTHS`` input (spans padded to 2*CP) run on
    each rank's zigzag shard, gathered over CP and unpacked to ``[2, SEQ, V]`` logits."""
    import torch.distributed as dist

    from lightning_mcore_rl.data import pack_sequences, packed_position_ids, unpack_sequences
    from lightning_mcore_rl.data.packing import restore_packed_from_cp_shards
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state(context_parallel_size=2)
    groups = megatron_groups()
    cp_rank, group = groups.cp_rank, groups.cp_group
    packed = pack_sequences(
        input_ids(), torch.tensor(PACKED_LENGTHS), pad_individual=4, cp_rank=cp_rank, cp_size=2
    )
    positions = packed_position_ids(packed.cu_seqlens_padded, cp_rank, 2)
    results = {}
    for name, directory in dirs.items():
        bridge = HFBridge.from_pretrained(directory)
        chunk = bridge.build_chunk(bridge.transformer_config(groups), groups=groups).eval()
        local = chunk(
            packed.packed_local, positions, None, packed_seq_params=packed.packed_seq_params
        ).contiguous()  # [1, T/CP, V]
        shards = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(shards, local, group=group)
        full = restore_packed_from_cp_shards(shards, packed.cu_seqlens_padded)
        results[name] = unpack_sequences(full, packed.cu_seqlens, packed.cu_seqlens_padded, SEQ)
    return results
