"""Rank functions of the MoE routing-mask and router-replay tests (module-level: pickled).

The tiny MoE GPT (4 experts, top-2, 2 MoE layers, routers built with
``moe_enable_routing_replay=True``) runs through the package's step entries
(:func:`~lightning_mcore_rl.train.step.run_forward_only` / ``run_global_batch``); the references
are plain per-row forwards of the same chunk, where a router's tokens are simply the row's
positions (``B = 1``, sequence-first), so no layout code of the package is involved.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossFn

E, TOPK, B, S, PROMPT = 4, 2, 4, 12, 3
LENGTHS = [12, 9, 6, 10]
MOE = {
    "num_moe_experts": E, "moe_router_topk": TOPK, "add_bias_linear": False,
    "moe_enable_routing_replay": True, "calculate_per_token_loss": True,
    "moe_token_dispatcher_type": "alltoall",  # allgather needs equal token counts per EP rank
}  # fmt: skip
PG_CFG = {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2}
LR = 0.05  # one Adam step moves every weight by ~LR: enough to flip many top-2 choices


def make_batch() -> BatchedDataDict:
    """``B`` right-padded rows of lengths ``LENGTHS`` with ClippedPG fields ``[B, S]``."""
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(S)[None, :]
    lengths = torch.tensor(LENGTHS)
    real = positions < lengths[:, None]
    return BatchedDataDict(
        input_ids=torch.randint(1, 128, (B, S), generator=g) * real,
        input_lengths=lengths,
        token_mask=(real & (positions >= PROMPT)).float(),
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, S, generator=g),
        prev_logprobs=torch.full((B, S), -4.8),
        generation_logprobs=torch.full((B, S), -4.8),
    )


def _setup(ep: int) -> tuple[Any, Any, BatchedDataDict]:
    """megatron state at EP=``ep`` (DP = world size), the training setup, this rank's rows."""
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state
    from lightning_mcore_rl.testing.training import build_training

    init_megatron_state(expert_model_parallel_size=ep)
    setup = build_training(clip_grad=0.0, lr=LR, **MOE)
    groups = megatron_groups()
    rows = B // groups.dp_size
    mine = make_batch().slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows)
    return setup, groups, mine


def _context(groups: Any, packing: bool) -> Any:
    from lightning_mcore_rl.train import Microbatching, StepContext

    return StepContext(groups, Microbatching(micro_batch_size=2, sequence_packing=packing))


def _row_forward(model: Any, ids: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
    """Logits ``[S, V]`` of one row alone; ``replay [S, L, K]``: route with these experts."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from lightning_mcore_rl.extensions.moe.router_replay import chunk_routers, clear_replay
    from lightning_mcore_rl.train.model_inputs import causal_attention_mask

    if replay is not None:
        for layer, router in chunk_routers(model):
            router.router_replay.set_target_indices(replay[:, layer].contiguous())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        width = ids.shape[0]
        logits = model(ids[None], torch.arange(width)[None], causal_attention_mask(width))
    finally:
        if replay is not None:
            clear_replay([model])
    return logits[0].float()


def _row_routing(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """One row's own routing ``[S, L, K]`` (megatron's RECORD)."""
    from lightning_mcore_rl.extensions.moe.router_replay import (
        clear_replay,
        record_routing,
        recorded_routing,
    )

    record_routing([model])
    try:
        _row_forward(model, ids, None)
        return recorded_routing(model, 1)[0]
    finally:
        clear_replay([model])


def _stored_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[S]``: log p(ids[t] | < t) at t >= 1, 0 at 0 (stored-logprob convention)."""
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


class _RoutingTap:
    """Router forward hooks: per call the padding mask megatron's router got and its
    ``routing_map [N, E]``."""

    def __init__(self, model: Any) -> None:
        from megatron.core.transformer.moe.router import Router

        self.calls: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        self.handles = [
            m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)
        ]

    def _hook(self, _module: Any, args: tuple[Any, ...], output: Any) -> None:
        mask = args[1] if len(args) > 1 else None
        self.calls.append((None if mask is None else mask.reshape(-1), output[1]))

    def counts(self) -> dict[str, Any]:
        """Per-expert counts of real tokens, and the number of tokens marked as padding."""
        real = torch.zeros(E, dtype=torch.long)
        pad = 0
        for mask, routing in self.calls:
            keep = torch.ones(routing.shape[0], dtype=torch.bool) if mask is None else ~mask
            real += routing[keep].sum(0)
            pad += 0 if mask is None else int(mask.sum())
        return {"real": real, "pad": pad, "masked": all(m is not None for m, _ in self.calls)}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _logprobs_pass(setup: Any, groups: Any, batch: BatchedDataDict, packing: bool) -> Any:
    """The trainer's forward-only logprob pass, with the routing it made."""
    from lightning_mcore_rl.train import LogprobsPostProcessor
    from lightning_mcore_rl.train.step import run_forward_only

    tap = _RoutingTap(setup.chunks[0])
    try:
        out = run_forward_only(
            setup.chunks, batch, _context(groups, packing),
            LogprobsPostProcessor({"sequence_packing": {"enabled": packing}}),
        )  # fmt: skip
    finally:
        tap.remove()
    return out["logprobs"], tap


def masks_rank(_rank: int) -> dict[str, Any]:
    """One rank, no replay: padded and packed logprob passes vs every row alone (real-token
    expert counts, logprobs), and the number of tokens the routers were told are padding."""
    setup, groups, batch = _setup(1)
    del batch["generation_logprobs"]
    config = setup.config
    config.moe_enable_routing_replay = False  # routing masks only (the routers replay nothing)
    model = setup.chunks[0]
    alone_lp = []
    tap = _RoutingTap(model)
    with torch.no_grad():
        model.eval()
        for i, length in enumerate(LENGTHS):
            ids = batch["input_ids"][i, :length]
            alone_lp.append(_stored_logprobs(_row_forward(model, ids, None), ids))
        model.train()
    alone_counts = tap.counts()["real"]
    tap.remove()
    out: dict[str, Any] = {"alone_lp": alone_lp, "alone_counts": alone_counts}
    for packing in (False, True):
        lp, pass_tap = _logprobs_pass(setup, groups, batch, packing)
        out["packed" if packing else "padded"] = {"lp": lp, **pass_tap.counts()}
    return out


def replay_rank(_rank: int, ep: int) -> dict[str, Any]:
    """Router replay at EP=``ep`` (DP = world): record each row's routing at weights W0 (the
    rollout), one ClippedPG step WITH replay -> W1; the "engine" at W1 routes each row alone
    with the W0 experts (generation logprobs); the trainer's logprob pass at W1 (padded and
    packed), with and without replay; then the ``token_mult_prob_error`` of each."""
    from lightning_mcore_rl.train import LossPostProcessor
    from lightning_mcore_rl.train.step import run_global_batch

    setup, groups, batch = _setup(ep)
    model, config = setup.chunks[0], setup.config
    rows = batch.size
    with torch.no_grad():
        model.eval()
        batch["routed_experts"] = torch.stack(
            [_row_routing(model, batch["input_ids"][i]) for i in range(rows)]
        )  # [b, S, L, K] at W0
        model.train()
    loss_fn = ClippedPGLossFn(PG_CFG)
    for chunk in setup.chunks:
        chunk.zero_grad_buffer()
    train_tap = _RoutingTap(model)
    run_global_batch(
        setup.chunks, batch, _context(groups, False), loss=LossPostProcessor(loss_fn, None),
        normalizations=loss_fn.metric_normalizations,
    )  # fmt: skip
    train_tap.remove()
    setup.optimizer.step()  # W0 -> W1
    with torch.no_grad():
        model.eval()
        own = torch.stack([_row_routing(model, batch["input_ids"][i]) for i in range(rows)])
        batch["generation_logprobs"] = torch.stack(
            [
                _stored_logprobs(
                    _row_forward(model, batch["input_ids"][i], batch["routed_experts"][i]),
                    batch["input_ids"][i],
                )
                for i in range(rows)
            ]
        )
        model.train()
    real = torch.arange(S)[None, :] < batch["input_lengths"][:, None]  # [b, S]
    changed = (own.sort(-1).values != batch["routed_experts"].sort(-1).values).any(-1)  # [b,S,L]
    # of the real (token, layer, k) slots, those routed at W1 to another expert than recorded
    matched = (own[..., :, None] == batch["routed_experts"][..., None, :]).any(-1).sum(-1)
    topk = own.shape[-1]
    out: dict[str, Any] = {
        "mismatched_slots": int((topk - matched)[real].sum()),  # of real_slots * topk
        "changed_slots": int(changed[real].sum()),
        "real_slots": int(real.sum()) * changed.shape[-1],
        "train_calls": _replayed_maps(train_tap, batch),
    }
    for replay in (True, False):
        config.moe_enable_routing_replay = replay  # False: routed_experts recorded, not replayed
        for packing in (False, True):
            lp, tap = _logprobs_pass(setup, groups, batch, packing)
            scored = BatchedDataDict({**batch, "prev_logprobs": lp})
            metrics = run_global_batch(
                setup.chunks, scored, _context(groups, packing),
                loss=LossPostProcessor(loss_fn, {"sequence_packing": {"enabled": packing}}),
                normalizations=loss_fn.metric_normalizations, forward_only=True,
            ).metrics  # fmt: skip
            key = f"{'replay' if replay else 'own'}_{'packed' if packing else 'padded'}"
            out[key] = {
                "lp": lp, "gen": batch["generation_logprobs"],
                "mask": batch["token_mask"], "tmpe": float(metrics["token_mult_prob_error"]),
                "router_mismatch": float(metrics["moe/router_mismatch_fraction"]),
            }  # fmt: skip
            if not packing:
                out[key]["calls"] = _replayed_maps(tap, batch)
    config.moe_enable_routing_replay = True
    return out


def _replayed_maps(tap: _RoutingTap, batch: BatchedDataDict) -> dict[str, int]:
    """Padded passes of 2-row microbatches: router call ``c`` (microbatch ``c // L``, layer
    ``c % L``) sees ``[S, 2]`` sequence-first; count the real tokens whose routing map is not
    the one-hot of ``routed_experts``."""
    layers = batch["routed_experts"].shape[2]
    wrong = total = 0
    for c, (_mask, routing) in enumerate(tap.calls):
        mb, layer = divmod(c, layers)
        rows = slice(2 * mb, 2 * mb + 2)
        expected = torch.zeros(S, 2, E, dtype=torch.bool)
        expected.scatter_(2, batch["routed_experts"][rows, :, layer].transpose(0, 1), True)
        real = (torch.arange(S)[:, None] < batch["input_lengths"][rows][None, :]).reshape(-1)
        diff = (routing.reshape(S * 2, E) != expected.reshape(S * 2, E)).any(-1)
        wrong += int(diff[real].sum())
        total += int(real.sum())
    return {"wrong": wrong, "total": total}
