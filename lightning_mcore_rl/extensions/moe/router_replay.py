"""MoE router replay: route the training forward with the experts a rollout recorded."""

# `routed_experts [B, S, L, K]`: token `(b, s)`'s top-`K` expert ids at MoE layer `l` of the
# whole model, `L` counted over every pipeline stage, `K = moe_router_topk`.
# megatron's `TopKRouter` (`moe_enable_routing_replay=True`) replays per router an `[N, K]` int64
# tensor in the token order it sees, the layer input `[s, b, H]` flattened sequence-first
# (`n = s * b_size + b`): `routed_token_index` and `routed_experts_in_model_order` build that
# order, `arm_replay_forward` hands each router its layer's slice.

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from lightning_mcore_rl.parallel import unwrap_model

ROUTED_EXPERTS = "routed_experts"
"""Batch key of the recorded routing ``[B, S, L, K]``."""


def moe_layer_numbers(config: Any) -> list[int]:
    """The global (1-based) layer numbers of the whole model's MoE layers, in order; `[]` for a
    dense model."""
    if not getattr(config, "num_moe_experts", None):
        return []
    freq = config.moe_layer_freq
    # megatron's moe_layer_freq: an int f makes every f-th layer MoE, a list is the 0/1 pattern
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    else:
        pattern = list(freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


def chunk_routers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """`(MoE layer index l, router)` for every router of this chunk, in layer order.

    Raises:
        ValueError: a router without megatron's replay state (no `moe_enable_routing_replay`).
    """
    from megatron.core.transformer.moe.router import Router

    inner = unwrap_model(model)
    numbers = moe_layer_numbers(cast(Any, inner).config)
    found = []
    for module in inner.modules():
        if not isinstance(module, Router):
            continue
        if getattr(module, "router_replay", None) is None:
            raise ValueError(
                "router replay needs routers built with `moe_enable_routing_replay=True` in the "
                "TransformerConfig (MCoreRLModule.transformer_config(moe_enable_routing_replay="
                "True)); this chunk's routers have no replay state"
            )
        found.append((numbers.index(cast(int, module.layer_number)), module))
    return found


def replay_enabled(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks' MoE routers were built for replay (``moe_enable_routing_replay``)."""
    from megatron.core.utils import get_model_config

    return any(
        bool(getattr(get_model_config(chunk), "moe_enable_routing_replay", False))
        for chunk in chunks
    )


def check_routed_experts(batch: Mapping[str, Any], config: Any) -> bool:
    """Validate `batch[ROUTED_EXPERTS]` against the model; returns whether the pass replays.

    Raises:
        ValueError: the key missing while the routers replay; a shape other than `[B, S, L, K]`;
            expert ids outside `[0, E)`; a real token with the same expert twice in one layer.
        TypeError: a non-integer tensor.
    """
    # host only, before any collective; `input_lengths [B]` (optional) marks padding positions,
    # whose ids the step replaces
    # replay on: the key is required
    enabled = bool(getattr(config, "moe_enable_routing_replay", False))
    if ROUTED_EXPERTS not in batch:
        if enabled:
            raise ValueError(
                f"the model's routers replay (`moe_enable_routing_replay=True`) but the batch "
                f"has no `{ROUTED_EXPERTS}` [B, S, L, K]; keys: {sorted(batch)}. Record it in "
                "the rollout (the rollout sources return it) or build the model without replay"
            )
        return False
    experts = batch[ROUTED_EXPERTS]
    if not isinstance(experts, Tensor) or experts.is_floating_point() or experts.is_complex():
        raise TypeError(
            f"`{ROUTED_EXPERTS}` must be an integer tensor [B, S, L, K], got "
            f"{getattr(experts, 'dtype', type(experts).__name__)}"
        )
    ids = cast(Tensor, batch["input_ids"])
    expected = (*ids.shape, len(moe_layer_numbers(config)), config.moe_router_topk)
    if tuple(experts.shape) != expected:
        raise ValueError(
            f"`{ROUTED_EXPERTS}` must be [B, S, L, K] = {list(expected)} (L = MoE layers of the "
            f"model, K = moe_router_topk), got {list(experts.shape)}"
        )
    num_experts = config.num_moe_experts
    outside = (experts < 0) | (experts >= num_experts)
    if bool(outside.any()):
        b, s, layer, _ = (int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"`{ROUTED_EXPERTS}` ids must lie in [0, {num_experts}), got min "
            f"{int(experts.min())}, max {int(experts.max())}; first at sample {b}, token {s}, "
            f"MoE layer {layer}: {experts[b, s, layer].tolist()}"
        )
    _check_unique_experts(experts, batch.get("input_lengths"))
    return enabled


def _check_unique_experts(experts: Tensor, lengths: Tensor | None) -> None:
    """Refuse a real token of `experts [B, S, L, K]` whose top-`K` at some layer names an expert
    twice (real: position `< lengths[b]`; every position without `lengths [B]`).

    Raises:
        ValueError: naming the first such sample, token, layer and its ids.
    """
    # megatron would replay a repeated id silently: the token would reach fewer than K experts
    if experts.shape[-1] < 2 or experts.numel() == 0:
        return
    ordered = experts.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)  # [B, S, L]
    if lengths is not None:  # padding positions hold fillers (the recipes write zeros)
        width = experts.shape[1]
        columns = torch.arange(width, device=experts.device)[None, :]
        real = columns < lengths.to(experts.device).reshape(-1, 1)  # [B, S]
        repeated &= real[:, :, None]
    if not bool(repeated.any()):
        return
    b, s, layer = (int(i) for i in repeated.nonzero()[0])
    raise ValueError(
        f"`{ROUTED_EXPERTS}` must name {experts.shape[-1]} distinct experts per token and MoE "
        f"layer (the router's top-k), got {experts[b, s, layer].tolist()} at sample {b}, token "
        f"{s}, MoE layer {layer}; a repeated id would send the token to fewer experts"
    )


def routed_token_index(
    batch: int,
    width: int,
    lengths: Tensor | None,
    *,
    model_width: int | None = None,
    packed_index: Tensor | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """The flat index `b * S + s` of the source token of every token the routers see, `-1` at
    padding: `[S_pad * B]` (sequence-first, `n = s * B + b`) or `[T/CP]` int64.

    Args:
        lengths: `[B]` real lengths (`None`: every position of the `S = width` columns is real).
        model_width: padded layout: the model's input width `S_pad >= S`.
        packed_index: packed layout: `[1, T/CP]`, the packer's output for `packable_token_ids`.
    """
    # packed: this CP rank's THD row (zigzag shards of every span, span and bin padding
    # included), located by the same packer the input ids go through
    if packed_index is not None:
        return packed_index[0].long() - 1
    source = torch.arange(batch * width, device=device).view(batch, width)  # [B, S]: b*S + s
    if lengths is not None:
        real = torch.arange(width, device=device)[None, :] < lengths.to(device)[:, None]
        source = torch.where(real, source, -1)
    pad = (model_width or width) - width
    source = torch.nn.functional.pad(source, (0, pad), value=-1)  # [B, S_pad]
    return source.transpose(0, 1).reshape(-1)  # [S_pad, B] flattened sequence-first


def packable_token_ids(batch: int, width: int, device: torch.device | str = "cpu") -> Tensor:
    """``[B, S]`` ids ``b * S + s + 1``: packed like the input ids, they locate every token of
    the THD row (0 = padding)."""
    return torch.arange(1, batch * width + 1, device=device).view(batch, width)


def routed_experts_in_model_order(routed_experts: Tensor, token_index: Tensor) -> Tensor:
    """Gather `routed_experts [B, S, L, K]` into the routers' token order `[N, L, K]` int64
    (padding tokens, `token_index == -1`, get experts `0..K-1`)."""
    # the fillers of padding tokens stay out of the aux loss: the padding mask drops them
    flat = routed_experts.reshape(-1, *routed_experts.shape[2:]).long()  # [B*S, L, K]
    topk = routed_experts.shape[-1]
    filler = torch.arange(topk, device=flat.device).expand(flat.shape[1], topk)  # [L, K]
    token_index = token_index.to(flat.device)
    gathered = flat[token_index.clamp(min=0)]  # [N, L, K]
    return torch.where((token_index < 0)[:, None, None], filler, gathered)


def sequence_parallel_slice(tokens: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's contiguous share of the token dim (megatron's SP split of ``[s, b, H]``
    along ``s``, which is a contiguous block of the sequence-first flattening)."""
    if tp_size == 1:
        return tokens
    if tokens.shape[0] % tp_size != 0:
        raise ValueError(
            f"{tokens.shape[0]} routed tokens do not split over TP={tp_size} "
            "(sequence parallelism); the layout padding must make the width a multiple of TP"
        )
    return tokens.chunk(tp_size, dim=0)[tp_rank]


def arm_replay_forward(
    model: torch.nn.Module, routed_experts: Tensor, tp_rank: int, tp_size: int
) -> None:
    """Give every router of `model` its layer's `[N, K]` of `routed_experts [N, L, K]` and arm
    REPLAY_FORWARD."""
    # this stage's / virtual chunk's layers only; `routed_experts` is in the model's token order
    # before sequence parallelism
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.utils import get_model_config

    # under SP each TP rank's routers see its contiguous share of the sequence-first tokens
    sp = bool(get_model_config(model).sequence_parallel)
    local = sequence_parallel_slice(routed_experts, tp_rank, tp_size if sp else 1)
    for layer, router in chunk_routers(model):
        router.router_replay.set_target_indices(local[:, layer, :].contiguous())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def after_replay_forward(model: torch.nn.Module, train: bool) -> None:
    """After a replayed forward: arm REPLAY_BACKWARD (`train`) or clear the action."""
    # NeMo RL's router_replay_train: activation recompute in the backward pops the same
    # microbatch's indices (megatron keeps one FIFO per router)
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, router in chunk_routers(model):
        if train:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        else:
            router.router_replay.clear_router_replay_action()


def clear_replay(chunks: Sequence[torch.nn.Module]) -> None:
    """Drop every router's replay indices and action (those of ``chunks`` only)."""
    for chunk in chunks:
        for _, router in chunk_routers(chunk):
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


@contextlib.contextmanager
def router_replay_pass(chunks: Sequence[torch.nn.Module], enabled: bool) -> Iterator[None]:
    """Clear the chunks' replay state before and after a replayed pass (also on error)."""
    # no stale indices or action may leak into the next pass or into generation
    if not enabled:
        yield
        return
    clear_replay(chunks)
    try:
        yield
    finally:
        clear_replay(chunks)


def record_routing(chunks: Sequence[torch.nn.Module]) -> None:
    """Arm RECORD on every router of ``chunks`` (`recorded_routing` reads the result)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for chunk in chunks:
        for _, router in chunk_routers(chunk):
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)


def recorded_routing(model: torch.nn.Module, batch: int) -> Tensor:
    """The last forward's routing of this chunk's routers as ``[B, s, L_chunk, K]`` (layer
    order), from megatron's per-router ``[s * B, K]`` (sequence-first)."""
    per_layer = []
    for _, router in chunk_routers(model):
        recorded = router.router_replay.get_recorded_indices()  # [s*B, K]
        per_layer.append(recorded.view(-1, batch, recorded.shape[-1]).transpose(0, 1))
    return torch.stack(per_layer, dim=2)


__all__ = [
    "ROUTED_EXPERTS",
    "after_replay_forward",
    "arm_replay_forward",
    "check_routed_experts",
    "chunk_routers",
    "clear_replay",
    "moe_layer_numbers",
    "packable_token_ids",
    "record_routing",
    "recorded_routing",
    "replay_enabled",
    "routed_experts_in_model_order",
    "routed_token_index",
    "router_replay_pass",
    "sequence_parallel_slice",
]
