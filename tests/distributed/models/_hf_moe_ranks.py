"""Tiny random Qwen3-MoE and Mixtral models and the rank function of the MoE HFBridge tests
(module-level: ``run_on_ranks`` pickles it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _hf_ranks import _logits_and_exports, _pipeline_forward, input_ids
from helpers.unit import TINY_HF_FIELDS

_COMMON = {**TINY_HF_FIELDS, "num_experts_per_tok": 2}


def hf_moe_configs() -> dict[str, Any]:
    """Every layer routed (4 experts, top-2): Qwen3-MoE without top-k renormalisation
    (``norm_topk_prob`` False, expert width 48) and Mixtral (always renormalised, experts of
    ``intermediate_size`` 96); and a Qwen3-MoE whose layer 0 is dense (``decoder_sparse_step``
    2: layer 1 routed) with ``norm_topk_prob`` True."""
    import transformers as t

    return {
        "qwen3_moe": t.Qwen3MoeConfig(**_COMMON, num_experts=4, moe_intermediate_size=48),
        "mixtral": t.MixtralConfig(**_COMMON, num_local_experts=4),
        "qwen3_moe_mixed": t.Qwen3MoeConfig(
            **_COMMON,
            num_experts=4,
            moe_intermediate_size=48,
            decoder_sparse_step=2,
            norm_topk_prob=True,
        ),
    }


def moe_layout_ranks(
    rank: int, dirs: dict[str, str], tp: int, pp: int, ep: int, etp: int | None, out_root: str
) -> dict[str, Any]:
    """Import each model at ``tp`` (sequence parallel when > 1) x ``pp`` x ``ep`` (expert TP
    ``etp``, ``None``: TP) and write ``save_pretrained`` to ``out_root/name``; return per model
    the padded ``[2, SEQ, V]`` logits of a last-stage rank (``None`` elsewhere) and, at TP=1 (the
    packed rows' 11 tokens do not split over a sequence-parallel TP=2), the packed
    ``PACKED_LENGTHS`` rows ``[2, SEQ, V]`` and ``export_hf_weights``' tensors."""
    from megatron.core import parallel_state as ps

    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    groups = megatron_groups()
    ids = input_ids()
    results: dict[str, Any] = {}
    for name, directory in dirs.items():
        bridge = HFBridge.from_pretrained(directory)
        config = bridge.transformer_config(groups, sequence_parallel=tp > 1)
        chunk = bridge.build_chunk(config, groups=groups).eval()
        if tp == 1:
            out = _logits_and_exports(bridge, [chunk], groups)
        else:
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            with torch.no_grad():
                padded = _pipeline_forward([chunk], ids, position_ids=positions)
            out = {"padded": padded, "packed": None, "exported": None}
        bridge.save_pretrained([chunk], Path(out_root) / name, groups=groups)
        results[name] = out if ps.is_pipeline_last_stage() else None
    return results
